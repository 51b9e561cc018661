"""Analyses from outside the package: the plugins `jaxdepth run` loads.

The contract. A plugin is named `MODULE:OBJECT`: MODULE a dotted module name Python can import,
OBJECT a (dotted) attribute of that module holding a `jaxdepth.lab.registry.Analysis` instance,
the same declaration a built-in analysis is (its name, result type, cache identity, run, figures
and summary; its result type a `jaxdepth.core.saved_result.SavedResult` dataclass with a
`settings` dict). The loader imports MODULE, takes OBJECT and registers it: MODULE need not call
`register` itself (if it registered that very object already, that is accepted). Anything else
there, a function, a class, a module or a list of analyses, is refused, saying what it is.

Two ways in, both read when `jaxdepth run` starts (never on `import jaxdepth`), each plugin loaded
once in a process:
- `jaxdepth run --plugin MODULE:OBJECT` (repeatable), MODULE found on `sys.path` (PYTHONPATH);
- an entry point in the group `jaxdepth.analyses` (`ENTRY_POINT_GROUP`) of an installed
  distribution, declared in its pyproject.toml as
  `[project.entry-points."jaxdepth.analyses"]` / `entropy = "mypackage.analyses:ENTROPY"`.
A plugin's analysis then runs, caches, resumes, draws and sums up like a built-in one: without
`--analyses` it runs with the others, and `--analyses` may name it.

Its name must be free: an analysis name that a built-in or another plugin already has is an error
naming both, and nothing runs; so is a `--plugin` not of the form MODULE:OBJECT. A plugin that
does not import, lacks OBJECT or holds something other than an Analysis adds nothing and carries
its error (`Plugin.error`); `jaxdepth run` then names it, with the error, and stops before any
analysis runs (exit status 2). An analysis of a plugin that raises while running, drawing its
figures or summing up is reported likewise (`jaxdepth.lab.study.Failures`), but every other
analysis's result is computed, saved and cached as usual, and `jaxdepth run` exits with status 1.

A plugin's saved results load back (`jaxdepth.lab.results.load_result`) in any process that can
import its module: the file names the module of its result type, imported when needed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import types
from typing import Callable, Optional, Sequence

from jaxdepth.core.saved_result import SavedResult
from jaxdepth.lab.registry import ANALYSES, BUILT_IN, Analysis, register

__all__ = [
    "Plugin",
    "load_plugins",
    "owners",
    "ENTRY_POINT_GROUP",
    "SPEC",
    "NAME",
    "LOADED",
]


ENTRY_POINT_GROUP = "jaxdepth.analyses"

_IDENTIFIERS = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
SPEC = re.compile(rf"{_IDENTIFIERS}:{_IDENTIFIERS}")  # what `--plugin` takes: MODULE:OBJECT
# An analysis name becomes a file name (<name>.npz, figures/<name>.png) and an `--analyses` item.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class Plugin:
    """One plugin as loaded. `label` says where it came from (the `--plugin` MODULE:OBJECT, or
    `entry point NAME = MODULE:OBJECT (DISTRIBUTION VERSION)`); exactly one of `analysis` (what it
    added) and `error` (why it could not be loaded) is set."""

    label: str
    analysis: Optional[Analysis] = None
    error: Optional[Exception] = None


LOADED: dict[str, Plugin] = {}  # every plugin loaded in this process, by label: each is loaded once


def load_plugins(specs: Sequence[str] = (), *, entry_points: bool = True) -> list[Plugin]:
    """Load the plugins `specs` (MODULE:OBJECT each) and, with `entry_points`, those of the group
    `jaxdepth.analyses`, and register their analyses. Returns every plugin, loaded or not: one that
    failed to load carries its `error` and adds nothing. A malformed spec or an analysis name that
    is taken raises ValueError (naming both owners), before anything is registered."""
    for spec in specs:
        if not SPEC.fullmatch(spec):
            raise ValueError(f"--plugin takes MODULE:OBJECT (e.g. mypackage.analyses:ENTROPY), got {spec!r}")
    sources = [
        (spec, importlib.metadata.EntryPoint(name=spec, value=spec, group=ENTRY_POINT_GROUP).load) for spec in specs
    ]
    if entry_points:
        sources += [
            (_entry_point_label(ep), ep.load) for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        ]
    plugins = []
    for label, load in sources:
        if label not in LOADED:
            LOADED[label] = _load(label, load)
        plugins.append(LOADED[label])
    _register(plugins)
    return plugins


def owners(plugins: Sequence[Plugin]) -> dict[str, str]:
    """Analysis name -> the label of the plugin that brought it (the first, if several brought the
    same object)."""
    found: dict[str, str] = {}
    for plugin in plugins:
        if plugin.analysis is not None:
            found.setdefault(plugin.analysis.name, plugin.label)
    return found


def _entry_point_label(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    source = f" ({dist.name} {dist.version})" if dist is not None else ""
    return f"entry point {ep.name} = {ep.value}{source}"


def _load(label: str, load: Callable[[], object]) -> Plugin:
    try:
        return Plugin(label, analysis=_checked(load()))
    except Exception as error:  # whatever the plugin's import raises: kept, for the caller to report
        return Plugin(label, error=error)


def _checked(obj) -> Analysis:
    """`obj` if it is an Analysis a study can run, else a TypeError or ValueError saying why not."""
    if not isinstance(obj, Analysis):
        if isinstance(obj, types.ModuleType):
            what = f"the module {obj.__name__}"
        elif isinstance(obj, type):
            what = f"the class {obj.__qualname__}"
        elif callable(obj):
            what = f"the {type(obj).__name__} {getattr(obj, '__qualname__', repr(obj))}"
        else:
            what = f"a {type(obj).__name__}"
        raise TypeError(
            f"{what} is not a jaxdepth.lab.registry.Analysis: a plugin names an Analysis "
            "object (see jaxdepth.lab.plugins)"
        )
    if not isinstance(obj.name, str) or not NAME.fullmatch(obj.name):
        raise ValueError(
            f"analysis name {obj.name!r}: letters, digits, '_', '.' and '-' only, a letter or digit "
            "first (it names the result file)"
        )
    result_type = obj.result_type
    if not (
        isinstance(result_type, type)
        and issubclass(result_type, SavedResult)
        and dataclasses.is_dataclass(result_type)
        and "settings" in {f.name for f in dataclasses.fields(result_type)}
    ):
        raise TypeError(
            f"analysis {obj.name!r}: its result_type {result_type!r} must be a dataclass inheriting "
            "jaxdepth.core.saved_result.SavedResult with a `settings` dict field"
        )
    return obj


def _register(plugins: Sequence[Plugin]) -> None:
    """Register the plugins' analyses, or none of them if a name is taken."""
    new: dict[str, Plugin] = {}
    for plugin in plugins:
        entry = plugin.analysis
        if entry is None:
            continue
        other = new.get(entry.name)
        if other is not None and other.analysis is not entry:
            raise ValueError(
                f"plugins {other.label} and {plugin.label} both add an analysis named {entry.name!r}: "
                "remove or rename one"
            )
        registered = ANALYSES.get(entry.name)
        if registered is not None and registered is not entry:
            raise ValueError(
                f"plugin {plugin.label} adds an analysis named {entry.name!r}, which "
                f"{_owner(entry.name)} has already: remove or rename one"
            )
        new.setdefault(entry.name, plugin)
    for name, plugin in new.items():
        if name not in ANALYSES:  # (a plugin loaded before, or a module that registered its own object)
            register(plugin.analysis)


def _owner(name: str) -> str:
    """Who registered the analysis `name`, in words."""
    if name in BUILT_IN:
        return "the built-in suite"
    for plugin in LOADED.values():
        if plugin.analysis is not None and plugin.analysis is ANALYSES[name]:
            return f"plugin {plugin.label}"
    return "a registration from Python (jaxdepth.lab.registry.register)"
