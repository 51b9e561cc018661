"""docs/reference.md, the API reference, against the package (fast: no model is loaded).

The public names are those of `jaxdepth.__all__`, of `jaxdepth.sites` and of every module of
`jaxdepth.analyses` and its subpackages (the functions and classes a module defines, `__module__`
that module, whose names do not start with `_`), and the public methods and properties each of their classes
defines. This test lists them itself, not through the generator, so that a generator that
skipped one would not hide it:

- every public name has an entry (a heading) in docs/reference.md;
- docs/reference.md is what `python docs/reference.py` writes now (not stale);
- every public function, class, method and property has a docstring of its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys

import pytest

from test_docs import ROOT, blocks, read

PAGE = "docs/reference.md"


@functools.cache
def _generator():
    """docs/reference.py as a module (docs/ is no package)."""
    name = "jaxdepth_docs_reference"
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "docs", "reference.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def _defined_in(module) -> dict:
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and getattr(obj, "__module__", None) == module.__name__
        and (inspect.isclass(obj) or inspect.isroutine(inspect.unwrap(obj)))
    }


def public_objects() -> dict:
    """`{name as a user writes it: object}` for every public function and class (and the module
    `jaxdepth.sites`)."""
    import jaxdepth
    from jaxdepth import analyses, sites

    found = {f"jaxdepth.{name}": getattr(jaxdepth, name) for name in jaxdepth.__all__}
    found.update({f"jaxdepth.sites.{name}": obj for name, obj in _defined_in(sites).items()})
    for info in pkgutil.walk_packages(analyses.__path__, prefix="jaxdepth.analyses."):
        module = importlib.import_module(info.name)
        found.update({f"{module.__name__}.{name}": obj for name, obj in _defined_in(module).items()})
    return found


def _members(cls) -> dict:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    kinds = (property, functools.cached_property, classmethod, staticmethod)
    return {
        name: value
        for name, value in vars(cls).items()
        if not name.startswith("_") and name not in fields and (isinstance(value, kinds) or inspect.isfunction(value))
    }


def _headings() -> set:
    return set(re.findall(r"^#{2,4} `([^`]+)`\s*$", read(PAGE), flags=re.M))


def test_every_public_name_has_an_entry():
    headings = _headings()
    missing = []
    for name, obj in public_objects().items():
        if name not in headings:
            missing.append(name)
        if inspect.isclass(obj):
            missing += [
                f"{name}.{member} (heading `{obj.__name__}.{member}`)"
                for member in _members(obj)
                if f"{obj.__name__}.{member}" not in headings
            ]
    assert not missing, f"{PAGE} has no entry for: {', '.join(missing)}; run `python docs/reference.py`"


def test_reference_is_up_to_date():
    expected, written = _generator().render(), read(PAGE)
    if expected != written:
        diff = list(
            difflib.unified_diff(written.splitlines(), expected.splitlines(), PAGE, "docstrings now", lineterm="", n=1)
        )
        pytest.fail(f"{PAGE} is stale: run `python docs/reference.py`. First differences:\n" + "\n".join(diff[:40]))


def test_every_public_function_and_class_has_a_docstring():
    undocumented = []
    for name, obj in public_objects().items():
        if not _generator().docstring(obj):
            undocumented.append(name)
        if inspect.isclass(obj):
            undocumented += [
                f"{name}.{member}" for member, value in _members(obj).items() if not _generator().docstring(value)
            ]
    assert not undocumented, "public names without a docstring: " + ", ".join(undocumented)


def test_the_page_runs_nothing():
    """Signatures and indented docstring blocks are ```text fences: no docs test runs them."""
    languages = {block.language for block in blocks(PAGE)}
    assert languages <= {"text"}, f"{PAGE} has fences of {sorted(languages - {'text'})}"


def test_docstrings_become_markdown_that_says_what_they_say():
    markdown = _generator().markdown
    doc = (
        "Means over `<statistic>_per_prompt` and <statistic>, x * y, a[l](b).\n"
        "\n"
        "The fit\n"
        "-------\n"
        "Ridge, then::\n"
        "\n"
        "    E[m, l] = sqrt(sum_t ||h_l - f(h_m)||^2)\n"
        "\n"
        "keep: what to keep\n"
        "    per layer\n"
        "edit: what to edit\n"
        "1. a numbered line\n"
    )
    assert markdown(doc).split("\n\n") == [
        "Means over `<statistic>_per_prompt` and &lt;statistic>, x \\* y, a[l]\\(b).",
        "**The fit**",
        "Ridge, then:",
        "```text\nE[m, l] = sqrt(sum_t ||h_l - f(h_m)||^2)\n```",
        "- keep: what to keep\n  per layer\n- edit: what to edit\n1. a numbered line",
    ]
    with pytest.raises(ValueError, match="fenced block"):
        markdown("An example:\n\n```python\nprint(1)\n```\n")
