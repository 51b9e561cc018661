"""Analyses as plugins: a tiny plugin distribution, made in a temporary folder, whose entry point
(group `jaxdepth.analyses`) and `--plugin MODULE:OBJECT` objects `jaxdepth run` loads. Its
analysis runs, caches, resumes, draws and sums up like a built-in one, and its results load back in
a process that never imported it; a plugin that does not load stops the run before any analysis
(exit status 2); one that raises while running is named with its error while the other results
are kept (exit status 1); a name clash is an error naming both sides."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import save_tiny_checkpoint, model_dir
from jaxdepth.lab import plugins as plugin_loader
from jaxdepth.lab.cli import main
from jaxdepth.lab.registry import ANALYSES, BUILT_IN
from jaxdepth.lab.results import load_result
from jaxdepth.lab.study import Failures

MODULE = "jaxdepth_tokplug"
DISTRIBUTION, VERSION = "jaxdepth-tokplug", "0.1"
ENTRY_POINT = ("token_count", f"{MODULE}:TOKEN_COUNT")
ENTRY_LABEL = f"entry point token_count = {MODULE}:TOKEN_COUNT ({DISTRIBUTION} {VERSION})"

PLUGIN_SOURCE = '''\
"""Analyses for jaxdepth from outside the package (the plugin of tests/lab/test_plugins.py)."""

import dataclasses

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from jaxdepth.core.saved_result import SavedResult
from jaxdepth.lab.registry import Analysis, Settings, option

CALLS = []  # one entry per computation of token_count: a reused result adds none


@dataclasses.dataclass
class PluginTokenCount(SavedResult):
    counts: np.ndarray  # [N] valid tokens per prompt, times the seed
    settings: dict


def count_tokens(inputs):
    CALLS.append(len(inputs.batch))
    return PluginTokenCount(counts=np.asarray(inputs.batch.valid).sum(axis=1) * inputs.settings.seed, settings={})


def bar_chart(result, tokenizer, detail_prompts):
    fig = Figure(figsize=(3, 2))
    FigureCanvasAgg(fig)
    fig.add_subplot().bar(np.arange(len(result.counts)), result.counts)
    return {"": fig}


TOKEN_COUNT = Analysis(name="token_count", result_type=PluginTokenCount, identity=lambda s: {"seed": s.seed},
                       run=count_tokens, figures=bar_chart,
                       summary=lambda r: [f"plugin tokens {int(r.counts.sum())}"])


def explode(inputs):
    raise RuntimeError("the boom plugin exploded")


def broken(*args):
    raise ZeroDivisionError("no figure today")


BOOM = dataclasses.replace(TOKEN_COUNT, name="boom", run=explode)
BAD_FIGURE = dataclasses.replace(TOKEN_COUNT, name="bad_figure", figures=broken, summary=broken)
NO_FIGURE = dataclasses.replace(TOKEN_COUNT, name="no_figure", figures=lambda result, tokenizer, detail_prompts: {})
CLASH = dataclasses.replace(TOKEN_COUNT, name="contributions")  # a built-in's name
TWIN = dataclasses.replace(TOKEN_COUNT)  # another analysis named token_count
NOT_AN_ANALYSIS = count_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightedCountSettings(Settings):
    count_weight: int = option(1, "weighted_count: what each valid token counts for")

    def __post_init__(self):
        super().__post_init__()
        if self.count_weight < 1:
            raise ValueError(f"--count-weight must be at least 1, got {self.count_weight}")


def count_weighted(inputs):
    counts = np.asarray(inputs.batch.valid).sum(axis=1) * inputs.settings.count_weight
    return PluginTokenCount(counts=counts, settings={})


WEIGHTED_COUNT = Analysis(name="weighted_count", result_type=PluginTokenCount, settings=WeightedCountSettings,
                          identity=lambda s: {"count_weight": s.count_weight}, run=count_weighted,
                          figures=lambda result, tokenizer, detail_prompts: {},
                          summary=lambda r: [f"weighted tokens {int(r.counts.sum())}"])
'''

PYPROJECT = f'''\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{DISTRIBUTION}"
version = "{VERSION}"
dependencies = ["jaxdepth"]

[project.entry-points."jaxdepth.analyses"]
{ENTRY_POINT[0]} = "{ENTRY_POINT[1]}"

[tool.setuptools]
py-modules = ["{MODULE}"]
'''


@pytest.fixture(scope="module")
def plugin_package(tmp_path_factory):
    """The plugin's source folder (pyproject.toml and module), and beside it a folder holding the
    module and the `.dist-info` that installing it writes (METADATA, entry_points.txt): on
    `sys.path`, importlib.metadata finds its entry point as that of an installed distribution."""
    root = tmp_path_factory.mktemp("plugin")
    source, site = root / "source", root / "site"
    for folder in (source, site):
        folder.mkdir()
        (folder / f"{MODULE}.py").write_text(PLUGIN_SOURCE)
    (source / "pyproject.toml").write_text(PYPROJECT)
    dist_info = site / f"{MODULE}-{VERSION}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DISTRIBUTION}\nVersion: {VERSION}\n")
    (dist_info / "entry_points.txt").write_text(f"[jaxdepth.analyses]\n{ENTRY_POINT[0]} = {ENTRY_POINT[1]}\n")
    return source, site


@pytest.fixture
def isolated_registry():
    """Whatever a test registers or loads is gone after it: the other tests see the built-in suite."""
    analyses, loaded = dict(ANALYSES), dict(plugin_loader.LOADED)
    yield
    ANALYSES.clear()
    ANALYSES.update(analyses)
    plugin_loader.LOADED.clear()
    plugin_loader.LOADED.update(loaded)
    sys.modules.pop(MODULE, None)


@pytest.fixture
def installed(plugin_package, monkeypatch, isolated_registry):
    """The plugin distribution installed (on `sys.path`) for this test only."""
    monkeypatch.syspath_prepend(str(plugin_package[1]))
    return plugin_package[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), context=1024)


def _run(model, out, *extra):
    return main(
        [
            "run",
            "--model",
            model,
            "--dataset",
            "default",
            "--prompts",
            "2",
            "--detail-prompts",
            "1",
            "--bootstrap",
            "0",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_an_entry_point_plugin_runs_caches_resumes_draws_and_sums_up(tiny, installed, tmp_path, capsys):
    assert _run(tiny, tmp_path, "--analyses", "contributions,token_count") == 0
    printed = capsys.readouterr().out
    plugin = sys.modules[MODULE]
    assert plugin.CALLS == [2]
    assert [p.label for p in plugin_loader.LOADED.values()] == [ENTRY_LABEL]
    folder = model_dir(tmp_path, tiny) / "default"
    saved = load_result(str(folder / "token_count.npz"))
    assert isinstance(saved, plugin.PluginTokenCount)
    assert saved.settings["identity"]["seed"] == 123 and saved.settings["identity"]["model"] == os.path.basename(tiny)
    valid_tokens = load_result(str(folder / "contributions.npz")).tokens_per_prompt  # the built-in's count
    assert f"default: 2 prompts, {int(valid_tokens.sum())} tokens" in printed
    np.testing.assert_array_equal(saved.counts, valid_tokens * 123)
    summary = next(line for line in printed.splitlines() if line.startswith("  default;"))
    assert f"plugin tokens {int(saved.counts.sum())}" in summary and "cosine ED" in summary
    for name in ("token_count", "contributions"):
        for ext in ("png", "pdf"):
            assert (folder / "figures" / f"{name}.{ext}").stat().st_size > 1000, (name, ext)
    mtime = (folder / "token_count.npz").stat().st_mtime_ns

    # A rerun reuses the plugin's result (its function is not called again) and still sums it up;
    # the same object named again by --plugin is the same plugin, not a clash.
    assert _run(tiny, tmp_path, "--analyses", "contributions,token_count", "--plugin", ENTRY_POINT[1]) == 0
    printed = capsys.readouterr().out
    assert plugin.CALLS == [2] and sys.modules[MODULE] is plugin
    assert "token_count: reusing" in printed and "contributions: reusing" in printed
    assert f"plugin tokens {int(saved.counts.sum())}" in printed
    assert (folder / "token_count.npz").stat().st_mtime_ns == mtime
    # a setting in its identity changes: computed again
    assert _run(tiny, tmp_path, "--analyses", "token_count", "--seed", "5", "--no-figures") == 0
    assert plugin.CALLS == [2, 2]
    np.testing.assert_array_equal(load_result(str(folder / "token_count.npz")).counts, valid_tokens * 5)


def test_failing_plugins_are_named_and_the_other_results_kept(tiny, installed, tmp_path, capsys):
    plugins = [f"{MODULE}:BOOM", f"{MODULE}:BAD_FIGURE"]  # (plugins that do not load: see the next test)
    args = ["--analyses", "boom,contributions,bad_figure,token_count", *(a for p in plugins for a in ("--plugin", p))]
    assert _run(tiny, tmp_path, *args) == 1
    captured = capsys.readouterr()
    err = captured.err
    for line in (
        f"error: plugin {MODULE}:BOOM (analysis 'boom') raised while running: RuntimeError: the boom plugin exploded",
        f"error: plugin {MODULE}:BAD_FIGURE (analysis 'bad_figure') raised while drawing its figures: "
        "ZeroDivisionError: no figure today",
        f"error: plugin {MODULE}:BAD_FIGURE (analysis 'bad_figure') raised while summing up its result: "
        "ZeroDivisionError: no figure today",
    ):
        assert any(said.startswith(line) for said in err.splitlines()), line
    assert 'raise RuntimeError("the boom plugin exploded")' in err  # its traceback, for the plugin's author
    assert "boom: failed (RuntimeError: the boom plugin exploded); going on with the others" in captured.out
    # the analyses after the failing one ran; every result but the failed one is saved, drawn and summed up
    folder = model_dir(tmp_path, tiny) / "default"
    assert sorted(p.name for p in folder.glob("*.npz")) == ["bad_figure.npz", "contributions.npz", "token_count.npz"]
    for name in ("bad_figure", "contributions", "token_count"):
        load_result(str(folder / f"{name}.npz"))
    assert sorted(p.name for p in (folder / "figures").glob("*.png")) == ["contributions.png", "token_count.png"]
    summary = next(line for line in captured.out.splitlines() if line.startswith("  default;"))
    assert "cosine ED" in summary and "plugin tokens" in summary
    assert (tmp_path / "effective_depth_table.md").exists()  # contributions still feeds the table
    # a rerun keeps what was saved and tries the failed one again
    assert _run(tiny, tmp_path, *args, "--no-figures") == 1
    captured = capsys.readouterr()
    for name in ("contributions", "bad_figure", "token_count"):
        assert f"{name}: reusing" in captured.out
    assert "boom: failed" in captured.out and f"plugin {MODULE}:BOOM (analysis 'boom') raised" in captured.err
    # an analysis of a plugin that did not load is unknown, and said so
    assert _run(tiny, tmp_path, "--analyses", "nothing_here", "--plugin", "no_such_plugin_module:THING") == 2
    assert "plugins that failed to load: no_such_plugin_module:THING" in capsys.readouterr().err


def test_a_plugin_that_does_not_load_stops_the_run_before_any_analysis(tiny, installed, tmp_path, capsys):
    """A misspelt --plugin costs a second, not a run of the whole suite that fails at its end."""
    start = time.monotonic()
    assert _run(tiny, tmp_path, "--plugin", f"{MODULE}:TOKEN_CUONT") == 2  # no --analyses: the whole suite
    assert time.monotonic() - start < 30
    captured = capsys.readouterr()
    assert (
        f"error: plugin {MODULE}:TOKEN_CUONT failed to load: AttributeError: module '{MODULE}' has no attribute "
        "'TOKEN_CUONT'"
    ) in captured.err.splitlines()
    assert captured.err.splitlines()[-1].startswith(
        f"error: nothing was run; plugins that failed to load: {MODULE}:TOKEN_CUONT (correct the --plugin"
    )
    assert "loaded" not in captured.out and not os.path.exists(model_dir(tmp_path, tiny)), "the run went on"
    assert sys.modules[MODULE].CALLS == []

    plugins = [f"{MODULE}:NOPE", "no_such_plugin_module:THING", f"{MODULE}:NOT_AN_ANALYSIS"]
    assert _run(tiny, tmp_path, "--analyses", "token_count", *(a for p in plugins for a in ("--plugin", p))) == 2
    err = capsys.readouterr().err
    for line in (
        f"error: plugin {MODULE}:NOPE failed to load: AttributeError: module '{MODULE}' has no attribute 'NOPE'",
        "error: plugin no_such_plugin_module:THING failed to load: ModuleNotFoundError: No module named "
        "'no_such_plugin_module'",
        f"error: plugin {MODULE}:NOT_AN_ANALYSIS failed to load: TypeError: the function count_tokens is not a "
        "jaxdepth.lab.registry.Analysis",
        f"error: nothing was run; plugins that failed to load: {', '.join(plugins)}",
    ):
        assert any(said.startswith(line) for said in err.splitlines()), line
    assert not os.path.exists(model_dir(tmp_path, tiny))


def test_an_entry_point_that_does_not_load_stops_the_run(tiny, installed, tmp_path, monkeypatch, capsys):
    site = tmp_path / "site"
    dist_info = site / "jaxdepth_broken-0.2.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: jaxdepth-broken\nVersion: 0.2\n")
    (dist_info / "entry_points.txt").write_text(f"[jaxdepth.analyses]\nbroken = {MODULE}:MISSING\n")
    monkeypatch.syspath_prepend(str(site))
    start = time.monotonic()
    assert _run(tiny, tmp_path / "out", "--analyses", "token_count") == 2
    assert time.monotonic() - start < 30
    err = capsys.readouterr().err
    label = f"entry point broken = {MODULE}:MISSING (jaxdepth-broken 0.2)"
    assert f"error: plugin {label} failed to load: AttributeError: module '{MODULE}' has no attribute 'MISSING'" in err
    assert f"plugins that failed to load: {label}" in err and "uninstall" in err
    assert not os.path.exists(model_dir(tmp_path / "out", tiny)) and sys.modules[MODULE].CALLS == []


def test_a_plugin_result_loads_in_a_process_that_never_imported_the_plugin(tiny, installed, tmp_path):
    assert _run(tiny, tmp_path, "--analyses", "token_count", "--no-figures") == 0
    path = str(model_dir(tmp_path, tiny) / "default" / "token_count.npz")
    counts = load_result(path).counts
    code = textwrap.dedent(f"""
        import sys
        from jaxdepth.lab.registry import ANALYSES
        from jaxdepth.lab.results import load_result
        assert {MODULE!r} not in sys.modules
        result = load_result(sys.argv[1])
        print(type(result).__module__, type(result).__qualname__, *result.counts.tolist())
        print({MODULE!r} in sys.modules, "token_count" in ANALYSES)  # imported, not registered
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [" ".join([MODULE, "PluginTokenCount", *map(str, counts.tolist())]), "True False"]

    # without the plugin where Python finds it: an error naming the type and the module to import
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode != 0
    assert (
        f"UnknownResultTypeError: {path}: result type 'PluginTokenCount' is defined in the module '{MODULE}', "
        f"which cannot be imported (ModuleNotFoundError: No module named '{MODULE}')"
    ) in out.stderr, out.stderr[-2000:]


def test_figures_are_announced_only_when_drawn_and_the_lock_goes_with_the_run(tiny, installed, tmp_path, capsys):
    folder = model_dir(tmp_path, tiny) / "default"
    assert _run(tiny, tmp_path, "--analyses", "no_figure", "--plugin", f"{MODULE}:NO_FIGURE") == 0
    assert "figures in" not in capsys.readouterr().out
    assert sorted(os.listdir(folder)) == ["no_figure.npz"]  # nothing drawn, no lock file left
    assert _run(tiny, tmp_path, "--analyses", "token_count,boom", "--plugin", f"{MODULE}:BOOM") == 1
    assert f"  figures in {folder / 'figures'}" in capsys.readouterr().out.splitlines()
    assert sorted(os.listdir(folder)) == ["figures", "no_figure.npz", "token_count.npz"]  # a failed run: no lock


def test_a_name_clash_or_a_malformed_plugin_stops_the_run(tiny, installed, tmp_path, capsys):
    builtin = ANALYSES["contributions"]
    assert _run(tiny, tmp_path, "--plugin", f"{MODULE}:CLASH") == 2
    assert (
        f"error: plugin {MODULE}:CLASH adds an analysis named 'contributions', which the built-in suite has "
        "already: remove or rename one"
    ) in capsys.readouterr().err
    assert ANALYSES["contributions"] is builtin and "token_count" not in ANALYSES  # none registered
    assert _run(tiny, tmp_path, "--plugin", f"{MODULE}:TWIN") == 2
    assert (
        f"error: plugins {MODULE}:TWIN and {ENTRY_LABEL} both add an analysis named 'token_count': remove or rename one"
    ) in capsys.readouterr().err
    assert "token_count" not in ANALYSES
    # against a plugin registered before
    [entry_point] = plugin_loader.load_plugins()
    with pytest.raises(
        ValueError,
        match=f"plugin {MODULE}:TWIN adds an analysis named 'token_count', which plugin "
        f"{re.escape(ENTRY_LABEL)} has already",
    ):
        plugin_loader.load_plugins([f"{MODULE}:TWIN"], entry_points=False)
    assert ANALYSES["token_count"] is entry_point.analysis is sys.modules[MODULE].TOKEN_COUNT
    assert _run(tiny, tmp_path, "--plugin", MODULE) == 2
    assert f"--plugin takes MODULE:OBJECT (e.g. mypackage.analyses:ENTROPY), got '{MODULE}'" in capsys.readouterr().err
    assert not os.path.exists(model_dir(tmp_path, tiny)), "a refused run computed something"


def test_plugins_are_loaded_by_a_run_once_not_on_import(installed):
    code = (
        "import sys, jaxdepth, jaxdepth.lab.cli, jaxdepth.lab.study\n"
        "from jaxdepth.lab.registry import ANALYSES\n"
        "jaxdepth.lab.cli.build_parser()\n"
        f"print({MODULE!r} in sys.modules, 'token_count' in ANALYSES)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"]
    first = plugin_loader.load_plugins()
    assert [p.label for p in first] == [ENTRY_LABEL] and ANALYSES["token_count"] is first[0].analysis
    again = plugin_loader.load_plugins()  # loaded once: the same plugin, its analysis registered once
    assert len(again) == 1 and again[0] is first[0]


def test_failures_isolate_only_the_named_analyses():
    failures = Failures(isolated=["plugin_analysis"])
    with failures.guard("plugin_analysis", "running"):
        raise RuntimeError("kept")
    assert [(f.name, f.stage, str(f.error)) for f in failures.records] == [("plugin_analysis", "running", "kept")]
    with pytest.raises(RuntimeError, match="passes"):  # a built-in's error ends the run, as before
        with failures.guard("contributions", "running"):
            raise RuntimeError("passes")
    with pytest.raises(KeyboardInterrupt):
        with failures.guard("plugin_analysis", "running"):
            raise KeyboardInterrupt
    assert len(failures.records) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("setuptools") is None or importlib.util.find_spec("pip") is None,
    reason="installing the plugin from its pyproject.toml needs pip and setuptools",
)
def test_the_plugin_installed_from_its_pyproject_is_found(plugin_package, tmp_path, monkeypatch, isolated_registry):
    """pip, offline, turns the pyproject.toml's entry point into the same installed distribution."""
    target = tmp_path / "target"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(target),
            str(plugin_package[0]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    monkeypatch.syspath_prepend(str(target))
    [plugin] = plugin_loader.load_plugins()
    assert plugin.label == ENTRY_LABEL and plugin.error is None
    assert ANALYSES["token_count"] is plugin.analysis and plugin.analysis.name not in BUILT_IN
    assert sys.modules[MODULE].__file__ == str(target / f"{MODULE}.py")


def test_a_plugin_declares_settings_and_gets_their_option(tiny, installed, tmp_path, capsys):
    """The plugin's module is the one file: its settings class declares `count_weight`, and
    `jaxdepth run` offers `--count-weight`, checks it, passes it in and caches by it."""
    named = ["--plugin", f"{MODULE}:WEIGHTED_COUNT", "--analyses", "weighted_count", "--no-figures"]
    with pytest.raises(SystemExit):
        main(["run", "--help", *named])
    assert "--count-weight COUNT_WEIGHT" in capsys.readouterr().out
    assert _run(tiny, tmp_path, *named, "--count-weight", "3") == 0
    assert "weighted_count: reusing" not in capsys.readouterr().out
    saved = load_result(str(model_dir(tmp_path, tiny) / "default" / "weighted_count.npz"))
    assert saved.settings["identity"]["count_weight"] == 3
    valid = saved.counts // 3
    np.testing.assert_array_equal(saved.counts, valid * 3)
    assert _run(tiny, tmp_path, *named, "--count-weight", "3") == 0
    assert "weighted_count: reusing" in capsys.readouterr().out
    assert _run(tiny, tmp_path, *named) == 0  # the default weight, 1: another identity, computed
    np.testing.assert_array_equal(
        load_result(str(model_dir(tmp_path, tiny) / "default" / "weighted_count.npz")).counts, valid
    )
    assert _run(tiny, tmp_path, *named, "--count-weight", "0") == 2  # the settings class refuses it
    assert "--count-weight must be at least 1, got 0" in capsys.readouterr().err
    ANALYSES.pop("weighted_count")  # as in a new process that does not name the plugin
    plugin_loader.LOADED.pop(f"{MODULE}:WEIGHTED_COUNT")
    with pytest.raises(SystemExit):  # without the plugin, no such option
        _run(tiny, tmp_path, "--analyses", "contributions", "--count-weight", "3")
    assert "unrecognized arguments: --count-weight 3" in capsys.readouterr().err
