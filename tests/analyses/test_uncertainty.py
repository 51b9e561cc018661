"""The bootstrap over prompts on synthetic per-prompt curves whose answer is known: degenerate
cases, a case whose bootstrap distribution is binomial, seeding, no-crossing resamples; and the
table built from saved results with and without per-prompt curves."""

import csv
import io
import math

import numpy as np
import pytest

from jaxdepth.lab import table
from jaxdepth.analyses import uncertainty as u
from jaxdepth.analyses.contributions import STATISTICS, ContributionResult
from jaxdepth.analyses.effective_depth import depth_score, overlap_effective_depth
from jaxdepth.analyses.layer_skip import LayerSkipResult
from jaxdepth.analyses.logit_lens import LogitLensResult


def lens_result(kl_per_prompt, overlap_per_prompt, counts=None, weighting="prompt"):
    """A LogitLensResult aggregated from per-prompt curves exactly as `logit_lens` does."""
    kl, overlap = np.asarray(kl_per_prompt, np.float64), np.asarray(overlap_per_prompt, np.float64)
    counts = np.full(len(kl), 10) if counts is None else np.asarray(counts)
    return LogitLensResult(
        kl=u.aggregate(kl, counts, weighting),
        overlap=u.aggregate(overlap, counts, weighting),
        settings={"weighting": weighting},
        kl_per_prompt=kl,
        overlap_per_prompt=overlap,
        tokens_per_prompt=counts,
    )


def contribution_result(cos_per_prompt, counts):
    """A ContributionResult whose three cosine curves all equal `cos_per_prompt` per prompt."""
    cos = np.asarray(cos_per_prompt, np.float64)
    counts = np.asarray(counts)
    per_prompt = {name: (cos if name.startswith("cos") else np.ones_like(cos)) for name in STATISTICS}
    return ContributionResult(
        **{n: u.aggregate(c, counts, "token") for n, c in per_prompt.items()},
        num_tokens=int(counts.sum()),
        settings={},
        **{f"{n}_per_prompt": c for n, c in per_prompt.items()},
        tokens_per_prompt=counts,
    )


KL_DECAY = np.array([4.0, 3.0, 1.0, 0.5, 0.2, 0.1])  # first below 0.5 * 4 = 2 at l = 2
OVERLAP_RISE = np.array([0.0, 0.1, 0.2, 0.5, 0.8, 1.0])  # first above 0.3 at l = 3


# ----------------------------------------------------------------------------- degenerate cases


def test_identical_prompts_give_a_degenerate_interval():
    N = 7
    r = lens_result(np.tile(KL_DECAY, (N, 1)), np.tile(OVERLAP_RISE, (N, 1)), counts=np.arange(1, N + 1))
    depths = u.effective_depth_intervals(r)
    for method, layer in (("kl", 2), ("overlap", 3)):
        d = depths[method]
        assert d.point.layer == d.low == d.high == layer and d.shares == {layer: 1.0}
        assert d.ratio_low == d.ratio_high == d.point.ratio == (layer + 1) / 6
        assert d.resamples == 1000 and d.num_prompts == N and d.level == 0.95
    bands = u.curve_bands(r)
    np.testing.assert_allclose(bands["kl"].low, KL_DECAY, rtol=1e-12)
    np.testing.assert_allclose(bands["kl"].high, KL_DECAY, rtol=1e-12)
    assert all(p.layer == 2 for p in u.per_prompt_depths(r)["kl"])


def test_one_prompt_gives_every_resample_equal():
    r = lens_result(KL_DECAY[None], OVERLAP_RISE[None], counts=[13], weighting="token")
    indices = u.resample_indices(1, resamples=50)
    assert indices.shape == (50, 1) and np.all(indices == 0)
    curves = u.resampled_curves(r.overlap_per_prompt, r.tokens_per_prompt, "token", indices)
    assert np.all(curves == curves[0])
    np.testing.assert_allclose(curves[0], OVERLAP_RISE, rtol=1e-12)
    d = u.effective_depth_intervals(r, resamples=50)["overlap"]
    assert d.shares == {3: 1.0} and d.low == d.high == 3 and d.resamples == 50


# ----------------------------------------------------------------------------- a known distribution


def _two_kinds(N, n1, late):
    """Overlap curves of N prompts: n1 of kind 1 (0.8 from layer 1 on), the rest of kind 0 (0 up
    to `late`, then 0.8). The prompt-weighted mean exceeds 0.3 at layer 1 exactly when at least
    4 of 10 drawn prompts are kind 1 (0.8 X / 10 > 0.3 <=> X >= 4; no tie: 0.8 * 3 / 10 = 0.24),
    else first at `late` (None when `late` is the last layer, which no rule reads)."""
    L = 6
    kind1 = np.where(np.arange(L) >= 1, 0.8, 0.0)
    kind0 = np.where(np.arange(L) >= late, 0.8, 0.0)
    overlap = np.stack([kind1] * n1 + [kind0] * (N - n1))
    return lens_result(np.tile(KL_DECAY, (N, 1)), overlap)


def _binomial_at_least(k, n, p):
    return sum(math.comb(n, x) * p**x * (1 - p) ** (n - x) for x in range(k, n + 1))


def test_share_of_a_depth_is_the_binomial_probability():
    """Drawing 10 prompts with replacement from 3 of kind 1 and 7 of kind 0, the number X of
    kind 1 is Bin(10, 0.3), so ED = 1 with probability P(X >= 4) = 0.3504 and ED = 4 otherwise.
    Bound: 4 standard errors of a share over 1000 resamples, sqrt(P (1 - P) / 1000) = 0.0151."""
    r = _two_kinds(10, 3, late=4)
    d = u.effective_depth_intervals(r, resamples=1000)["overlap"]
    expected = _binomial_at_least(4, 10, 0.3)
    assert expected == pytest.approx(0.3504, abs=1e-4)
    assert set(d.shares) == {1, 4} and sum(d.shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert abs(d.share(1) - expected) < 4 * math.sqrt(expected * (1 - expected) / 1000)
    # the full data has X = 3 (mean 0.24 at layer 1): its depth is 4, the interval spans both
    assert d.point.layer == 4 and (d.low, d.high) == (1, 4)
    # each prompt's own depth: kind 1 at layer 1, kind 0 at layer 4
    assert [p.layer for p in u.per_prompt_depths(r)["overlap"]] == [1] * 3 + [4] * 7


def test_resamples_without_a_crossing_are_counted_under_none():
    """As above, but kind 0 crosses only at the last layer, which no rule reads: the resamples
    with X <= 3 have no depth. They are counted (share P(X <= 3)), never dropped, and the upper
    bound falls on them."""
    r = _two_kinds(10, 3, late=5)
    d = u.effective_depth_intervals(r)["overlap"]
    expected = 1 - _binomial_at_least(4, 10, 0.3)
    assert set(d.shares) == {1, None} and d.share(1) + d.share(None) == pytest.approx(1.0, abs=1e-12)
    assert abs(d.share(None) - expected) < 4 * math.sqrt(expected * (1 - expected) / 1000)
    assert not d.point.found and (d.low, d.high) == (1, None)
    assert d.ratio_low == 2 / 6 and d.ratio_high is None
    assert [p.layer for p in u.per_prompt_depths(r)["overlap"]] == [1] * 3 + [None] * 7
    # a bound lands on None only when more than 2.5% of resamples have no crossing
    rare = u.depth_interval("overlap", overlap_effective_depth(OVERLAP_RISE), [3] * 980 + [None] * 20, num_prompts=10)
    assert (rare.low, rare.high, rare.share(None)) == (3, 3, 0.02)


def test_token_weighting_counts_each_token():
    """Cosine (token-weighted): a prompt of 9 tokens whose curve crosses last at 2 -> 3, and one
    of 1 token crossing only at 0 -> 1. Any resample holding the long prompt has its mean cross
    last at 2 (at layer 2 the long prompt's -1 outweighs the short one's +1 nine to one), so the
    depth is 0 only when both draws are the short prompt: probability 1/4. Weighting by prompts
    would give depth 0 for mixed resamples too (probability 3/4)."""
    c_long = [-0.5, -0.5, -1.0, 0.5]
    c_short = [-0.5, 0.5, 1.0, 0.5]
    r = contribution_result([c_long, c_short], counts=[9, 1])
    np.testing.assert_allclose(r.mean_cosine, (9 * np.array(c_long) + np.array(c_short)) / 10, rtol=1e-12)
    d = u.effective_depth_intervals(r, resamples=1000)["cosine"]
    assert d.point.layer == 2 and set(d.shares) == {0, 2}
    assert abs(d.share(0) - 0.25) < 4 * math.sqrt(0.25 * 0.75 / 1000)
    assert [p.layer for p in u.per_prompt_depths(r)["cosine"]] == [2, 0]


# ----------------------------------------------------------------------------- seeding


def test_same_seed_same_result_different_seed_different_draws():
    r = _two_kinds(10, 3, late=4)
    a, b = u.effective_depth_intervals(r, seed=5), u.effective_depth_intervals(r, seed=5)
    assert a == b
    np.testing.assert_array_equal(u.resample_indices(10, seed=5), u.resample_indices(10, seed=5))
    assert not np.array_equal(u.resample_indices(10, seed=5), u.resample_indices(10, seed=6))
    c = u.effective_depth_intervals(r, seed=6)
    assert c["overlap"].shares != a["overlap"].shares
    # one index matrix per result: with every KL curve equal, the overlap share does not depend on
    # whether KL was resampled too, and matches a direct count over `resample_indices`
    indices = u.resample_indices(10, seed=5)
    direct = np.mean((indices < 3).sum(axis=1) >= 4)
    assert a["overlap"].share(1) == direct


def test_resampled_curves_equal_explicit_means_of_the_drawn_prompts():
    rng = np.random.default_rng(3)
    per_prompt, counts = rng.random((6, 5)), rng.integers(1, 40, 6)
    indices = u.resample_indices(6, resamples=20, seed=1)
    for weighting in ("prompt", "token"):
        got = u.resampled_curves(per_prompt, counts, weighting, indices)
        for row, curve in zip(indices, got):
            np.testing.assert_allclose(curve, u.aggregate(per_prompt[row], counts[row], weighting), rtol=1e-12)
    # the identity "resample" (each prompt once) is the aggregate itself
    identity = u.resampled_curves(per_prompt, counts, "token", np.arange(6)[None])[0]
    np.testing.assert_allclose(identity, u.aggregate(per_prompt, counts, "token"), rtol=1e-12)
    with pytest.raises(ValueError, match="weighting"):
        u.aggregate(per_prompt, counts, "tokens")


def test_bad_arguments_are_refused():
    r = lens_result(np.tile(KL_DECAY, (3, 1)), np.tile(OVERLAP_RISE, (3, 1)))
    with pytest.raises(ValueError, match="level"):
        u.effective_depth_intervals(r, level=95)
    with pytest.raises(ValueError, match="resamples"):
        u.effective_depth_intervals(r, resamples=0)
    old = LogitLensResult(kl=r.kl, overlap=r.overlap, settings={"weighting": "prompt"})
    assert not u.has_per_prompt(old) and u.has_per_prompt(r)
    with pytest.raises(ValueError, match="no per-prompt curves"):
        u.effective_depth_intervals(old)


# ----------------------------------------------------------------------------- depth score


def _skip_result(later_per_prompt):
    N, L, _ = later_per_prompt.shape
    return LayerSkipResult(
        later=later_per_prompt.max(0),
        output=np.zeros(L),
        later_per_prompt=later_per_prompt,
        output_per_prompt=np.zeros((N, L)),
        split_positions=np.zeros((N, 4)),
        settings={},
    )


def test_depth_score_interval_follows_the_max_over_drawn_prompts():
    """Prompt 0 of 10 has a large skip effect of layer 2, every prompt a small one of layer 0:
    the resampled score is the score of both effects when prompt 0 is drawn (probability
    1 - 0.9^10 = 0.6513), else 0. Bound: 4 standard errors over 1000 resamples."""
    L, N = 4, 10
    later = np.zeros((N, L, L))
    later[:, 0, 1:] = 0.1
    later[0, 2, 3] = 5.0
    s = u.depth_score_interval(_skip_result(later))
    with_big = depth_score(later.max(0))
    assert with_big > 1 and s.point == with_big and s.undefined_share == 0.0
    assert set(np.unique(s.samples)) == {0.0, with_big}
    expected = 1 - 0.9**10
    assert abs(np.mean(s.samples == with_big) - expected) < 4 * math.sqrt(expected * (1 - expected) / 1000)
    assert (s.low, s.high) == (0.0, with_big) and s.resamples == 1000


def test_depth_score_undefined_resamples_are_counted():
    """Prompts without any effect (too short to be measured): resamples of only those have an
    undefined score (probability 0.9^10 = 0.3487), counted, and the upper bound falls on them."""
    L, N = 4, 10
    later = np.zeros((N, L, L))
    later[0, 2, 3] = 5.0
    s = u.depth_score_interval(_skip_result(later))
    expected = 0.9**10
    assert abs(s.undefined_share - expected) < 4 * math.sqrt(expected * (1 - expected) / 1000)
    assert s.point == s.low == depth_score(later[0]) and s.high is None
    assert u.depth_score_interval(_skip_result(np.zeros((3, L, L)))).point is None


def test_depth_score_of_several_sublayers_is_taken_one_at_a_time():
    from jaxdepth.analyses.layer_skip import LayerSkipBySublayer

    L, N = 4, 5
    later = np.triu(np.random.default_rng(0).random((2, N, L, L)), k=1)
    both = LayerSkipBySublayer(
        sublayers=["attn", "mlp"],
        later=later.max(1),
        output=np.zeros((2, L)),
        later_per_prompt=later,
        output_per_prompt=np.zeros((2, N, L)),
        split_positions=np.zeros((N, 4)),
        settings={},
    )
    with pytest.raises(ValueError, match=r"part\(sublayer\)"):
        u.depth_score_interval(both)
    s = u.depth_score_interval(both.part("mlp"), resamples=10)
    assert s.point == depth_score(later[1].max(0)) and s.resamples == 10


# ----------------------------------------------------------------------------- the table


def _folder(tmp_path, name, *, per_prompt=True, late=4):
    folder = tmp_path / "model" / name
    lens = _two_kinds(10, 3, late=late)
    if not per_prompt:
        lens = LogitLensResult(kl=lens.kl, overlap=lens.overlap, settings=lens.settings)
    lens.save(folder / "logit_lens.npz")
    return folder


def test_table_with_intervals_and_per_prompt_depths(tmp_path):
    _folder(tmp_path, "data", late=4)
    rows = table.collect([str(tmp_path)], resamples=1000, seed=0)
    d = u.effective_depth_intervals(_two_kinds(10, 3, late=4), resamples=1000, seed=0)
    by_method = {r["method"]: r for r in rows}
    assert (by_method["overlap"]["ed"], by_method["overlap"]["ed_low"], by_method["overlap"]["ed_high"]) == (4, 1, 4)
    assert by_method["kl"]["ed_low"] == by_method["kl"]["ed_high"] == d["kl"].point.layer == 2
    md = table.to_markdown(rows)
    assert md.startswith("| model | dataset | L | cosine ED [95%] (ratio) |")
    assert "| model | data | 6 | - | 2 [2, 2] (0.50) | 4 [1, 4] (0.83) |" in md
    assert "1000 bootstrap resamples" in md
    parsed = list(csv.DictReader(io.StringIO(table.to_csv(rows))))
    assert list(parsed[0]) == ["model", "dataset", "method", "layers", "ed", "ratio", "ed_low", "ed_high"]
    assert [(p["method"], p["ed"], p["ed_low"], p["ed_high"]) for p in parsed] == [
        ("kl", "2", "2", "2"),
        ("overlap", "4", "1", "4"),
    ]

    md_path, csv_path = table.write_table(rows, str(tmp_path / "out" / "t"))
    assert (md_path, csv_path) == (str(tmp_path / "out" / "t.md"), str(tmp_path / "out" / "t.csv"))
    per_prompt = list(csv.DictReader(open(tmp_path / "out" / f"t{table.PER_PROMPT_SUFFIX}")))
    assert list(per_prompt[0]) == ["model", "dataset", "method", "prompt", "ed"]
    overlap = [(p["prompt"], p["ed"]) for p in per_prompt if p["method"] == "overlap"]
    assert overlap == [(str(i), "1" if i < 3 else "4") for i in range(10)]
    assert per_prompt == [{k: str(v) for k, v in r.items()} for r in table.per_prompt_rows([str(tmp_path)])]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["t.csv", "t.md", "t_per_prompt.csv"]


def test_table_without_bootstrap_is_unchanged(tmp_path):
    _folder(tmp_path, "data", late=5)
    _folder(tmp_path, "old", per_prompt=False)
    off = table.collect([str(tmp_path)], resamples=0)
    # the format of tables without intervals, character for character
    assert table.to_markdown(off) == (
        "| model | dataset | L | cosine ED (ratio) | KL ED (ratio) | overlap ED (ratio) |\n"
        "|---|---|---|---|---|---|\n"
        "| model | data | 6 | - | 2 (0.50) | none |\n"
        "| model | old | 6 | - | 2 (0.50) | 4 (0.83) |\n"
    )
    assert all(r["ed_low"] == r["ed_high"] == "" for r in csv.DictReader(io.StringIO(table.to_csv(off))))
    # bootstrapped: the result without per-prompt curves keeps its bare cell, the other gets intervals
    on = table.collect([str(tmp_path)])
    md = table.to_markdown(on)
    assert "| model | old | 6 | - | 2 (0.50) | 4 (0.83) |" in md
    assert "| model | data | 6 | - | 2 [2, 2] (0.50) | none [1, none] |" in md
    parsed = {(r["dataset"], r["method"]): r for r in csv.DictReader(io.StringIO(table.to_csv(on)))}
    assert (parsed["old", "overlap"]["ed_low"], parsed["data", "overlap"]["ed_low"]) == ("", "1")
    assert parsed["data", "overlap"]["ed_high"] == "none" and parsed["data", "overlap"]["ed"] == "none"
    # only results with per-prompt curves have per-prompt rows
    assert {r["dataset"] for r in table.per_prompt_rows([str(tmp_path)])} == {"data"}
    with pytest.raises(ValueError, match="resamples"):
        table.collect([str(tmp_path)], resamples=-1)
