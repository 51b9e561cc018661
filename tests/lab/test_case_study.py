"""`jaxdepth case`: one prompt's erasure and integrated gradients through the CLI on a tiny
checkpoint (results equal to the analyses run directly, figures, resume), and clear errors."""

import numpy as np
import pytest

from conftest import save_tiny_checkpoint, model_dir
from jaxdepth.analyses.erasure import mean_residuals, residual_erasure
from jaxdepth.analyses.ig import Execution, FixedRule
from jaxdepth.analyses.integrated_gradients import integrated_gradients_of_answers
from jaxdepth.lab.case_study import ARITHMETIC_PROMPT, case_prompt
from jaxdepth.lab.cli import main
from jaxdepth.lab.sources import load
from jaxdepth.lab.prompts import encode, load_prompts
from jaxdepth.lab.results import load_result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), context=1024)


def _case_folder(out, tiny):
    prompt, name = case_prompt(question=ARITHMETIC_PROMPT.question, answer=ARITHMETIC_PROMPT.answer)
    return model_dir(out, tiny) / name, prompt


def test_case_prompt_matches_the_analyses_run_directly(tiny, tmp_path, capsys):
    args = [
        "case",
        tiny,
        "--prompt",
        ARITHMETIC_PROMPT.question,
        "--answer",
        ARITHMETIC_PROMPT.answer,
        "--ig-steps",
        "4",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    folder, prompt = _case_folder(tmp_path, tiny)
    erasure, ig = load_result(str(folder / "erasure.npz")), load_result(str(folder / "integrated_gradients.npz"))
    figures = {p.name for p in (folder / "figures").iterdir()}
    assert {"case.png", "case.pdf", "erasure_prompt0.png", "integrated_gradients_prompt0.png"} <= figures
    assert (folder / "figures" / "case.png").stat().st_size > 5000

    model = load(tiny)
    batch = encode(model.tokenizer, [prompt])
    baseline = encode(model.tokenizer, load_prompts("default", limit=10))  # the embedded prompts (offline)
    expected_erasure = residual_erasure(
        model.params, batch, model.config, mean_residuals(model.params, baseline, model.config)
    )
    expected_ig = integrated_gradients_of_answers(
        model.params, batch, model.config, rule=FixedRule(steps=4), execution=Execution(progress=False)
    )
    np.testing.assert_array_equal(erasure.effects, expected_erasure.effects)
    np.testing.assert_array_equal(ig.attributions, expected_ig.attributions)
    answer = erasure.tokens[0, erasure.answer_start[0] : erasure.lengths[0]]
    assert model.tokenizer.decode(answer).strip() == ARITHMETIC_PROMPT.answer  # '28', and only it, is attributed
    assert "embedded prompts" in capsys.readouterr().out

    # a rerun reuses both results instead of recomputing them
    assert main(args + ["--no-figures"]) == 0
    assert capsys.readouterr().out.count("reusing") == 2


def test_case_dataset_row(tiny, tmp_path):
    assert (
        main(
            [
                "case",
                tiny,
                "--dataset",
                "default",
                "--row",
                "2",
                "--analyses",
                "erasure",
                "--out",
                str(tmp_path),
                "--no-figures",
            ]
        )
        == 0
    )
    result = load_result(str(model_dir(tmp_path, tiny) / "case_default_row2" / "erasure.npz"))
    model = load(tiny)
    expected = encode(model.tokenizer, [load_prompts("default")[2]])
    np.testing.assert_array_equal(result.tokens, expected.tokens)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "1 + 1 = "], "--answer"),
        (["--prompt", "1 + 1 = ", "--answer", "2", "--dataset", "default", "--row", "0"], "either a prompt"),
        ([], "either a prompt"),
        (["--dataset", "default", "--row", "100000"], "does not exist"),
        (["--dataset", "default"], "row number"),
        (["--prompt", "1 + 1 = ", "--answer", "2", "--analyses", "contributions"], "not one prompt"),
        (["--prompt", "1 + 1 = ", "--answer", "2", "--analyses", "nonsense"], "unknown analyses"),
        (["--prompt", "1 + 1 = ", "--answer", "2", "--row", "3"], "go with --dataset"),
        (["--dataset", "default", "--row", "0", "--answer", "2"], "brings its own answer"),
        (["--model", "elsewhere", "--prompt", "1 + 1 = ", "--answer", "2"], "two models given"),
    ],
)
def test_case_errors(tiny, tmp_path, capsys, args, message):
    assert main(["case", tiny, "--out", str(tmp_path), *args]) != 0
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_prompt_without_answer_tokens_is_refused():
    from jaxdepth.lab.case_study import check_answer_tokens
    from jaxdepth.core.batch import make_batch

    prompt = ARITHMETIC_PROMPT
    assert check_answer_tokens(make_batch([[5, 6, 7, 8]], [2]), prompt) == 2
    with pytest.raises(ValueError, match="encodes to no token"):
        check_answer_tokens(make_batch([[5, 6, 7, 8]], [4]), prompt)  # answer start == length


def test_case_accepts_the_model_as_an_option(tiny, tmp_path):
    assert (
        main(
            [
                "case",
                "--model",
                tiny,
                "--prompt",
                "1 + 1 = ",
                "--answer",
                "2",
                "--analyses",
                "erasure",
                "--out",
                str(tmp_path),
                "--no-figures",
            ]
        )
        == 0
    )
    assert len(list(model_dir(tmp_path, tiny).glob("case_*/erasure.npz"))) == 1


def test_case_names_differ_by_prompt_and_answer():
    names = {case_prompt(question=q, answer=a)[1] for q, a in [("1 + 1 = ", "2"), ("1 + 1 = ", "3"), ("2 + 1 = ", "3")]}
    assert len(names) == 3


def test_a_case_draws_the_decision_depth_of_each_token_beside_erasure(tiny, tmp_path):
    """A plugin with a per-token view runs in a case: the decision depth's panel has one column
    per token that turns at that token's decision depth (computed directly), stacked with erasure."""
    from jaxdepth.analyses.decision_depth import decision_depth, decision_depth_panel
    from jaxdepth.lab import plugins
    from jaxdepth.lab.case_study import case_figure
    from jaxdepth.lab.registry import ANALYSES

    registered, loaded = dict(ANALYSES), dict(plugins.LOADED)
    try:
        args = ["case", tiny, "--prompt", "2 + 3 = ", "--answer", "5", "--out", str(tmp_path)]
        args += ["--analyses", "erasure,decision_depth"]  # in the suite: no plugin needed
        assert main(args) == 0
        _, name = case_prompt(question="2 + 3 = ", answer="5")
        folder = model_dir(tmp_path, tiny) / name
        result = load_result(str(folder / "decision_depth.npz"))
        assert (folder / "figures" / "case.png").stat().st_size > 5000
        model = load(tiny)
        batch = encode(model.tokenizer, [case_prompt(question="2 + 3 = ", answer="5")[0]])
        expected = decision_depth(model.params, batch, model.config)
        np.testing.assert_array_equal(result.depth, expected.depth)
        panel = decision_depth_panel(result, 0)
        n = int(batch.lengths[0])
        assert panel.values.shape == (model.config.num_layers + 1, n)
        for t in range(n):  # each column: 0 below the token's decision depth, 1 from it on
            column, d = panel.values[:, t], int(expected.depth[0, t])
            assert column[:d].sum() == 0 and column[d:].min() == 1, t
        figure = case_figure({"erasure": load_result(str(folder / "erasure.npz")), "decision_depth": result})
        assert len([ax for ax in figure.axes if ax.get_ylabel()]) >= 2
    finally:
        ANALYSES.clear()
        ANALYSES.update(registered)
        plugins.LOADED.clear()
        plugins.LOADED.update(loaded)
