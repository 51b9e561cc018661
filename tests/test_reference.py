"""docs/reference.md, the API reference, against the package (fast: no model is loaded).

The public names are those of `jaxdepth.__all__`, and the functions and classes of the
`__all__` of `jaxdepth.sites`, of every module of `jaxdepth.analyses` and its subpackages and of
every module of `jaxdepth.core`, `jaxdepth.lab` and `conversion` that has one (tests/test_layout.py
checks that every module does, but those of its `NOT_YET_DECLARED`), and the public methods and
properties each of their classes defines. This test lists them itself, not through the
generator, so that a generator that skipped one would not hide it:

- every module of `jaxdepth.analyses` defines `__all__`, and every
  name of an `__all__` exists (a function or class in it with a docstring of its own);
- every public name has an entry (a heading) in docs/reference.md;
- docs/reference.md is what `python docs/reference.py` writes now (not stale);
- every public function, class, method and property of `jaxdepth`, `jaxdepth.sites` and the
  analyses has a docstring of its own.

What the docs use is found in the docs themselves, so that a new example cannot outrun the
reference: every `jaxdepth` function, class and module that a Python block of README.md or
docs/*.md imports, or reaches through a module it imported, has an entry under that name; and a
name the prose writes out in full, where the reference documents its object, is one of the
reference's names for it (one home, not a second path to the same class).
"""

from __future__ import annotations

import ast
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

from test_docs import ROOT, blocks, pages, python_blocks, read

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


def analyses_modules() -> list:
    """Every module of `jaxdepth.analyses`, its subpackages and their modules included."""
    from jaxdepth import analyses

    return [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(analyses.__path__, prefix="jaxdepth.analyses.")
    ]


def _exported(module) -> dict:
    """The functions and classes of `module.__all__` (values, such as constants and `ANALYSIS`,
    have no entry)."""
    # a name it lacks is None here, and reported by test_every_analyses_module_declares_what_it_offers
    chosen = {name: getattr(module, name, None) for name in module.__all__}
    return {name: obj for name, obj in chosen.items() if inspect.isclass(obj) or inspect.isroutine(inspect.unwrap(obj))}


def declaring_modules() -> list:
    """Every module of `jaxdepth.core`, `jaxdepth.lab` and `conversion` (the packages too) that
    has an `__all__`, but `jaxdepth.core.sites` and `jaxdepth.core.structure` (the reference's
    `jaxdepth.sites` and `jaxdepth.structure`)."""
    found = []
    for name in ("jaxdepth.core", "jaxdepth.lab", "conversion"):
        package = importlib.import_module(name)
        found.append(package)
        found += [importlib.import_module(i.name) for i in pkgutil.walk_packages(package.__path__, prefix=f"{name}.")]
    skipped = ("jaxdepth.core.sites", "jaxdepth.core.structure")
    return [module for module in found if hasattr(module, "__all__") and module.__name__ not in skipped]


def documented_objects() -> dict:
    """`{name as a user writes it: object}` for every public function and class of `jaxdepth`,
    `jaxdepth.sites` and the analyses (and the module `jaxdepth.sites`)."""
    import jaxdepth
    from jaxdepth import sites

    found = {f"jaxdepth.{name}": getattr(jaxdepth, name) for name in jaxdepth.__all__}
    found.update({f"jaxdepth.sites.{name}": obj for name, obj in _exported(sites).items()})
    for module in analyses_modules():
        found.update({f"{module.__name__}.{name}": obj for name, obj in _exported(module).items()})
    return found


def public_objects() -> dict:
    """`documented_objects`, and the functions and classes of the `__all__` of every module of
    the core, the shell and the converters (`declaring_modules`): what the reference holds."""
    found = documented_objects()
    for module in declaring_modules():
        found.update({f"{module.__name__}.{name}": obj for name, obj in _exported(module).items()})
    return found


def test_every_analyses_module_declares_what_it_offers():
    """Each module of `jaxdepth.analyses` (recursively) and `jaxdepth.sites` defines `__all__`;
    every name in it exists, once, and each function and class in it has a docstring of its own."""
    from jaxdepth import sites

    modules = {module.__name__: module for module in [sites, *analyses_modules()]}
    problems = []
    for name, module in modules.items():
        if not hasattr(module, "__all__"):
            problems.append(f"{name} has no __all__")
            continue
        problems += [
            f"{name}.__all__ names {n!r} twice" for n in sorted(set(module.__all__)) if module.__all__.count(n) > 1
        ]
        problems += [f"{name}.__all__ names {n!r}, which it lacks" for n in module.__all__ if not hasattr(module, n)]
        problems += [
            f"{name}.{n} has no docstring" for n, obj in _exported(module).items() if not _generator().docstring(obj)
        ]
    assert not problems, "; ".join(problems)


def _members(cls) -> dict:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    kinds = (property, functools.cached_property, classmethod, staticmethod)
    return {
        name: value
        for name, value in vars(cls).items()
        if not name.startswith("_") and name not in fields and (isinstance(value, kinds) or inspect.isfunction(value))
    }


def _headings() -> set:
    """The names of the page's headings (one whose name differs from an earlier one's only in
    case says its kind after it: `jaxdepth.Metric` (class))."""
    return set(re.findall(r"^#{2,4} `([^`]+)`(?: \((?:class|function)\))?\s*$", read(PAGE), flags=re.M))


def test_every_public_name_has_an_entry():
    """A heading, or the line a name gets whose heading's anchor would be a module's."""
    headings, names = _headings(), _names_on_page()
    missing = []
    for name, obj in public_objects().items():
        if name not in names and not (inspect.ismodule(obj) and obj.__name__ in names):  # a module: its section
            missing.append(name)
        if inspect.isclass(obj):
            missing += [
                f"{name}.{member} (heading `{obj.__name__}.{member}`)"
                for member in _members(obj)
                if f"{obj.__name__}.{member}" not in headings
            ]
    assert not missing, f"{PAGE} has no entry for: {', '.join(missing)}; run `python docs/reference.py`"


def _named(dotted: str):
    """`(name, object)` for a dotted name as code writes it (`jaxdepth.load`, or a module's
    attribute chain such as `jaxdepth.analyses.edges.EdgeGraph.edge_name`): the modules, then
    the first attribute that is no module (the one a reference entry is for). None where it
    does not resolve."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for k in range(i, len(parts)):
            if not inspect.ismodule(obj):
                return ".".join(parts[:k]), obj
            obj = getattr(obj, parts[k], None)
            if obj is None:
                return None
        return dotted, obj
    return None


def _documentable(obj) -> bool:
    """A module, class or function: what has an entry (a constant has no docstring of its own)."""
    return inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(inspect.unwrap(obj))


def _chain(node: ast.Attribute):
    """`a.b.c` as `['a', 'b', 'c']`, or None where it does not start at a plain name."""
    names = []
    while isinstance(node, ast.Attribute):
        names.insert(0, node.attr)
        node = node.value
    return [node.id, *names] if isinstance(node, ast.Name) else None


def _used_in(codes: list[str]) -> set:
    """The dotted `jaxdepth` names that the blocks of one page (one namespace, in order) import
    or reach through a module they imported."""
    trees = [ast.parse(code) for code in codes]
    bound, used = {}, set()
    for node in (n for tree in trees for n in ast.walk(tree)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "jaxdepth":
                    bound[alias.asname or "jaxdepth"] = alias.name if alias.asname else "jaxdepth"
                    used.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jaxdepth":
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                used.add(f"{node.module}.{alias.name}")
    for tree in trees:
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            chain = _chain(node) if isinstance(node, ast.Attribute) and id(node) not in inner else None
            if chain and chain[0] in bound:
                used.add(".".join([bound[chain[0]], *chain[1:]]))
    return used


def example_names() -> dict:
    """`{name: page}` for every `jaxdepth` function, class and module that the Python blocks of
    README.md and docs/*.md use (`_used_in`), under the name they use it by."""
    found = {}
    for page in pages():
        for dotted in sorted(_used_in(python_blocks(page))):
            named = _named(dotted)
            if named is None:
                found.setdefault(dotted, page)  # no such name: reported as missing
            elif _documentable(named[1]):
                found.setdefault(named[0], page)
    return found


def _names_on_page() -> set:
    """The headings' names, and the names that get a line instead (their anchor would be a
    module's: "`jaxdepth.analyses.edges.Circuit` is the class [...")."""
    aliases = re.findall(r"^`([^`]+)` is the (?:class|function) \[", read(PAGE), flags=re.M)
    return _headings() | set(aliases)


def test_every_name_the_examples_use_has_an_entry():
    names = example_names()
    assert {"jaxdepth.load", "jaxdepth.lab.study.StudySettings", "jaxdepth.core.model.embed"} <= set(names)
    headings = _names_on_page()
    missing = [f"{name} ({page})" for name, page in names.items() if name not in headings]
    assert not missing, (
        f"{PAGE} has no entry for these names of the docs' examples: {', '.join(missing)}; "
        "name them in their module's __all__ and run docs/reference.py"
    )


def _prose(page: str) -> str:
    """The page without its fenced blocks."""
    lines, keep, fence = read(page).splitlines(), [], None
    for line in lines:
        opening = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence is None and opening:
            fence = opening.group(1)
        elif fence is not None and re.fullmatch(rf"\s*{re.escape(fence[0])}{{{len(fence)},}}\s*", line):
            fence = None
        elif fence is None:
            keep.append(line)
    return "\n".join(keep)


def test_names_the_prose_writes_out_are_the_references():
    documented = {}  # id(object) -> its names on the page
    for heading in _headings():
        named = _named(heading) if heading.startswith("jaxdepth") else None
        if named is not None and named[0] == heading:
            documented.setdefault(id(named[1]), []).append(heading)
    other = []
    for page in (p for p in pages() if p != PAGE):
        for span in re.findall(r"(`+)(.+?)\1", _prose(page), flags=re.S):
            for dotted in re.findall(r"\bjaxdepth(?:\.\w+)+", span[1]):
                named = _named(dotted)
                if named is None or inspect.ismodule(named[1]) or id(named[1]) not in documented:
                    continue
                if named[0] not in documented[id(named[1])]:
                    other.append(f"{page}: `{named[0]}` (the reference: {', '.join(documented[id(named[1])])})")
    assert not other, "the docs name documented objects by other paths than the reference: " + "; ".join(other)


def test_the_tap_record_is_documented_field_by_field():
    """A tap (`run_layers(..., tap=...)`) reads a `LayerRecord`: its entry names every field,
    the attention probabilities among them."""
    from jaxdepth.core.layer import LayerRecord

    assert "jaxdepth.core.layer.LayerRecord" in _headings()
    doc = _generator().docstring(LayerRecord)
    assert not [f.name for f in dataclasses.fields(LayerRecord) if f"`{f.name}`" not in doc]
    assert "attention probabilities `attn_probs`" in doc


def test_reference_is_up_to_date():
    expected, written = _generator().render(), read(PAGE)
    if expected != written:
        diff = list(
            difflib.unified_diff(written.splitlines(), expected.splitlines(), PAGE, "docstrings now", lineterm="", n=1)
        )
        pytest.fail(f"{PAGE} is stale: run `python docs/reference.py`. First differences:\n" + "\n".join(diff[:40]))


def test_every_public_function_and_class_has_a_docstring():
    """Everything the reference holds (every `__all__`'s functions and classes, and theirs)."""
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
