"""How a mixture of experts uses its experts over depth (`jaxdepth.analyses.expert_depth`):
each routing statistic against a hand computation from a tap of the layers, the vmapped drop
sweep against each drop run one at a time, the routing travel against the skipped runs by hand
(exact zeros where causality puts them, and for a skip that skips nothing), a dense model
refused, and the analysis run through the suite with its figure written."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from conftest import tiny_moe_config
from jaxdepth.analyses import expert_depth as X
from jaxdepth.analyses.layer_skip import SkipMasks, member_masks, sample_split_positions
from jaxdepth.analyses.suite import RunInputs
from jaxdepth.core.batch import PromptArrays, make_batch
from jaxdepth.core.execution import Execution
from jaxdepth.core.experts import drop_experts
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import embed, random_params, unembed
from jaxdepth.core.sites import skip
from jaxdepth.core.sweep import member_bytes

pytestmark = pytest.mark.usefixtures("highest_precision")

CONFIG = tiny_moe_config()
PARAMS = random_params(CONFIG, 0, scale=0.3)
L, E, K = CONFIG.num_layers, CONFIG.num_experts, CONFIG.experts_per_token
LENGTHS = (20, 17)  # one length bucket (24): every prompt shares each compiled sweep
BATCH = make_batch([np.random.default_rng(1).integers(0, 97, n).tolist() for n in LENGTHS])
# 4 drops vmapped at once: the 6 experts run as 2 chunks of 3, the chunking exercised
CHUNK = 4
# The vmapped sweep runs each layer from its clean input inside a `lax.map` and vmaps the drops,
# where the run by hand is one full forward per drop: XLA's batched products and the loop from
# layer l sum the same float32 numbers in another order, which moves O(1) relative changes and
# probabilities by about 1e-6; a wrong expert or layer dropped moves them by 1e-2 and more.
ROUNDING = 1e-5


@pytest.fixture(scope="module")
def result():
    # set up before the tests' own precision fixture: the same precision, so that the tests'
    # calls of the same sweeps reuse these compiled programs
    with jax.default_matmul_precision("highest"):
        return X.expert_depth(PARAMS, BATCH, CONFIG, execution=Execution(chunk_size=CHUNK))


def _tap(record, _):
    return dict(
        delta=record.delta,
        probs=record.router_probs,
        weights=record.expert_weights,
        choice=record.expert_choice,
        outputs=record.expert_out,
    )


@jax.jit
def _run(tokens, interventions=None):
    """One full forward of one unpadded prompt under `interventions`: the output probabilities
    `[1, T, V]` and every layer's record."""
    final, records = run_layers(PARAMS, embed(PARAMS, tokens, CONFIG), CONFIG, interventions=interventions, tap=_tap)
    return jax.nn.softmax(unembed(PARAMS, final, CONFIG), axis=-1), records


@partial(jax.jit, static_argnames="config")
def _records(tokens, config):
    return run_layers(PARAMS, embed(PARAMS, tokens, config), config, tap=_tap)[1]


def _prompt(i: int) -> np.ndarray:
    return BATCH.tokens[i : i + 1, : LENGTHS[i]]


def _sets(choice) -> np.ndarray:
    """`[..., E]` bool: each token's chosen experts as a set."""
    return np.any(np.asarray(choice)[..., None] == np.arange(E), axis=-2)


def test_effective_experts_is_e_uniform_and_k_for_the_same_k():
    np.testing.assert_allclose(X.effective_experts(np.full(E, 1 / E)), E)
    np.testing.assert_allclose(X.effective_experts([0.5, 0.5, 0, 0, 0, 0]), 2)
    np.testing.assert_allclose(X.effective_experts([[1, 0, 0], [0.5, 0.25, 0.25]]), [1, 1 / 0.375])


@pytest.mark.parametrize("normalized", [False, True])
def test_the_routing_statistics_equal_a_hand_computation(normalized):
    """Entropy in bits, the load shares and the best expert's share of the update, from the
    router's scores, the weights and the experts' outputs a tap reads, each prompt alone."""
    config = dataclasses.replace(CONFIG, normalize_expert_weights=normalized)
    got = X.expert_depth(PARAMS, BATCH, config, X.ExpertSweeps(drop=False, skip=False))
    entropy, top, counts = np.zeros((2, L)), np.zeros((2, L)), np.zeros((2, L, E))
    for i, n in enumerate(LENGTHS):
        tokens = jnp.asarray(_prompt(i))
        records = _records(tokens, config)
        probs, weights, choice, outputs = (
            np.asarray(records[k], np.float64)[:, 0] for k in ("probs", "weights", "choice", "outputs")
        )
        choice = choice.astype(int)
        logs = np.log2(np.where(probs > 0, probs, 1.0))
        entropy[i] = (-(probs * logs).sum(-1)).mean(-1)
        w = np.take_along_axis(weights, choice, -1)  # [L, T, k], best first
        parts = np.linalg.norm(outputs * w[..., None], axis=-1)
        top[i] = (parts[..., 0] / parts.sum(-1)).mean(-1)
        for layer in range(L):
            counts[i, layer] = np.bincount(choice[layer].ravel(), minlength=E)
    np.testing.assert_allclose(got.entropy_per_prompt, entropy, rtol=1e-5)
    np.testing.assert_allclose(got.top_share_per_prompt, top, rtol=1e-5)
    np.testing.assert_array_equal(got.expert_counts, counts)
    n = np.asarray(LENGTHS, float)
    np.testing.assert_allclose(got.entropy, (entropy * n[:, None]).sum(0) / n.sum(), rtol=1e-5)
    np.testing.assert_allclose(got.entropy_ratio, got.entropy / math.log2(E))
    shares = counts.sum(0) / (K * n.sum())
    np.testing.assert_allclose(got.shares, shares)
    np.testing.assert_allclose(got.effective_experts, 1 / (shares**2).sum(-1))
    np.testing.assert_allclose(got.largest_share, shares.max(-1))
    np.testing.assert_allclose(got.top_share, (top * n[:, None]).sum(0) / n.sum(), rtol=1e-5)
    assert np.all((K <= got.effective_experts) & (got.effective_experts <= E))
    assert np.all((1 / K <= got.top_share) & (got.top_share <= 1)) and np.all(got.entropy_ratio < 1)
    assert got.drop_later is None and got.routing_travel is None  # no sweep asked for


def test_the_vmapped_drop_sweep_equals_each_drop_run_one_at_a_time(result):
    """Every (layer, expert) of each prompt, dropped at every position in a full forward of the
    prompt alone (no padding): the largest relative change of each layer's contribution and the
    largest shift of the output probabilities over its tokens."""
    for i in range(2):
        clean_probs, clean = _run(jnp.asarray(_prompt(i)))
        clean_delta = np.asarray(clean["delta"])[:, 0]
        for layer in range(L):
            for e in range(E):
                probs, records = _run(jnp.asarray(_prompt(i)), drop_experts(layer, np.eye(E)[e]))
                delta = np.asarray(records["delta"])[:, 0]
                change = np.linalg.norm(clean_delta - delta, axis=-1) / np.maximum(
                    np.linalg.norm(clean_delta, axis=-1), 1e-6
                )
                later = change.max(-1)  # [L]
                assert np.all(later[:layer] < 1e-6)  # the layers before it: unchanged
                later[:layer] = 0.0
                output = np.linalg.norm(np.asarray(probs - clean_probs)[0], axis=-1).max()
                np.testing.assert_allclose(result.drop_later_per_prompt[i, layer, e], later, rtol=1e-5, atol=ROUNDING)
                np.testing.assert_allclose(result.drop_output_per_prompt[i, layer, e], output, rtol=1e-5, atol=ROUNDING)
    later = result.drop_later_per_prompt
    assert all(np.all(later[:, layer, :, :layer] == 0.0) for layer in range(L))  # j < l: exact zeros
    assert later.max() > 0.01 and result.drop_output.max() > 0.01
    np.testing.assert_array_equal(result.drop_later, later.max(0))
    after = result.drop_after()
    for layer in range(L - 1):
        np.testing.assert_array_equal(after[layer], later.max(0)[layer, :, layer + 1 :].max(-1))
    assert np.all(np.isnan(after[L - 1]))  # the last layer has no later one


def _changed_by_hand(i: int, keep: np.ndarray, measure: np.ndarray) -> np.ndarray:
    """`[L, L]`: per skipped layer s, the measured tokens of prompt i whose chosen experts at
    each layer differ from the clean run's, skipping where `keep` is 1."""
    clean = _sets(_run(jnp.asarray(_prompt(i)))[1]["choice"])[:, 0]  # [L, T, E]
    counts = np.zeros((L, L), int)
    for s in range(L):
        sets = _sets(_run(jnp.asarray(_prompt(i)), skip("delta", s, keep))[1]["choice"])[:, 0]
        counts[s] = (np.any(sets != clean, axis=-1) & measure).sum(-1)
    return counts


def test_the_routing_travel_equals_the_skipped_runs_by_hand(result):
    """The current mode: each layer skipped at every position but 0, every token measured."""
    changed, measured = np.zeros((L, L)), 0
    for i, n in enumerate(LENGTHS):
        (keep,), (measure,) = member_masks(n, n, [], "current")
        changed += _changed_by_hand(i, keep.astype(np.float32), measure)
        measured += measure.sum()
    np.testing.assert_array_equal(result.routing_travel, changed / measured)
    assert np.all(result.routing_changed[:, np.arange(L)[:, None] >= np.arange(L)[None, :]] == 0)  # l <= s
    assert result.routing_travel.max() > 0
    np.testing.assert_array_equal(result.routing_measured, LENGTHS)


def test_a_skip_of_no_position_changes_no_routing():
    """Exactly 0 everywhere, not float noise: the runs choose the clean run's experts."""
    one = BATCH.single(0)
    T = one.tokens.shape[1]
    prompt = PromptArrays(*jax.device_put((one.tokens, one.valid)))
    (_, measure), layers = member_masks(LENGTHS[0], T, [], "current"), np.arange(L, dtype=np.int32)
    nothing = SkipMasks(np.zeros((1, T), np.float32), np.stack(measure))
    changed, seen = X.routing_changes(PARAMS, prompt, layers, nothing, CONFIG, chunk_size=1)
    assert np.all(np.asarray(changed) == 0) and int(seen[0]) == LENGTHS[0]


def test_the_future_mode_counts_its_split_members_alone():
    """Skipped before each split position, measured from it on; the members that pad a prompt's
    splits to the others' count measure nothing."""
    got = X.expert_depth(
        PARAMS,
        BATCH,
        CONFIG,
        X.ExpertSweeps(drop=False, mode="future", seed=5),
        execution=Execution(chunk_size=CHUNK),
    )
    splits = sample_split_positions(LENGTHS, seed=5, per_prompt=4)
    changed, measured = np.zeros((L, L)), 0
    for i, n in enumerate(LENGTHS):
        for t in splits[i]:
            (keep,), (measure,) = member_masks(n, n, [t], "future")
            changed += _changed_by_hand(i, keep.astype(np.float32), measure)
            measured += measure.sum()
    assert [list(row[row >= 0]) for row in got.split_positions] == splits and measured > 0
    np.testing.assert_array_equal(got.routing_travel, changed / measured)
    assert np.all(got.routing_changed[:, np.arange(L)[:, None] >= np.arange(L)[None, :]] == 0)
    with pytest.raises(ValueError, match="too short for a split position"):
        X.expert_depth(PARAMS, make_batch([[1] * 9]), CONFIG, X.ExpertSweeps(drop=False, mode="future"))


def test_a_dense_model_is_refused_by_name():
    dense = tiny_config()
    params = random_params(dense, 0, scale=0.3)
    with pytest.raises(ValueError, match=r"reads a mixture of experts, and this 'llama' model has a dense MLP"):
        X.expert_depth(params, BATCH, dense)
    model = SimpleNamespace(params=params, config=dense, source="tiny-llama")
    inputs = RunInputs(model=model, batch=BATCH, settings=X.ANALYSIS.settings(), progress=False)
    with pytest.raises(ValueError, match=r"--analyses experts\) of tiny-llama reads a mixture of experts"):
        X.ANALYSIS.run(inputs)
    with pytest.raises(TypeError, match=r"execution=jaxdepth.Execution\(chunk_size=2\)"):
        X.expert_depth(PARAMS, BATCH, CONFIG, chunk_size=2)
    with pytest.raises(TypeError, match=r"sweeps=ExpertSweeps\(mode='future'\)"):
        X.expert_depth(PARAMS, BATCH, CONFIG, mode="future")


def test_the_analysis_runs_through_the_suite_and_writes_its_figure(result, tmp_path):
    from jaxdepth.lab.registry import ANALYSES, default_analyses
    from jaxdepth.lab.results import load_result

    assert ANALYSES["experts"] is X.ANALYSIS and "experts" not in default_analyses()
    # a budget of 4 drops: the chunk of the fixture's run, so its compiled programs serve here
    settings = X.ANALYSIS.settings(memory_budget=CHUNK * member_bytes(CONFIG, BATCH.tokens.shape[1]))
    model = SimpleNamespace(params=PARAMS, config=CONFIG)
    suite = X.ANALYSIS.run(RunInputs(model=model, batch=BATCH, settings=settings, progress=False))
    assert isinstance(suite, X.ExpertDepthResult) and suite.settings["sweeps"] == ["drop", "skip"]
    for name in ("entropy_per_prompt", "expert_counts", "drop_later_per_prompt", "routing_changed"):
        np.testing.assert_array_equal(getattr(suite, name), getattr(result, name))
    again = load_result(suite.save(str(tmp_path / "experts.npz")))
    assert isinstance(again, X.ExpertDepthResult) and again.split_positions is None
    np.testing.assert_array_equal(again.drop_output, suite.drop_output)
    np.testing.assert_array_equal(again.routing_travel, suite.routing_travel)

    (figure,) = X.ANALYSIS.figures(again, None, 1).values()
    assert len(figure.axes) == 5  # the four panels and the heat map's colour bar
    assert figure.axes[3].get_title() == "dropping one expert: later layers"
    figure.savefig(tmp_path / "experts.png")
    assert (tmp_path / "experts.png").stat().st_size > 10_000
    routing = X.expert_depth_figure(again, heat="routing")
    assert routing.axes[3].get_title() == "a skipped layer: later routing"
    lines = X.ANALYSIS.summary(again)
    assert lines[0].startswith("router entropy") and "dropping one expert" in lines[3] and len(lines) == 5
    assert set(X.ANALYSIS.depth(again).curves) == {"router_entropy", "effective_experts", "top_expert_share"}

    parsed = {f.name: f for f in dataclasses.fields(X.ExpertSettings)}
    from jaxdepth.analyses.suite import parse_option

    assert parse_option(parsed["experts_sweeps"], "none") == () and X.ExpertSettings(experts_sweeps=()).sweeps() == (
        X.ExpertSweeps(drop=False, skip=False)
    )
    with pytest.raises(ValueError, match="--experts-sweeps takes drop, skip or none"):
        X.ExpertSettings(experts_sweeps=("erase",))
    with pytest.raises(ValueError, match="--experts-skip-mode must be one of future, current"):
        X.ExpertSettings(experts_skip_mode="past")
    assert X.ANALYSIS.identity(X.ExpertSettings(seed=4)) == X.ANALYSIS.identity(X.ExpertSettings(seed=5))
    assert X.ANALYSIS.identity(X.ExpertSettings(seed=4, experts_skip_mode="future"))["seed"] == 4


def _assert_drops_are_forwards_by_hand(result, params, config, layers) -> None:
    """Each expert of each of `layers` dropped in a full forward of prompt 0 alone: the largest
    shift of its output probabilities is the one `result` recorded."""
    tokens = jnp.asarray(_prompt(0))

    @jax.jit
    def probabilities(interventions=None):
        final, _ = run_layers(params, embed(params, tokens, config), config, interventions=interventions)
        return jax.nn.softmax(unembed(params, final, config), axis=-1)

    clean, E = probabilities(), config.num_experts
    for layer in layers:
        for e in range(E):
            shift = np.linalg.norm(np.asarray(probabilities(drop_experts(layer, np.eye(E)[e])) - clean)[0], axis=-1)
            np.testing.assert_allclose(
                result.drop_output_per_prompt[0, layer, e], shift.max(), rtol=1e-5, atol=ROUNDING
            )


def test_a_dense_layer_among_sparse_ones_is_nan_and_its_skip_reroutes_the_next():
    """Layers sparse, dense, sparse: the dense layer has no router (NaN in every measure, its
    drops not run); the sparse layers' drops equal forwards by hand; skipping the dense layer
    changes the routing of the sparse layer after it."""
    config = tiny_moe_config(dense_layers=(1,), dense_size=24)
    params = random_params(config, 0, scale=0.3)
    with jax.default_matmul_precision("highest"):
        result = X.expert_depth(params, BATCH, config, X.ExpertSweeps(prompts=1), execution=Execution(chunk_size=CHUNK))
    for per_layer in (result.entropy, result.top_share, result.effective_experts, result.largest_share):
        assert np.isnan(per_layer[1]) and np.all(np.isfinite(per_layer[[0, 2]]))
    assert np.all(np.isnan(result.drop_output[1])) and np.all(np.isnan(result.drop_later[1]))
    assert np.all(np.isnan(result.routing_travel[:, 1])) and result.routing_travel[1, 2] > 0
    assert np.all(result.expert_counts[:, 1] == 0)
    _assert_drops_are_forwards_by_hand(result, params, config, layers=(0, 2))
    assert all(line and "nan" not in line for line in X._summary(result))


def test_gemma4s_experts_beside_its_mlp_drop_as_forwards_by_hand():
    """Gemma 4's mixture (`gemma4_moe`: the experts beside the layer's MLP, each part its own
    norms, a layer scalar): every layer is sparse, each drop equals a forward by hand, and
    dropping an expert moves the output even though the MLP beside it runs on."""
    from conftest import tiny_hf_config
    from jaxdepth.core.config import ModelConfig

    config = ModelConfig.from_hf(tiny_hf_config("gemma4_moe")[0].to_dict())
    assert config.expert_norms and config.layer_scalar and not config.dense_layers
    params = random_params(config, 0, scale=0.3)
    with jax.default_matmul_precision("highest"):
        result = X.expert_depth(params, BATCH, config, X.ExpertSweeps(prompts=1), execution=Execution(chunk_size=CHUNK))
    _assert_drops_are_forwards_by_hand(result, params, config, layers=range(config.num_layers))
    assert result.drop_output.min() > 1e-4 and np.all(np.isfinite(result.entropy))
