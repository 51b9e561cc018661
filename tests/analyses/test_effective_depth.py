"""Effective-depth rules on hand-made curves, and result files round-tripping."""

import os
import subprocess
import sys

import numpy as np
import pytest

from jaxdepth.analyses import effective_depth as ed
from jaxdepth.analyses.logit_lens import LogitLensResult
from jaxdepth.lab.results import load_result


def test_cosine_takes_the_last_negative_to_nonnegative_crossing():
    c = [0.2, -0.1, 0.05, -0.3, -0.2, 0.1, 0.3, 0.4]  # crossings at 1->2 and 4->5
    d = ed.cosine_effective_depth(c)
    assert d.layer == 4 and d.ratio == pytest.approx(5 / 8)
    # the crossing must end by l = L-2 (l+1 = L-1 exists); one into the last layer still counts
    assert ed.cosine_effective_depth([0.1, 0.1, -0.1, 0.2]).layer == 2
    assert ed.cosine_effective_depth([0.0, -0.1, -0.2, -0.1]).layer is None


def test_kl_takes_the_first_layer_below_half_the_max_despite_early_dips():
    kl = [3.0, 1.4, 5.0, 4.0, 2.4, 1.0, 0.2]  # early dip at l=1 is below 0.5 * 5.0 = 2.5
    assert ed.kl_effective_depth(kl).layer == 1
    assert ed.kl_effective_depth(kl, fraction=0.25).layer == 5  # 1.4 >= 1.25
    # only the last layer qualifies: l <= L-2 excludes it, so there is no crossing
    d = ed.kl_effective_depth([4.0, 4.0, 3.0, 1.0])
    assert d.layer is None and d.ratio is None and not d.found and "no crossing" in str(d)


def test_overlap_takes_the_first_layer_above_threshold():
    ov = [0.0, 0.1, 0.3, 0.35, 0.2, 0.6]
    assert ed.overlap_effective_depth(ov).layer == 3  # strictly greater than 0.3
    assert ed.overlap_effective_depth(ov, threshold=0.05).layer == 1
    assert ed.overlap_effective_depth([0.0, 0.1, 0.2, 0.9]).layer is None


def test_bad_curves_are_refused():
    with pytest.raises(ValueError, match="NaN"):
        ed.kl_effective_depth([1.0, np.nan, 0.1])
    with pytest.raises(ValueError):
        ed.overlap_effective_depth([0.5])


def test_depth_score():
    L = 4
    D = np.zeros((L, L))
    D[0, 1:] = [1.0, 1.0, 1.0]  # e_0 = 3/3 = 1
    D[2, 3] = 2.0  # e_2 = 2/1 = 2
    assert ed.depth_score(D) == pytest.approx((0 * 1 + 2 * 2) / 3)
    D[3, :] = 0
    with pytest.raises(ValueError):
        ed.depth_score(np.zeros((3, 3)))


def test_result_round_trip(tmp_path):
    r = LogitLensResult(kl=np.arange(4.0), overlap=np.linspace(0, 1, 4), settings={"weighting": "prompt", "n": 3})
    path = r.save(tmp_path / "sub" / "lens.npz")
    back = load_result(path)
    assert isinstance(back, LogitLensResult) and back.settings == r.settings
    np.testing.assert_array_equal(back.kl, r.kl)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["lens.npz"]  # no temporary left
    with pytest.raises(TypeError):
        from jaxdepth.analyses.contributions import ContributionResult

        ContributionResult.load(path)


def test_per_prompt_curves_round_trip_and_older_files_load_without_them(tmp_path):
    import json

    from jaxdepth.analyses.contributions import STATISTICS, ContributionResult

    rng = np.random.default_rng(0)
    per_prompt = {f"{name}_per_prompt": rng.random((3, 5)) for name in STATISTICS}
    r = ContributionResult(
        **{name: rng.random(5) for name in STATISTICS},
        num_tokens=12,
        settings={"n": 3},
        **per_prompt,
        tokens_per_prompt=np.array([2, 4, 6]),
    )
    back = load_result(r.save(tmp_path / "contributions.npz"))
    for name, value in per_prompt.items():
        np.testing.assert_array_equal(getattr(back, name), value)
    np.testing.assert_array_equal(back.tokens_per_prompt, [2, 4, 6])
    np.testing.assert_allclose(
        back.mean_cosine_per_prompt, sum(per_prompt[f"cos_{n}_per_prompt"] for n in ("attn", "mlp", "layer")) / 3
    )
    # a file written before per-prompt curves existed: its JSON header and arrays lack them
    meta = {"type": "LogitLensResult", "settings": {"weighting": "prompt"}}
    with open(tmp_path / "old.npz", "wb") as f:
        np.savez(f, kl=np.arange(4.0), overlap=np.zeros(4), __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    old = load_result(str(tmp_path / "old.npz"))
    assert isinstance(old, LogitLensResult)
    assert old.kl_per_prompt is None and old.overlap_per_prompt is None and old.tokens_per_prompt is None


def test_save_removes_temporaries_of_killed_writers_only(tmp_path):
    """A writer killed mid-write leaves `.tmp-<pid>-*.npz`; the next save in that folder deletes
    it, but never the temporary of a process that is still running (it may be writing)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-{dead.pid}-abc.npz"
    live = tmp_path / f".tmp-{os.getpid()}-def.npz"
    stale.write_bytes(b"half a file")
    live.write_bytes(b"being written")
    LogitLensResult(kl=np.zeros(2), overlap=np.zeros(2), settings={}).save(tmp_path / "lens.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["lens.npz", live.name])


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path):
    from jaxdepth.core.atomic import atomic_write

    path = tmp_path / "table.md"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(str(path), "w") as f:
            f.write("half of the new")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["table.md"]
    with atomic_write(str(path), "w") as f:
        f.write("new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["table.md"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # the usual umask mode, not mkstemp's
