"""The command line end to end on a tiny random model with a real (tiny, trained) tokenizer:
files produced, figures non-empty, table values equal to the saved results, resume after a
killed run, and clear errors for bad input."""

import csv
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import save_tiny_checkpoint, shared_data_path, model_dir
from conversion.checkpoint import save_converted
from jaxdepth.analyses import effective_depth as ed
from jaxdepth.lab.cli import main
from jaxdepth.lab.prompts import DATASETS, load_prompts
from jaxdepth.lab.registry import ANALYSES as REGISTERED, default_analyses
from jaxdepth.lab.results import load_result

ANALYSES = default_analyses()  # what a run that names no analyses runs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), context=1024)


def _run_args(model, out, *extra, datasets=("default",), data=()):
    return [
        "run",
        "--model",
        model,
        "--dataset",
        *datasets,
        *(a for d in data for a in ("--data", d)),
        "--prompts",
        "2",
        "--detail-prompts",
        "1",
        "--ig-steps",
        "2",
        "--out",
        str(out),
        *extra,
    ]


@pytest.mark.slow(seconds=40)
def test_run_end_to_end(tiny, tmp_path, capsys):
    hellaswag = shared_data_path("hellaswag_val_sample.jsonl")
    # --baseline-data is a GSM8K-format file: the embedded prompts' file is one (GSM8K-style rows).
    # Not the GSM8K sample: its first 10 rows are 230 to 603 tokens with this tokenizer, and the
    # baseline's mean residual, computed again by each of the 3 analyses that use it on each
    # dataset, took half of this test; these rows are 141 to 171.
    gsm8k = DATASETS["default"].embedded
    assert (
        main(
            _run_args(
                tiny,
                tmp_path,
                "--baseline-data",
                gsm8k,
                datasets=("default", "hellaswag"),
                data=[f"hellaswag={hellaswag}"],
            )
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"erasure baseline: gsm8k[:10] from {gsm8k}" in printed
    # The IG summary of a result at 2 steps (the left rule), as the run prints it: the largest gap
    # as a share of |F(x)-F(b)|, with its layer, called a preview (the summary's wording on made-up
    # results: test_the_ig_summary_gives_the_gap_as_a_share_and_calls_a_large_one_a_preview).
    result = load_result(str(model_dir(tmp_path, tiny) / "default" / "integrated_gradients.npz"))
    share = np.abs(result.relative_gap)
    prompt, layer = np.unravel_index(np.nanargmax(share), share.shape)
    assert share[prompt, layer] > 0.05  # 2 steps are far from converged
    assert (
        f"IG (left rule, 2 steps): completeness gap up to {100 * share[prompt, layer]:.3g}% of |F(x)-F(b)| "
        f"(layer {layer}): a preview, not a measurement (use --ig-rule adaptive or more --ig-steps)"
    ) in printed
    for dataset in ("default", "hellaswag"):
        folder = model_dir(tmp_path, tiny) / dataset
        for name in ANALYSES:
            assert (folder / f"{name}.npz").stat().st_size > 0
        figures = sorted(p.name for p in (folder / "figures").iterdir())
        for name in (
            "contributions",
            "logit_lens",
            "layer_skip",
            "erasure_prompt0",
            "integrated_gradients_prompt0",
            "attribution_patching_prompt0",
        ):
            assert f"{name}.png" in figures and f"{name}.pdf" in figures
        assert all((folder / "figures" / f).stat().st_size > 1000 for f in figures)
        erasure = load_result(str(folder / "erasure.npz"))
        assert erasure.effects.shape[0] == 1  # --detail-prompts 1
        assert erasure.settings["identity"]["baseline_tokens_sha"] is not None
        assert erasure.settings["baseline"] == f"gsm8k[:10] from {gsm8k}"
    # the table holds exactly what the saved curves give
    with open(tmp_path / "effective_depth_table.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["dataset"], r["method"]) for r in rows} == {
        (d, m) for d in ("default", "hellaswag") for m in ("cosine", "kl", "overlap")
    }
    for r in rows:
        folder = model_dir(tmp_path, tiny) / r["dataset"]
        if r["method"] == "cosine":
            depth = ed.cosine_effective_depth(load_result(str(folder / "contributions.npz")).mean_cosine)
        else:
            lens = load_result(str(folder / "logit_lens.npz"))
            depth = ed.kl_effective_depth(lens.kl) if r["method"] == "kl" else ed.overlap_effective_depth(lens.overlap)
        assert r["ed"] == ("none" if depth.layer is None else str(depth.layer))
        assert r["layers"] == "3"
    md = (tmp_path / "effective_depth_table.md").read_text()
    assert md in printed and "| model | dataset |" in md
    # `jaxdepth table` on the same folder prints the same table
    assert main(["table", str(tmp_path), "--out", str(tmp_path / "again")]) == 0
    assert (tmp_path / "again.md").read_text() == md
    # intervals by default, bare integers with --bootstrap 0; per-prompt depths beside the table
    assert "cosine ED [95%] (ratio)" in md and "bootstrap resamples of the prompts" in md
    assert main(["table", str(tmp_path), "--bootstrap", "0", "--out", str(tmp_path / "bare")]) == 0
    bare = (tmp_path / "bare.md").read_text()
    assert "[" not in bare and "| model | dataset | L | cosine ED (ratio) |" in bare
    with open(tmp_path / "effective_depth_table_per_prompt.csv") as f:
        per_prompt = list(csv.DictReader(f))
    assert {(r["dataset"], r["method"], r["prompt"]) for r in per_prompt} == {
        (d, m, str(i)) for d in ("default", "hellaswag") for m in ("cosine", "kl", "overlap") for i in range(2)
    }


@pytest.mark.slow(seconds=60)
def test_killed_run_resumes_without_recomputing(tiny, tmp_path):
    args = [sys.executable, "-m", "jaxdepth.lab.cli", *_run_args(tiny, tmp_path, "--no-figures", datasets=["default"])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = model_dir(tmp_path, tiny) / "default" / "logit_lens.npz"
    deadline = time.time() + 300
    while not first.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first.exists(), "the run did not get as far as the logit lens"
    folder = model_dir(tmp_path, tiny) / "default"
    done = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.suffix == ".npz"}
    for name in done:
        load_result(str(folder / name))  # every file that exists is complete
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    for name, mtime in done.items():
        assert (folder / name).stat().st_mtime_ns == mtime, f"{name} was recomputed"
        assert f"{name.split('.')[0]}: reusing" in out.stdout
    assert all((folder / f"{name}.npz").exists() for name in ANALYSES)
    # a changed setting is not confused with the cached results, and leaves the others alone;
    # without a JAX compilation cache of the caller's, the programs go to $JAXDEPTH_CACHE/xla
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAXDEPTH_CACHE"] = str(tmp_path / "cache")
    again = subprocess.run(
        [*args, "--seed", "7", "--analyses", "contributions,layer_skip", "--skip-sublayers", "layer"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert "contributions: reusing" in again.stdout and "layer_skip: reusing" not in again.stdout
    assert any((tmp_path / "cache" / "xla").iterdir()), "no compiled program was kept"


def test_dataset_rows_are_formatted_exactly(shared_data):
    GSM8K, HELLASWAG = shared_data("gsm8k_test_sample.jsonl"), shared_data("hellaswag_val_sample.jsonl")
    AIME = shared_data("aime24_sample.jsonl")
    gsm = load_prompts("gsm8k", GSM8K, limit=1)[0]
    assert gsm.question == (
        "Given the following problem, reason and give a final answer to the problem.\n"
        "Problem: Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes "
        "muffins for her friends every day with four. She sells the remainder at the farmers' market daily for "
        "$2 per fresh duck egg. How much in dollars does she make every day at the farmers' market?\n"
        'Your response should end with "The final answer is [answer]" where [answer] is the response to the '
        "problem.\n\n"
    )
    assert gsm.answer == (
        "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
        "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer’s market.\n"
        "The final answer is 18"
    )
    rows = load_prompts("hellaswag", HELLASWAG)
    import json

    raw = [json.loads(line) for line in open(HELLASWAG)]
    for prompt, row in zip(rows, raw):
        sep = "" if row["ending"].startswith(",") else " "
        assert prompt.text == row["ctx"] + sep + row["ending"] and prompt.question == row["ctx"]
    from jaxdepth.lab.prompts import format_hellaswag

    assert format_hellaswag({"ctx": "He stops", "ending": ", then runs."}).text == "He stops, then runs."
    assert format_hellaswag({"ctx": "He stops", "ending": "and runs."}).text == "He stops and runs."
    aime = load_prompts("aime24", AIME)[0]
    raw = json.loads(open(AIME).readline())
    assert aime.question.endswith(
        'should end with "\\boxed{[answer]}" where [answer] is the response to the problem.\n\n\n'
    )
    assert aime.answer == raw["solution"] and raw["problem"] in aime.question


def test_bad_inputs_give_clear_errors(tiny, tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "--model",
                tiny,
                "--dataset",
                "gsm8k",
                "--data",
                str(tmp_path / "missing.jsonl"),
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q?", "answer": "no final answer here"}\n')
    assert main(["run", "--model", tiny, "--dataset", "gsm8k", "--data", str(bad), "--out", str(tmp_path)]) == 2
    assert "row 1 is malformed" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": \n')
    assert main(["run", "--model", tiny, "--dataset", "gsm8k", "--data", str(broken), "--out", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["run", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert "neither an existing folder" in capsys.readouterr().err
    assert main(["run", "--model", tiny, "--analyses", "contributions,bogus", "--out", str(tmp_path)]) == 2
    assert "unknown analyses" in capsys.readouterr().err
    assert (
        main(
            [
                "run",
                "--model",
                tiny,
                "--analyses",
                "layer_skip",
                "--skip-mode",
                "current",
                "--skip-split",
                "answer_start",
                "--out",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "--skip-split applies to --skip-mode future" in capsys.readouterr().err


def test_prompt_longer_than_the_context_is_refused(tmp_path, capsys):
    short = save_tiny_checkpoint(str(tmp_path / "short"), context=16)
    assert (
        main(
            [
                "run",
                "--model",
                short,
                "--dataset",
                "default",
                "--prompts",
                "1",
                "--analyses",
                "contributions",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    assert "exceeds the model's context of 16" in capsys.readouterr().err


def test_nan_weights_are_refused(tmp_path):
    import jaxdepth
    from conversion.checkpoint import restore_converted

    folder = save_tiny_checkpoint(str(tmp_path / "ok"), context=128)
    converted = restore_converted(folder)
    converted.params["layers"]["up"][1, 3, 5] = np.nan
    bad = save_converted(converted, str(tmp_path / "nan"))
    with pytest.raises(ValueError, match=r"\['layers'\]\['up'\] contains NaN"):
        jaxdepth.load(bad)


def test_every_skip_sublayer_subset_runs_through_the_cli(tiny, tmp_path, capsys):
    from itertools import combinations

    for k in (1, 2, 3):
        for subset in combinations(("layer", "attn", "mlp"), k):
            assert (
                main(
                    [
                        "run",
                        "--model",
                        tiny,
                        "--dataset",
                        "default",
                        "--prompts",
                        "1",
                        "--analyses",
                        "layer_skip",
                        "--skip-sublayers",
                        ",".join(subset),
                        "--no-figures",
                        "--out",
                        str(tmp_path),
                    ]
                )
                == 0
            ), subset
            printed = capsys.readouterr().out
            for sublayer in ("layer", "attn", "mlp"):
                expected = sublayer in subset
                assert (f"depth score ({sublayer} skipped)" in printed) == expected, (subset, printed)
    # --skip-mode reaches the saved result and is part of its cache identity
    assert (
        main(
            [
                "run",
                "--model",
                tiny,
                "--dataset",
                "default",
                "--prompts",
                "1",
                "--analyses",
                "layer_skip",
                "--skip-sublayers",
                "layer",
                "--skip-mode",
                "current",
                "--no-figures",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "layer_skip: reusing" not in capsys.readouterr().out
    saved = load_result(str(model_dir(tmp_path, tiny) / "default" / "layer_skip.npz"))
    assert saved.settings["mode"] == "current" and saved.settings["identity"]["skip_mode"] == "current"
    np.testing.assert_allclose(np.diagonal(saved.later[0]), 1.0, atol=1e-6)  # whole-layer skip, own change
    assert main(["run", "--model", tiny, "--skip-sublayers", "attn,heads", "--out", str(tmp_path)]) == 2
    assert "--skip-sublayers takes layer, attn, mlp" in capsys.readouterr().err


def test_erasure_baseline_defaults_to_what_can_be_read_offline(tiny, tmp_path, capsys, shared_data):
    from jaxdepth.lab.cli import BASELINE_PROMPTS, erasure_baseline_prompts

    gsm8k = shared_data("gsm8k_test_sample.jsonl")
    prompts, name = erasure_baseline_prompts(None, ["default"], {})
    assert prompts == load_prompts("default")[:BASELINE_PROMPTS] and name.startswith("default[:10] (the embedded")
    prompts, name = erasure_baseline_prompts(None, ["hellaswag", "gsm8k"], {"gsm8k": gsm8k})
    assert prompts == load_prompts("gsm8k", gsm8k, 10) and name.startswith(f"gsm8k[:10] from {gsm8k}")
    prompts, name = erasure_baseline_prompts(gsm8k, ["default"], {})
    assert prompts == load_prompts("gsm8k", gsm8k, 10) and name == f"gsm8k[:10] from {gsm8k}"
    # offline (conftest sets HF_DATASETS_OFFLINE) and nothing in GSM8K's format: each dataset's own prompts
    prompts, name = erasure_baseline_prompts(None, ["hellaswag"], {})
    assert prompts is None and name.startswith("each dataset's own")
    assert "warning: erasure baseline falls back" in capsys.readouterr().err

    # the main command's case, through the CLI: said in the output and in the saved settings
    assert (
        main(
            ["run", "--model", tiny, "--prompts", "1", "--analyses", "erasure", "--no-figures", "--out", str(tmp_path)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "erasure baseline: default[:10] (the embedded prompts, offline" in printed
    saved = load_result(str(model_dir(tmp_path, tiny) / "default" / "erasure.npz"))
    assert saved.settings["baseline"].startswith("default[:10] (the embedded prompts")


def test_tuned_lens_command_trains_resumes_and_compares(tiny, tmp_path, capsys):
    out = str(tmp_path / "lens_out")
    args = [
        "tuned-lens",
        "--model",
        tiny,
        "--dataset",
        "default",
        "--train-rows",
        "3:12",
        "--eval-rows",
        "0:3",
        "--steps",
        "6",
        "--tokens-per-step",
        "16",
        "--bootstrap",
        "50",
        "--out",
        out,
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    folder = os.path.join(model_dir(out, tiny), "default")
    for name in ("logit_lens", "tuned_lens"):
        assert os.path.exists(os.path.join(folder, f"lens_comparison_{name}.npz")), name
    for name in ("lens_comparison.md", "lens_comparison.png", "lens/lens.json"):
        assert os.path.exists(os.path.join(folder, name)), name
    # `jaxdepth run` writes its own logit_lens.npz (its prompts, its settings) in this folder
    assert not os.path.exists(os.path.join(folder, "logit_lens.npz"))
    assert "| logit lens |" in first and "| tuned lens |" in first
    logit, tuned = (load_result(os.path.join(folder, f"lens_comparison_{n}.npz")) for n in ("logit_lens", "tuned_lens"))
    assert (logit.settings["lens"], tuned.settings["lens"]) == ("logit", "tuned")
    assert not np.array_equal(logit.kl, tuned.kl)  # the trained lens reads differently
    # A rerun finds the finished training and reads the same lens again.
    assert main(args) == 0
    again = load_result(os.path.join(folder, "lens_comparison_tuned_lens.npz"))
    np.testing.assert_array_equal(again.kl, tuned.kl)
    capsys.readouterr()
    # Held-out rows that overlap the training rows are refused.
    assert main([*args[:5], "--train-rows", "0:12"] + args[7:]) == 2
    assert "overlap" in capsys.readouterr().err


def test_adaptive_integrated_gradients_through_the_cli(tiny, tmp_path, capsys):
    # a budget for the tolerance: the default, the fixed rule's --ig-steps 2, is far too small
    args = _run_args(
        tiny,
        tmp_path,
        "--analyses",
        "integrated_gradients",
        "--ig-rule",
        "adaptive",
        "--ig-max-evaluations",
        "512",
        "--ig-tolerance",
        "0.05",
        "--no-figures",
    )
    assert main(args) == 0
    result = load_result(str(model_dir(tmp_path, tiny) / "default" / "integrated_gradients.npz"))
    assert result.converged is not None and result.settings["rule"] == "adaptive"
    assert result.settings["identity"]["ig_tolerance"] == 0.05 and "ig_steps" not in result.settings["identity"]
    # converged layers hold their certificate: |gap| <= bound <= tolerance * scale, the scale
    # |F(x) - F(b)| or the floor, a tenth of |F(x)|
    f_x = result.f_input[:, None]
    scale = np.maximum(np.maximum(np.abs(f_x - result.f_baseline), 0.1 * np.abs(f_x)), 1e-6)
    ok = result.converged
    assert ok.any()
    assert np.all(np.abs(result.gap[ok]) <= result.bound[ok] + 1e-6)
    assert np.all(result.bound[ok] <= 0.05 * scale[ok] + 1e-7)
    out = capsys.readouterr().out
    assert "layers converged" in out and "s compiling" in out
    # the run's seconds, split into compilation and computation
    s = result.settings
    assert s["compile_seconds"] > 0 and s["compilations"] > 0
    assert s["compile_seconds"] + s["compute_seconds"] == pytest.approx(s["seconds"])
    assert main(args) == 0  # a rerun reuses it; another tolerance does not
    assert "integrated_gradients: reusing" in capsys.readouterr().out
    assert main(args[:-2] + ["0.02", "--no-figures"]) == 0
    assert "integrated_gradients: reusing" not in capsys.readouterr().out


def test_adaptive_integrated_gradients_budget_through_the_cli(tiny, tmp_path, capsys):
    args = _run_args(tiny, tmp_path, "--analyses", "integrated_gradients", "--ig-rule", "adaptive", "--no-figures")
    assert main(args) == 0
    path = str(model_dir(tmp_path, tiny) / "default" / "integrated_gradients.npz")
    assert (
        load_result(path).settings["identity"]["ig_max_evaluations"] == 3
    )  # --ig-steps 2: the fixed rule's, at least 3
    capsys.readouterr()
    # another budget, below the first round's 23 nodes: run again, within it
    assert main(args + ["--ig-max-evaluations", "9"]) == 0
    assert "integrated_gradients: reusing" not in capsys.readouterr().out
    result = load_result(path)
    assert result.settings["identity"]["ig_max_evaluations"] == 9 and result.evaluations.max() <= 9
    with pytest.raises(SystemExit):
        main(args + ["--ig-max-evaluations", "2"])
    assert "at least 3" in capsys.readouterr().err
    fixed = [a for a in args if a not in ("--ig-rule", "adaptive")] + ["--ig-steps", "8"]
    assert main(fixed + ["--ig-max-evaluations", "9"]) == 0
    assert "--ig-max-evaluations applies to --ig-rule adaptive only" in capsys.readouterr().err


@pytest.mark.slow(seconds=60)
def test_a_run_compiles_few_programs_and_a_second_one_none(tiny, tmp_path):
    """Every analysis compiles its jitted computations only, once per shape: no eager operation
    on its results compiles a program of its own (each was one more per shape; the run once
    compiled 72). The persistent compilation cache: a run of the same shapes into a new results
    folder loads every program it needs, compiling none; `--no-compilation-cache` keeps nothing."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAXDEPTH_CACHE"] = str(tmp_path / "cache")

    def run(out, *extra):
        args = [sys.executable, "-m", "jaxdepth.lab.cli", *_run_args(tiny, tmp_path / out, "--no-figures", *extra)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return {
            a: load_result(str(model_dir(tmp_path / out, tiny) / "default" / f"{a}.npz")).settings
            for a in ANALYSES
            if os.path.exists(model_dir(tmp_path / out, tiny) / "default" / f"{a}.npz")
        }

    first = run("first")  # `compilations` counts the programs read from the cache too
    assert set(first) == set(ANALYSES)
    counts = {a: s["compilations"] for a, s in first.items()}
    assert all(
        counts[a] > 0 for a in ("contributions", "logit_lens", "layer_skip", "erasure", "integrated_gradients")
    ), counts
    assert sum(counts.values()) <= 24, counts
    second = run("second")
    for analysis, settings in second.items():
        assert settings["compilation_cache_hits"] == settings["compilations"] == counts[analysis], analysis
    env["JAXDEPTH_CACHE"] = str(tmp_path / "other_cache")
    uncached = run("third", "--analyses", "layer_skip", "--no-compilation-cache")["layer_skip"]
    assert uncached["compilations"] >= counts["layer_skip"] and uncached["compilation_cache_hits"] == 0
    assert not (tmp_path / "other_cache" / "xla").exists()


def test_length_buckets_are_an_option(tiny, tmp_path, capsys):
    args = _run_args(tiny, tmp_path, "--analyses", "contributions", "--no-figures")
    assert main([*args, "--length-buckets", "multiple:8"]) == 0
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--length-buckets", "octaves"])
    assert exit_.value.code == 2
    assert "'geometric', 'geometric:N' or 'multiple:N'" in capsys.readouterr().err


def _ig_result(gap, f_baseline, **settings):
    from jaxdepth.analyses.integrated_gradients import IntegratedGradientsResult

    gap = np.asarray(gap, np.float32)
    P, L = gap.shape
    return IntegratedGradientsResult(
        attributions=np.zeros((P, L, 4), np.float32),
        gap=gap,
        f_input=np.ones(P, np.float32),
        f_baseline=np.asarray(f_baseline, np.float32),
        tokens=np.zeros((P, 4), np.int32),
        lengths=np.full(P, 4),
        answer_start=np.full(P, 2),
        settings=settings,
    )


def test_the_ig_summary_gives_the_gap_as_a_share_and_calls_a_large_one_a_preview():
    summary = REGISTERED["integrated_gradients"].summary
    # |gap| / |F(x) - F(b)| per layer: 2%, 2%, 113%
    large = _ig_result([[0.01, -0.02, 0.113]], [[0.5, 0.0, 0.9]], rule="left", steps=8)
    assert summary(large) == [
        "IG (left rule, 8 steps): completeness gap up to 113% of |F(x)-F(b)| (layer 2): a preview, not a "
        "measurement (use --ig-rule adaptive or more --ig-steps)"
    ]
    small = _ig_result(
        [[0.001, 0.002, -0.004], [0.0, 0.0, 0.001]], [[0.5, 0.0, 0.9], [0.5, 0.5, 0.5]], rule="gauss", steps=16
    )
    assert summary(small) == ["IG (gauss rule, 16 steps): completeness gap up to 4% of |F(x)-F(b)| (layer 2, prompt 0)"]
    assert "--ig-rule {left,midpoint,gauss,right,adaptive}" in _help("run") and "--ig-steps" in _help("run")
    # On a tiny model's result at 2 steps, through the run: test_run_end_to_end checks the line its
    # run prints, which computes the same result (the default dataset, --prompts 2,
    # --detail-prompts 1, --ig-steps 2) that a run of this test's own would.


def _help(command: str) -> str:
    from jaxdepth.lab.cli import build_parser

    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices[command].format_help()
