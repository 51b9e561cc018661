"""What skipping useless work saves: residual erasure and integrated gradients as implemented
(each intervention starts at its own boundary; an erasure runs only the positions from its
block's first one on; the LM head reads only answer-predicting positions) against the plain
formulation (every layer and position rerun for every intervention, the LM head on every
position), on the same prompt, same results.

    python experiments/savings.py --data ../shared/data/gsm8k_test_sample.jsonl --max-tokens 96
"""

import argparse
import os
import time
from functools import partial

import jax
import jax.numpy as jnp

from jaxdepth.analyses import erasure, integrated_gradients as ig
from jaxdepth.analyses.ig.checks import ig_baseline
from jaxdepth.analyses.ig.engine import Execution
from jaxdepth.analyses.ig.rules import FixedRule, quadrature
from jaxdepth.core.batch import PromptArrays, make_batch
from jaxdepth.core.compilation import jit
from jaxdepth.core import sites
from jaxdepth.lab.sources import load
from jaxdepth.core.loops import LayerRun, run_layers
from jaxdepth.core.model import embed, forward, residual_stream, unembed
from jaxdepth.lab.prompts import encode, load_prompts
from jaxdepth.analyses.stats import masked_max, norm
from jaxdepth.core.sweep import sweep

HERE = os.path.dirname(os.path.abspath(__file__))


@partial(jit, static_argnames=("config", "chunk_size"))
def plain_erasure(params, tokens, valid, answer_mask, baseline, config, chunk_size):
    """Every (boundary, position) erasure through the whole model, outputs at every position."""
    L, T = config.num_layers, tokens.shape[1]
    h0 = embed(params, tokens, config)
    clean = jax.nn.softmax(forward(params, tokens, config, valid=valid), -1)
    b, t = jnp.meshgrid(jnp.arange(L + 1), jnp.arange(T), indexing="ij")

    def member(m):
        boundary, position = m
        iv = sites.replace("resid_pre", boundary, jnp.arange(T) == position, baseline[boundary])
        h, _ = run_layers(params, h0, config, valid=valid, interventions=iv)
        probs = jax.nn.softmax(unembed(params, h, config), -1)
        reach = jnp.where(boundary == L, jnp.arange(T) == position, jnp.arange(T) >= position)
        return masked_max(norm(probs - clean), answer_mask & reach[None])[0]

    return sweep(member, (b.reshape(-1), t.reshape(-1)), chunk_size).reshape(L + 1, T)


@partial(jit, static_argnames=("config", "chunk_size"))
def plain_ig(params, tokens, valid, answer_mask, alphas, config, chunk_size):
    """Every (layer, step) gradient through the whole (rematerialised) model."""
    L, T = config.num_layers, tokens.shape[1]
    h0 = embed(params, tokens, config)
    target = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], 1)
    x = residual_stream(params, tokens, config, valid=valid)[1:]
    b = jnp.broadcast_to(jax.vmap(lambda xl: ig_baseline(xl, valid, "channel_mean"))(x), x.shape)[:, 0]
    x = x[:, 0]

    def objective(z, layer):
        h, _ = run_layers(
            params,
            h0,
            config,
            valid=valid,
            interventions=sites.replace("resid_pre", layer + 1, jnp.ones(T), z),
            run=LayerRun(remat=True),
        )
        p = jax.nn.softmax(unembed(params, h, config), -1)
        return jnp.sum(jnp.where(answer_mask, jnp.take_along_axis(p, target[..., None], -1)[..., 0], 0.0))

    def member(m):
        layer, alpha = m
        g = jax.grad(objective)((b[layer] + alpha * (x[layer] - b[layer]))[None], layer)[0]
        return jnp.sum((x[layer] - b[layer]) * g, -1) / alphas.shape[0]

    layers = jnp.repeat(jnp.arange(L), alphas.shape[0])
    return sweep(member, (layers, jnp.tile(alphas, L)), chunk_size).reshape(L, -1, T).sum(1)


def timed(fn):
    jax.block_until_ready(fn())  # compile
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", default=os.path.join(HERE, "..", "..", "shared", "data", "gsm8k_test_sample.jsonl"))
    parser.add_argument("--max-tokens", type=int, default=96, help="truncate the prompt (keeps the run short)")
    parser.add_argument("--ig-steps", type=int, default=8)
    parser.add_argument("--chunk", type=int, default=16)
    args = parser.parse_args()

    model = load(args.model)
    p, c = model.params, model.config
    full = encode(model.tokenizer, load_prompts("gsm8k", args.data, limit=1))
    n = min(args.max_tokens, int(full.lengths[0]))
    # Truncated before its answer, the prompt's last 8 tokens stand in for the answer.
    batch = make_batch([full.tokens[0, :n].tolist()], [min(int(full.answer_start[0]), n - 8)])
    one = batch.single(0)
    tokens, valid = jnp.asarray(one.tokens), jnp.asarray(one.valid)
    answer_mask = jnp.asarray(one.answer_prediction_mask())
    positions, real = one.answer_positions(0)
    prompt = PromptArrays(tokens, valid, jnp.asarray(positions), jnp.asarray(real))
    baseline = jnp.asarray(erasure.mean_residuals(p, batch, c))
    print(
        f"{args.model}, one prompt of {n} tokens ({int(real.sum())} answer predictions), "
        f"L={c.num_layers}, chunk {args.chunk}"
    )

    plain, t_plain = timed(lambda: plain_erasure(p, tokens, valid, answer_mask, baseline, c, args.chunk))
    print(f"erasure, plain: {t_plain:7.1f} s")
    for blocks in (1, erasure.default_blocks(tokens.shape[1])):
        ours, t_ours = timed(
            lambda: erasure.erasure_of_prompt(
                p, prompt, baseline, c, erasure.Erasure(blocks=blocks), execution=Execution(chunk_size=args.chunk)
            )
        )
        what = "start at the boundary" if blocks == 1 else f"+ causal prefix reuse ({blocks} position pieces)"
        print(
            f"erasure, {what}: {t_ours:7.1f} s, saving x{t_plain / t_ours:.2f}; "
            f"max |difference| {float(jnp.abs(ours - plain).max()):.2e}"
        )

    alphas, _ = quadrature("left", args.ig_steps)
    ours, t_ours = timed(
        lambda: ig.ig_of_prompt(
            p, prompt, c, rule=FixedRule(steps=args.ig_steps), execution=Execution(chunk_size=args.chunk)
        )
    )
    a_ours = ours.per_position[:, 0]
    a_plain, t_plain = timed(
        lambda: plain_ig(p, tokens, valid, answer_mask, jnp.asarray(alphas, jnp.float32), c, args.chunk)
    )
    print(
        f"IG ({args.ig_steps} steps): plain {t_plain:7.1f} s, jaxdepth {t_ours:7.1f} s, saving "
        f"x{t_plain / t_ours:.2f}; max |difference| {float(jnp.abs(a_ours - a_plain * valid[0]).max()):.2e}"
    )


if __name__ == "__main__":
    main()
