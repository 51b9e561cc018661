"""Qwen3.5's gated DeltaNet mixer (`jaxdepth.core.linear_attention`) against transformers' own
torch functions, called here on the same float32 tensors, and against the same computation in
float64 (`exact_rule`, the recurrence transcribed in float64) for what float32 costs.

Tolerances come from float32 rounding as measured (printed with -s). The rule (T = 300, outputs
of scale 0.39, states of 0.92): transformers' chunked form is 4.9e-7 from the float64 result and
this one 9.8e-7, 1.3e-6 apart; the states up to 2.5e-6 apart: RULE_TOL 2e-6, STATE_TOL 5e-6.
The mixer (outputs of scale 4.4): transformers' float32 mixer is 1.4e-5 from its float64 one,
and so is this one; the gated RMSNorm of each value head divides by that head's norm, which
amplifies the rule's rounding where a head's output is small: MIXER_TOL 5e-5 (1e-5 relative).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxdepth.core import linear_attention as la
from jaxdepth.core.linear_attention import (
    LinearAttentionShape,
    LinearState,
    causal_conv,
    gated_delta_net,
    gated_delta_rule,
)

torch = pytest.importorskip("torch")
M = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("highest_precision")]

RULE_TOL = 2e-6
STATE_TOL = 5e-6
MIXER_TOL = 5e-5

B, T, HK, HV, DK, DV = 2, 300, 2, 4, 16, 16


def diff(a, b) -> float:
    b = b.detach().numpy() if isinstance(b, torch.Tensor) else b
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def check(a, b, what: str, tol: float) -> float:
    d = diff(a, b)
    print(f"\n[linear attention] {what}: max |diff| = {d:.3e} (tol {tol:.0e})")
    assert d <= tol, f"{what}: max |diff| {d:.3e} > {tol}"
    return d


def rule_inputs(seed: int = 0, T: int = T):
    """Raw q, k, v, a log decay g <= 0 from strong (exp(-4) a step) to slight, beta in (0, 1),
    and a nonzero state to start from."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    q, k, v = f(B, T, HK, DK), f(B, T, HK, DK), f(B, T, HV, DV)
    g = -np.exp(rng.uniform(-5, 1.4, (B, T, HV))).astype(np.float32)
    beta = (1 / (1 + np.exp(-f(B, T, HV)))).astype(np.float32)
    state = 0.3 * f(B, HV, DK, DV)
    return q, k, v, g, beta, state


def torch_rule(form: str, q, k, v, g, beta, state, chunk: int = 64):
    t = lambda a: None if a is None else torch.from_numpy(np.asarray(a))
    kwargs = dict(initial_state=t(state), output_final_state=True, use_qk_l2norm_in_kernel=True)
    if form == "chunk":
        kwargs["chunk_size"] = chunk
        return M.torch_chunk_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), **kwargs)
    return M.torch_recurrent_gated_delta_rule(t(q), t(k), t(v), t(g), t(beta), **kwargs)


def exact_rule(q, k, v, g, beta, initial_state=None, **_):
    """The gated delta rule in float64, step by step from its equations (transformers' functions
    cast to float32 inside): the value float32 rounding is measured from."""
    dtype = q.dtype
    q, k, v, g, beta = (a.double() for a in (q, k, v, g, beta))
    group = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
    unit = lambda a: a / (a.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    q, k = unit(q) / q.shape[-1] ** 0.5, unit(k)
    S = torch.zeros(k.shape[0], k.shape[2], k.shape[3], v.shape[3], dtype=torch.float64)
    S = S if initial_state is None else initial_state.double()
    out = []
    for t in range(k.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1).to(dtype), S


rule = jax.jit(gated_delta_rule, static_argnames="chunk")


@pytest.fixture(scope="module")
def inputs():
    return rule_inputs()


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("start", ["zeros", "state"])
def test_recurrent_form_equals_transformers(inputs, start):
    q, k, v, g, beta, state = inputs
    state = None if start == "zeros" else state
    out, final = rule(q, k, v, g, beta, state)
    ref, ref_final = torch_rule("recurrent", q, k, v, g, beta, state)
    check(out, ref, f"recurrent form from {start}, outputs", RULE_TOL)
    check(final, ref_final, f"recurrent form from {start}, final state", STATE_TOL)


@pytest.mark.parametrize("chunk", [64, 48])  # 48 does not divide 300: the last chunk is padded
def test_chunked_form_equals_transformers(inputs, chunk):
    q, k, v, g, beta, state = inputs
    out, final = rule(q, k, v, g, beta, state, chunk=chunk)
    ref, ref_final = torch_rule("chunk", q, k, v, g, beta, state, chunk)
    check(out, ref, f"chunked form (chunk {chunk}), outputs", RULE_TOL)
    check(final, ref_final, f"chunked form (chunk {chunk}), final state", STATE_TOL)
    exact, exact_final = exact_rule(*(torch.from_numpy(a) for a in inputs))
    print(f"\n[linear attention] transformers' chunked form vs float64: {diff(ref, exact):.3e}")
    check(out, exact, f"chunked form (chunk {chunk}) vs float64, outputs", RULE_TOL)
    check(final, exact_final, f"chunked form (chunk {chunk}) vs float64, final state", STATE_TOL)


def test_the_two_forms_agree(inputs):
    q, k, v, g, beta, state = inputs
    out, final = rule(q, k, v, g, beta, state)
    out_c, final_c = rule(q, k, v, g, beta, state, chunk=64)
    check(out_c, out, "chunked vs recurrent, outputs", RULE_TOL)
    check(final_c, final, "chunked vs recurrent, final state", STATE_TOL)
    assert np.abs(np.asarray(out)).max() > 0.1 and np.abs(np.asarray(final)).max() > 0.1  # not vacuous


@pytest.mark.parametrize("chunk", [None, 64])
def test_rule_continues_from_its_state(inputs, chunk):
    """Positions 0..s-1, then s..T-1 from the returned state, equal the whole sequence at once;
    and a prefill followed by one-token steps (decoding) too."""
    q, k, v, g, beta, state = inputs
    whole, whole_final = rule(q, k, v, g, beta, state, chunk=chunk)
    cut = lambda lo, hi: tuple(a[:, lo:hi] for a in (q, k, v, g, beta))
    for s in (1, 64, 157, 299):
        first, mid = rule(*cut(0, s), state, chunk=chunk)
        second, final = rule(*cut(s, T), mid, chunk=chunk)
        check(np.concatenate([first, second], axis=1), whole, f"chunk {chunk}, split at {s}, outputs", RULE_TOL)
        check(final, whole_final, f"chunk {chunk}, split at {s}, final state", STATE_TOL)
    outs, carried = [], None
    out, carried = rule(*cut(0, T - 6), state, chunk=chunk)
    outs.append(out)
    for t in range(T - 6, T):  # decoding: the recurrent form, one position a call
        out, carried = rule(*cut(t, t + 1), carried)
        outs.append(out)
    check(np.concatenate(outs, axis=1), whole, f"chunk {chunk} prefill, then 6 one-token steps", RULE_TOL)
    check(carried, whole_final, f"chunk {chunk} prefill, then 6 one-token steps, final state", STATE_TOL)


# ----------------------------------------------------------------------------- the convolution


def test_conv_equals_transformers_and_continues():
    rng = np.random.default_rng(1)
    C, K = 24, 4
    x = rng.standard_normal((B, 50, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    tx, tw = torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w)
    y, state = causal_conv(x, w)
    ref = M.causal_conv1d_fn(tx, tw, None, activation="silu").transpose(1, 2)
    check(y, ref, "causal conv from the start", 2e-6)  # outputs up to ~8: an ulp is 9.5e-7
    check(state, np.swapaxes(x[:, -(K - 1) :], 1, 2), "causal conv state: the last K-1 inputs", 0.0)
    # a state continues a sequence as transformers' update does (it writes its state in place)
    first, mid = causal_conv(x[:, :20], w)
    conv_state = torch.from_numpy(np.array(mid))
    ref_rest = M.causal_conv1d_update(tx[:, :, 20:].contiguous(), conv_state, tw, None, "silu").transpose(1, 2)
    rest, final = causal_conv(x[:, 20:], w, mid)
    check(rest, ref_rest, "causal conv continued from a state", 2e-6)
    check(final, conv_state, "causal conv state after continuing", 0.0)
    for s in (1, 2, 3, 37):  # splits shorter than K-1 keep part of the old state
        a, st = causal_conv(x[:, :s], w)
        b, st2 = causal_conv(x[:, s:], w, st)
        check(np.concatenate([a, b], axis=1), y, f"causal conv split at {s}", 0.0)
        check(st2, state, f"causal conv split at {s}, state", 0.0)
    steps, st = [], None
    for t in range(6):  # one position at a time, as decoding runs
        out, st = causal_conv(x[:, t : t + 1], w, st)
        steps.append(out)
    check(np.concatenate(steps, axis=1), y[:, :6], "causal conv, one position a call", 0.0)


# ----------------------------------------------------------------------------- the mixer


def tiny_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=DK,
        linear_value_head_dim=DV,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],
        vocab_size=128,
    )


def make_mixer():
    """transformers' mixer with seeded random weights, the same weights as jaxdepth's `p`, and its
    shape read from the config."""
    config = tiny_config()
    module = M.Qwen3_5GatedDeltaNet(config, 0).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, w in module.named_parameters():
            if name == "A_log":  # as transformers initialises it: log of U(0.01, 16)
                w.copy_(torch.log(torch.empty(w.shape).uniform_(0.01, 16, generator=gen)))
            elif name == "dt_bias":
                w.copy_(torch.randn(w.shape, generator=gen))
            elif name == "norm.weight":
                w.copy_(1 + 0.3 * torch.randn(w.shape, generator=gen))
            elif name == "conv1d.weight":
                w.copy_(0.5 * torch.randn(w.shape, generator=gen))
            else:  # the projections: unit-scale outputs on unit-scale inputs
                w.copy_(torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5)
    jnp_of = lambda w: jnp.asarray(w.detach().numpy())
    p = {
        "linear_qkv": jnp_of(module.in_proj_qkv.weight.T),
        "linear_z": jnp_of(module.in_proj_z.weight.T),
        "linear_b": jnp_of(module.in_proj_b.weight.T),
        "linear_a": jnp_of(module.in_proj_a.weight.T),
        "linear_conv": jnp_of(module.conv1d.weight[:, 0]),
        "linear_dt_bias": jnp_of(module.dt_bias),
        "linear_A_log": jnp_of(module.A_log),
        "linear_norm": jnp_of(module.norm.weight),
        "linear_out": jnp_of(module.out_proj.weight.T),
    }
    shape = LinearAttentionShape.from_hf(config.to_dict())
    assert shape == LinearAttentionShape(HK, HV, DK, DV, 4, 1e-6)
    return config, module, p, shape


@pytest.fixture(scope="module")
def mixer():
    return make_mixer()


def hidden(seed: int, T: int = T, batch: int = B):
    return np.random.default_rng(seed).standard_normal((batch, T, 64)).astype(np.float32)


def torch_mixer(module, x, **kwargs):
    with torch.no_grad():
        return module(torch.from_numpy(np.asarray(x)), **kwargs).numpy()


net = jax.jit(gated_delta_net, static_argnames=("shape", "chunk"))


def test_mixer_equals_transformers(mixer, monkeypatch):
    _, module, p, shape = mixer
    x = hidden(2)
    ref = torch_mixer(module, x)
    out, state = net(p, x, shape)
    check(out, ref, "mixer, T=300, batch 2", MIXER_TOL)
    assert np.abs(ref).max() > 1.0
    with monkeypatch.context() as patched:
        patched.setattr(M, "torch_chunk_gated_delta_rule", exact_rule)
        exact = torch_mixer(copy.deepcopy(module).double(), x.astype(np.float64))
    print(f"\n[linear attention] transformers' float32 mixer vs float64: {diff(ref, exact):.3e}")
    check(out, exact, "mixer vs the float64 mixer", MIXER_TOL)
    out_r, _ = net(p, x, shape, chunk=None)
    check(out_r, ref, "mixer with the recurrent form", MIXER_TOL)
    # a right-padded row: its valid prefix as that prompt alone, whatever the padding holds
    n = 211
    padded = x.copy()
    padded[1, n:] = 100 * hidden(3, T - n, 1)[0]
    valid = np.arange(T)[None, :] < np.array([[T], [n]])
    out_p, _ = net(p, padded, shape, valid=jnp.asarray(valid))
    check(out_p[0], ref[0], "padded batch, the full row", MIXER_TOL)
    check(out_p[1, :n], torch_mixer(module, x[1:, :n])[0], "padded batch, the padded row's prompt alone", MIXER_TOL)
    ref_masked = torch_mixer(module, padded, attention_mask=torch.from_numpy(valid.astype(np.int64)))
    check(out_p[:, :n], ref_masked[:, :n], "padded batch against transformers' masked mixer", MIXER_TOL)


def test_state_is_each_rows_at_its_end(mixer):
    """The state a masked run returns is each row's after its last valid position: a right-padded
    row's equals its prompt run alone, and continuing from it equals the whole sequence; a mask
    of the positions before P gives the state at P, whatever follows."""
    _, _, p, shape = mixer
    x = hidden(11, 90)
    ends = np.array([90, 37])
    valid = np.arange(90)[None, :] < ends[:, None]
    padded = np.where(valid[..., None], x, 50 * hidden(12, 90))
    _, state = net(p, padded, shape, valid=jnp.asarray(valid))
    for b, n in enumerate(ends):
        _, alone = net(p, x[b : b + 1, :n], shape)
        check(state.conv[b], alone.conv[0], f"row {b} (ends at {n}), conv state", 0.0)
        check(state.recurrent[b], alone.recurrent[0], f"row {b} (ends at {n}), recurrent state", STATE_TOL)
    whole, _ = net(p, x, shape)
    for P in (1, 2, 37, 64):  # within and past the conv's K-1, at and past a chunk's end
        before = jnp.asarray(np.broadcast_to(np.arange(90) < P, (B, 90)))
        _, at_p = net(p, x, shape, valid=before)
        rest, _ = net(p, x[:, P:], shape, state=at_p)
        check(rest, whole[:, P:], f"continued from the state at {P}", MIXER_TOL)


def test_mixer_state_equals_transformers_cache(mixer):
    """Prefill then one-token steps, against the mixer running with transformers' cache: the
    outputs, and the states (the cache's conv state keeps K inputs, this one the K-1 read)."""
    from transformers.cache_utils import DynamicCache

    config, module, p, shape = mixer
    x = hidden(4, 40)
    cache = DynamicCache(config=config)
    ref = [torch_mixer(module, x[:, :34], cache=cache)]
    out, state = net(p, x[:, :34], shape)
    outs = [out]
    for t in range(34, 40):
        ref.append(torch_mixer(module, x[:, t : t + 1], cache=cache))
        out, state = net(p, x[:, t : t + 1], shape, state=state)
        outs.append(out)
    check(np.concatenate(outs, axis=1), np.concatenate(ref, axis=1), "prefill 34, then 6 steps, outputs", MIXER_TOL)
    check(
        state.conv, cache.get_conv_state(0, state_idx=0)[..., 1:], "after decoding, the conv state", 2e-6
    )  # an ulp of the projections
    check(state.recurrent, cache.get_recurrent_state(0, state_idx=0), "after decoding, the recurrent state", STATE_TOL)
    whole, whole_state = net(p, x, shape)
    check(np.concatenate(outs, axis=1), whole, "prefill and steps vs the whole sequence", MIXER_TOL)
    zeros = LinearState.zeros(B, shape)
    from_zeros, _ = net(p, x, shape, state=zeros)
    check(from_zeros, whole, "from LinearState.zeros vs no state", 0.0)


def no_gate(x, gate, weight, eps):
    x32 = x.astype(jnp.float32)
    return weight * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps))


@pytest.mark.parametrize(
    "mistake, replacement",
    [
        ("l2_normalize", lambda x, eps=1e-6: x),
        ("causal_conv", lambda x, w, state=None, ends=None: (jax.nn.silu(x), causal_conv(x, w, state)[1])),
        ("gated_rms_norm", no_gate),
    ],
    ids=["no l2 norm", "no conv", "no gate"],
)
def test_mixer_is_sensitive(mixer, monkeypatch, mistake, replacement):
    """Each feature matters far beyond the tolerance, so the parity above is testing it."""
    _, module, p, shape = mixer
    x = hidden(2, 64)
    ref = torch_mixer(module, x)
    monkeypatch.setattr(la, mistake, replacement)
    wrong, _ = gated_delta_net(p, x, shape)  # not jitted: traced with the replacement
    d = diff(wrong, ref)
    print(f"\n[linear attention] sensitivity, {mistake} replaced: max |diff| = {d:.3e}")
    assert d > 100 * MIXER_TOL


def test_vmap_equals_each_alone(mixer):
    _, _, p, shape = mixer
    xs = np.stack([hidden(s, 70, 1) for s in (5, 6, 7)])  # [3, 1, 70, D]
    batched, states = jax.jit(jax.vmap(lambda x: gated_delta_net(p, x, shape, chunk=32)))(xs)
    for i, x in enumerate(xs):
        alone, state = net(p, x, shape, chunk=32)
        # batched products may sum in another order: float32 rounding, amplified by the gated norm
        check(batched[i], alone, f"vmap member {i}", MIXER_TOL)
        check(states.recurrent[i], state.recurrent, f"vmap member {i}, state", STATE_TOL)


def test_gradients_are_finite_and_match_finite_differences(mixer):
    """Reverse and forward mode through the chunked rule (a padded last chunk) and the scan: the
    gradient of a weighted sum of the output equals torch's autograd through transformers' mixer
    (x, A_log, dt_bias), and a central difference in float32 along x and in one head's A_log and
    dt_bias. The mixer is strongly curved (its norms divide by small vectors), so the step along
    x is 3e-4, along a parameter 1e-2 (there the outputs' rounding dominates a smaller step); the
    outputs are summed in float64. Measured: within 2.5e-4 relative of the differences, and
    2.8e-5 (gradients of scale ~30) of torch's."""
    _, module, p, shape = mixer
    x = jnp.asarray(hidden(8, 40, 1))
    weights = np.random.default_rng(9).standard_normal((1, 40, 64)).astype(np.float32)
    direction = jnp.asarray(np.random.default_rng(10).standard_normal(x.shape).astype(np.float32))

    def loss(x, p):
        return jnp.sum(gated_delta_net(p, x, shape, chunk=16)[0] * weights)

    gx, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, p)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves((gx, gp)))
    tx = torch.tensor(np.asarray(x), requires_grad=True)
    module.zero_grad()
    (module(tx) * torch.from_numpy(weights)).sum().backward()
    scale = float(np.abs(tx.grad.numpy()).max())
    check(gx, tx.grad, "d/dx against torch's autograd", 1e-5 * scale)
    check(gp["linear_A_log"], module.A_log.grad, "d/dA_log against torch's autograd", 1e-5 * scale)
    check(gp["linear_dt_bias"], module.dt_bias.grad, "d/ddt_bias against torch's autograd", 1e-5 * scale)
    _, forward = jax.jvp(lambda x: loss(x, p), (x,), (direction,))
    along = lambda e: (x + e * direction, p)
    checks = [
        ("x along a direction", float(jnp.sum(gx * direction)), along),
        ("forward mode, x", float(forward), along),
    ]
    for name in ("linear_A_log", "linear_dt_bias"):  # the head it moves most, above the rounding
        i = int(np.argmax(np.abs(np.asarray(gp[name]))))
        bump = lambda e, name=name, i=i: (x, {**p, name: p[name].at[i].add(e)})
        checks.append((f"{name}[{i}]", float(gp[name][i]), bump))
    outputs = jax.jit(lambda x, p: gated_delta_net(p, x, shape, chunk=16)[0])
    loss64 = lambda x, p: float(np.sum(np.asarray(outputs(x, p), np.float64) * weights))  # summed without rounding
    for what, derivative, at in checks:
        e = 3e-4 if what.startswith(("x", "forward")) else 1e-2
        numeric = (loss64(*at(e)) - loss64(*at(-e))) / (2 * e)
        rel = abs(derivative - numeric) / max(abs(numeric), 1e-3)
        print(f"\n[linear attention] d/d {what}: {derivative:.6g} vs finite difference {numeric:.6g} (rel {rel:.1e})")
        assert rel < 2e-3, f"{what}: {derivative} vs {numeric}"
