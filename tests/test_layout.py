"""The repository's imports point one way: the experiments over the shell (`jaxdepth.lab`) over
the analyses (`jaxdepth.analyses`) over the core (`jaxdepth.core`), and the converters
(`conversion/`) beside the analyses, on the core only; no cycles, and no module reaching for
another module's private names.

Every module under `jaxdepth/`, `conversion/` and `experiments/` is parsed (`ast`, nothing is
imported) and every import is collected, at module level or inside a function: `import a.b`,
`from a import b` (an edge to the submodule `a.b` when that is a module, else to `a`) and
relative imports. The experiments are scripts run with `experiments/` on the path, so
`experiments/benchmarking/case.py` is the module `benchmarking.case`. Then:

- no import cycle between modules (a strongly connected component of more than one module), nor
  between layers (core, analyses, lab, conversion, experiments; the facade aside);
- no arrow core -> analyses, core -> lab, analyses -> lab, nor from the core, the analyses or
  the shell to the package facade `jaxdepth/__init__.py` (which re-exports from every layer and
  is exempt from the layering rule as an importer; the experiments and users import it);
- `conversion/` imports the core only: not the analyses, the shell or the facade;
- nothing but the experiments imports the experiments;
- no module imports another module's private name (`_name`, not a dunder), or reads one as an
  attribute of a module it imported (`plots._helper`).
"""

from __future__ import annotations

import ast
import dataclasses
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxdepth", "conversion", "experiments")
SCRIPT_ROOTS = ("experiments",)  # folders whose files are imported relative to themselves
FACADE = "jaxdepth"
LAYERS = ("core", "analyses", "lab", "conversion", "experiments")
# (importer's layer, imported layer) pairs that point the wrong way
FORBIDDEN = {
    ("core", "analyses"),
    ("core", "lab"),
    ("analyses", "lab"),
    ("core", "facade"),
    ("analyses", "facade"),
    ("lab", "facade"),
    ("conversion", "analyses"),
    ("conversion", "lab"),
    ("conversion", "facade"),
}
FORBIDDEN |= {(importer, "experiments") for importer in LAYERS + ("facade",) if importer != "experiments"}


@dataclasses.dataclass(frozen=True)
class Edge:
    importer: str
    target: str
    line: int

    def where(self, files: dict) -> str:
        return f"{files[self.importer]}:{self.line}"


def module_name(path: str) -> tuple[str, bool]:
    """`jaxdepth/lab/cli.py` -> ("jaxdepth.lab.cli", False); `jaxdepth/lab/__init__.py` ->
    ("jaxdepth.lab", True); `experiments/benchmarking/case.py` -> ("benchmarking.case", False)."""
    parts = path[: -len(".py")].replace(os.sep, "/").split("/")
    if parts[0] in SCRIPT_ROOTS and len(parts) > 1:
        parts = parts[1:]
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def layer(module: str, path: str | None = None) -> str:
    """The layer of `module` (at `path`, when known): "facade", "core", "analyses", "lab",
    "experiments", or the first part of its name ("conversion", a top-level module)."""
    if path is not None and path.replace(os.sep, "/").split("/")[0] in SCRIPT_ROOTS:
        return "experiments"
    if module == FACADE:
        return "facade"
    for name in ("core", "analyses", "lab"):
        if module == f"jaxdepth.{name}" or module.startswith(f"jaxdepth.{name}."):
            return name
    return module.split(".")[0]  # "conversion", or a top-level module of the package


def _known(name: str, modules) -> str | None:
    """The longest prefix of the dotted `name` that is one of `modules` (None: outside them)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def analyse(files: dict[str, str]) -> tuple[list[Edge], list[str], dict[str, str]]:
    """`files`: repository-relative path -> source. Returns the edges between these modules, the
    private-name problems, and module name -> path."""
    paths, packages, trees = {}, {}, {}
    for path, source in files.items():
        name, package = module_name(path)
        paths[name], packages[name], trees[name] = path, package, ast.parse(source, filename=path)
    edges, private = [], []

    def flag(module, line, what, owner):
        if owner != module:
            private.append(f"{paths[module]}:{line}: {module} uses {what}, a private name of {owner}")

    for module, tree in trees.items():
        bound = {}  # local name -> a module of ours it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _known(alias.name, paths)
                    if target is None:
                        continue
                    edges.append(Edge(module, target, node.lineno))
                    private_part = next((p for p in alias.name.split(".") if is_private(p)), None)
                    if private_part:
                        flag(module, node.lineno, f"the module {alias.name}", alias.name)
                    if alias.asname:
                        bound[alias.asname] = target
                    else:
                        head = alias.name.split(".")[0]
                        if head in paths:
                            bound[head] = head
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, module, packages[module])
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    target = submodule if submodule in paths else _known(base, paths)
                    if target is not None:
                        edges.append(Edge(module, target, node.lineno))
                        if target == submodule:
                            bound[alias.asname or alias.name] = submodule
                    if is_private(alias.name) and alias.name != "*":
                        flag(module, node.lineno, f"{base}.{alias.name}", base)
        for node in ast.walk(tree):  # `plots._helper`, `jaxdepth.lab.plots._helper`
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                chain, value = [], node.value
                while isinstance(value, ast.Attribute):
                    chain.insert(0, value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in bound:
                    owner = ".".join([bound[value.id], *chain])
                    if owner in paths:
                        flag(module, node.lineno, f"{owner}.{node.attr}", owner)
    return edges, private, paths


def cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges) per strongly connected component of more than one module."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        if e.importer != e.target:
            graph.setdefault(e.importer, {}).setdefault(e.target, e)
            graph.setdefault(e.target, {})
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):  # Tarjan's algorithm (the graph is small: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:  # the shortest way from the smallest member back to itself
        start = min(component)
        paths = {start: []}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for v in frontier:
                for w, e in sorted(graph[v].items()):
                    if w == start:
                        cycle = paths[v] + [e]
                        break
                    if w in component and w not in paths:
                        paths[w] = paths[v] + [e]
                        nxt.append(w)
                if cycle:
                    break
            frontier = nxt
        found.append(cycle)
    return found


def layer_edges(edges: list[Edge], paths: dict[str, str]) -> list[Edge]:
    """The module edges as edges between layers (one per pair, the first seen; the facade aside,
    since it re-exports every layer by design), for the cycle check between layers."""
    found = {}
    for e in edges:
        pair = (layer(e.importer, paths[e.importer]), layer(e.target, paths[e.target]))
        if pair[0] != pair[1] and "facade" not in pair:
            found.setdefault(pair, Edge(pair[0], pair[1], e.line))
    return list(found.values())


def problems(files: dict[str, str]) -> list[str]:
    """Every breach of the rules above, each a sentence naming the files and lines."""
    edges, found, paths = analyse(files)
    for cycle in cycles(edges):
        chain = " -> ".join([cycle[0].importer] + [e.target for e in cycle])
        found.append(f"import cycle {chain} ({'; '.join(e.where(paths) for e in cycle)})")
    for cycle in cycles(layer_edges(edges, paths)):
        found.append(f"import cycle between layers {' -> '.join([cycle[0].importer] + [e.target for e in cycle])}")
    for e in edges:
        pair = (layer(e.importer, paths[e.importer]), layer(e.target, paths[e.target]))
        if pair in FORBIDDEN:
            found.append(f"{e.where(paths)}: {e.importer} imports {e.target}: {pair[0]} must not import {pair[1]}")
    return found


def package_files() -> dict[str, str]:
    files = {}
    for package in PACKAGES:
        for folder, dirs, names in os.walk(os.path.join(REPO, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as f:
                        files[os.path.relpath(path, REPO)] = f.read()
    return files


def test_imports_point_one_way_without_cycles_or_private_names():
    files = package_files()
    for path in (
        "jaxdepth/lab/cli.py",
        "jaxdepth/core/model.py",
        "conversion/hf.py",
        "experiments/benchmark.py",
        "experiments/benchmarking/case.py",
    ):
        assert path in files
    found = problems(files)
    assert not found, "\n".join(found)


def test_the_checker_reports_cycles_wrong_way_arrows_and_private_names():
    files = {
        "jaxdepth/__init__.py": "from jaxdepth.lab.cli import main\nfrom jaxdepth.core import a\n",
        "jaxdepth/core/__init__.py": "",
        "jaxdepth/core/a.py": "def f():\n    from jaxdepth.lab import cli\n",  # inside a function: counts
        "jaxdepth/core/b.py": "from . import a\n_hidden = 1\n",
        "jaxdepth/analyses/__init__.py": "",
        "jaxdepth/analyses/x.py": "import jaxdepth.core.b as b\nfrom jaxdepth.core.b import _hidden\nb._hidden\n",
        "jaxdepth/lab/__init__.py": "",
        "jaxdepth/lab/cli.py": "from jaxdepth.core import a\n",
        "conversion/__init__.py": "",
        "conversion/c.py": "from jaxdepth.core import b\nfrom jaxdepth.lab import cli\n",
        "jaxdepth/lab/loaded_model.py": "from ..analyses import x\nimport conversion.c\n",
        "experiments/run.py": "import jaxdepth\nfrom benchmarking import case\n",
        "experiments/benchmarking/__init__.py": "",
        "experiments/benchmarking/case.py": "from jaxdepth.lab import cli\n",
        "jaxdepth/analyses/y.py": "from benchmarking.case import Bench\n",
    }
    found = problems(files)
    text = "\n".join(found)
    assert "import cycle jaxdepth.core.a -> jaxdepth.lab.cli -> jaxdepth.core.a" in text, text
    assert "jaxdepth/core/a.py:2: jaxdepth.core.a imports jaxdepth.lab.cli: core must not import lab" in text, text
    assert "jaxdepth/analyses/x.py:2: jaxdepth.analyses.x uses jaxdepth.core.b._hidden" in text, text
    assert "jaxdepth/analyses/x.py:3: jaxdepth.analyses.x uses jaxdepth.core.b._hidden" in text, text
    assert "conversion/c.py:2: conversion.c imports jaxdepth.lab.cli: conversion must not import lab" in text, text
    assert (
        "jaxdepth/analyses/y.py:1: jaxdepth.analyses.y imports benchmarking.case: analyses must not import experiments"
    ) in text, text
    # the wrong-way arrows join every layer into one cycle of layers, reported once (its shortest loop)
    assert [p for p in found if p.startswith("import cycle between layers")] == [
        "import cycle between layers analyses -> core -> lab -> analyses"
    ], text
    # the facade may import every layer and the experiments may import anything of the package:
    # relative imports, the facade's and the experiments' imports are edges, not errors
    assert len(found) == 7, text
    edges, _, _ = analyse(files)
    assert Edge("jaxdepth.lab.loaded_model", "jaxdepth.analyses.x", 1) in edges
    assert Edge("jaxdepth.core.b", "jaxdepth.core.a", 1) in edges
    assert Edge("run", "benchmarking.case", 2) in edges


def test_a_cycle_of_layers_without_a_cycle_of_modules_is_reported():
    # lab.sources -> conversion.hf -> lab.loaded_model: no module is on a cycle, but the two layers are
    files = {
        "jaxdepth/__init__.py": "",
        "jaxdepth/lab/__init__.py": "",
        "conversion/__init__.py": "",
        "jaxdepth/lab/sources.py": "from conversion.hf import convert\n",
        "conversion/hf.py": "from jaxdepth.lab.loaded_model import Model\n",
        "jaxdepth/lab/loaded_model.py": "",
    }
    assert problems(files) == [
        "import cycle between layers conversion -> lab -> conversion",
        "conversion/hf.py:1: conversion.hf imports jaxdepth.lab.loaded_model: conversion must not import lab",
    ]


MAX_POSITIONAL = 8  # what a function takes beyond that is an option: keyword-only


# The layer body and the per-layer weights are read only where the layers are looped over: every
# other module runs the layers through `jaxdepth.core.loops`.
LAYER_BODY = ("layer_step", "layer_params")
LOOP_HOMES = ("jaxdepth/core/layer.py", "jaxdepth/core/loops.py")
LOOPS = ("scan", "fori_loop", "while_loop", "map", "associative_scan")


def layer_loops_outside_the_loop_module(files: dict[str, str]) -> list[str]:
    """Every use of the layer body (`LAYER_BODY`) outside `LOOP_HOMES`, and every `jax.lax` loop
    outside them whose arguments mention the number of layers or the stacked layer weights, as
    'path:line what'."""
    found = []
    for path, source in sorted(files.items()):
        if path.replace(os.sep, "/") in LOOP_HOMES:
            continue
        for node in ast.walk(ast.parse(source, path)):
            name = (
                node.id
                if isinstance(node, ast.Name)
                else node.attr
                if isinstance(node, ast.Attribute)
                else node.name
                if isinstance(node, ast.alias)
                else None
            )
            if name in LAYER_BODY:
                found.append(f"{path}:{node.lineno} {name}")
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                arguments = " ".join(ast.unparse(a) for a in [*node.args, *(k.value for k in node.keywords)])
                if func in LOOPS and ("num_layers" in arguments or "['layers']" in arguments):
                    found.append(f"{path}:{node.lineno} a {func} over the layers")
    return sorted(found, key=lambda line: (line.split(":")[0], int(line.split(":")[1].split()[0])))


def test_the_layers_are_looped_over_in_the_loop_module_only():
    files = {path: source for path, source in package_files().items() if path.startswith("jaxdepth")}
    assert "jaxdepth/core/loops.py" in files
    assert layer_loops_outside_the_loop_module(files) == []
    synthetic = {
        "jaxdepth/analyses/mine.py": "from jaxdepth.core.layer import layer_step\n"
        "def f(params, h, config):\n"
        "    return jax.lax.fori_loop(0, config.num_layers, lambda i, h: h, h)\n"
        "def g(params, h):\n"
        "    return jax.lax.scan(lambda h, p: (h, None), h, params['layers'])\n",
        "jaxdepth/core/loops.py": "def run(h, config):\n    return jax.lax.fori_loop(0, config.num_layers, f, h)\n",
    }
    assert layer_loops_outside_the_loop_module(synthetic) == [
        "jaxdepth/analyses/mine.py:1 layer_step",
        "jaxdepth/analyses/mine.py:3 a fori_loop over the layers",
        "jaxdepth/analyses/mine.py:5 a scan over the layers",
    ]


def long_signatures(files: dict[str, str]) -> list[str]:
    """Functions with more than `MAX_POSITIONAL` positional parameters (self and cls not counted),
    as 'path:line name(n)'."""
    found = []
    for path, source in sorted(files.items()):
        for node in ast.walk(ast.parse(source, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                if len(names) > MAX_POSITIONAL:
                    found.append(f"{path}:{node.lineno} {node.name}({len(names)})")
    return found


def test_no_function_takes_more_than_eight_positional_parameters():
    files = {path: source for path, source in package_files().items() if path.startswith("jaxdepth")}
    assert long_signatures(files) == []
    # the check sees what it should: nine positional parameters, or eight plus options, in a method
    synthetic = {
        "m.py": "def f(a, b, c, d, e, f, g, h, i): pass\n"
        "class C:\n    def g(self, a, b, c, d, e, f, g, h, *, i=1): pass\n"
    }
    assert long_signatures(synthetic) == ["m.py:1 f(9)"]


# Integrated gradients (the engine, its paths and rules, the studies' IG, edge attribution): what
# varies together travels as one value (a rule, an Execution, an Objective), so no function of
# theirs takes more than this many parameters, keyword-only ones counted.
MAX_IG_PARAMETERS = 10
IG_MODULES = ("jaxdepth/analyses/ig/", "jaxdepth/analyses/integrated_gradients.py", "jaxdepth/analyses/edges/scores.py")


def many_parameters(files: dict[str, str], limit: int) -> list[str]:
    """Functions with more than `limit` parameters of any kind (self and cls not counted), as
    'path:line name(n)'."""
    found = []
    for path, source in sorted(files.items()):
        for node in ast.walk(ast.parse(source, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs if p.arg not in ("self", "cls")]
                n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                if n > limit:
                    found.append(f"{path}:{node.lineno} {node.name}({n})")
    return found


def test_no_integrated_gradients_function_takes_more_than_ten_parameters():
    files = {path: source for path, source in package_files().items() if path.startswith(IG_MODULES)}
    assert "jaxdepth/analyses/ig/engine.py" in files and "jaxdepth/analyses/edges/scores.py" in files
    assert many_parameters(files, MAX_IG_PARAMETERS) == []
    synthetic = {"m.py": "def f(a, b, *, c, d=1, **e): pass\nclass C:\n    def g(self, a, *b): pass\n"}
    assert many_parameters(synthetic, 4) == ["m.py:1 f(5)"]


# What each import may bring in, checked in a fresh interpreter: importing the core or the
# converters loads nothing of the analyses or the shell (the package's top level loads its names
# on first use), and every name the top level offers is there.
LOADS_NOTHING_ABOVE = ("jaxdepth.core", "jaxdepth.core.model", "jaxdepth.core.loops", "conversion", "conversion.hf")


def test_importing_the_core_or_the_converters_loads_nothing_above_them():
    import subprocess
    import sys

    script = (
        "import importlib, sys\n"
        f"for name in {LOADS_NOTHING_ABOVE!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('jaxdepth.analyses', 'jaxdepth.lab'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_every_name_of_the_top_level_is_where_it_says():
    import jaxdepth

    assert set(jaxdepth.__all__) == set(jaxdepth._WHERE)
    for name in jaxdepth.__all__:
        assert getattr(jaxdepth, name) is not None, name
    assert set(jaxdepth.__all__) <= set(dir(jaxdepth))
    try:
        jaxdepth.no_such_name
    except AttributeError as error:
        assert "no attribute 'no_such_name'" in str(error)
    else:
        raise AssertionError("an unknown name must be an AttributeError")


# ----------------------------------------------------------------------------- public surface

# Every module of `jaxdepth/` and `conversion/` names its public names in `__all__`: each public
# (no leading underscore) function and class it defines at the top level is listed, and every
# listed name exists. A public name that is not meant for users stays public and is listed (its
# module's docstring or its own says what it serves) or gets a leading underscore. The API
# reference (`docs/reference.py`) documents exactly these lists.
#
# To be emptied: the modules that do not yet follow the rule, each leaving the set when its
# `__all__` is written or completed (the test below fails for a module listed here that follows
# the rule already).
NOT_YET_DECLARED: frozenset = frozenset()  # every module declares its public names
DECLARING = ("jaxdepth", "conversion")  # the packages whose every module has an `__all__`


def declared_names(tree: ast.Module):
    """The names of a module's `__all__` (a list or tuple of strings at the top level), or None
    where it has none."""
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return [ast.literal_eval(element) for element in node.value.elts]
    return None


def public_definitions(tree: ast.Module) -> list[str]:
    """The public functions and classes a module defines at its top level."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return [node.name for node in tree.body if isinstance(node, kinds) and not node.name.startswith("_")]


def undeclared(files: dict[str, str]) -> dict[str, str]:
    """`{module: what its `__all__` lacks}` for every module of `files` that breaks the rule."""
    found = {}
    for path, source in files.items():
        module, _ = module_name(path)
        tree = ast.parse(source, filename=path)
        names = declared_names(tree)
        if names is None:
            found[module] = "no __all__"
            continue
        missing = [name for name in public_definitions(tree) if name not in names]
        if missing:
            found[module] = "its __all__ leaves out " + ", ".join(missing)
    return found


def declaring_files() -> dict[str, str]:
    return {path: source for path, source in package_files().items() if path.split(os.sep)[0] in DECLARING}


def test_every_module_declares_its_public_names():
    found = undeclared(declaring_files())
    problems = [f"{module}: {what}" for module, what in sorted(found.items()) if module not in NOT_YET_DECLARED]
    assert not problems, "modules whose __all__ is missing or incomplete: " + "; ".join(problems)
    done = sorted(NOT_YET_DECLARED - set(found))
    assert not done, f"these modules declare their public names now: remove them from NOT_YET_DECLARED: {done}"


def test_every_declared_name_exists():
    """Each name of each `__all__` is an attribute of its module (imported: a package's names may
    come from its modules, the top level's on first use), once."""
    import importlib

    problems = []
    for path, source in declaring_files().items():
        names = declared_names(ast.parse(source))
        if names is None:
            continue
        module = importlib.import_module(module_name(path)[0])
        problems += [f"{module.__name__}.__all__ names {n!r}, which it lacks" for n in names if not hasattr(module, n)]
        problems += [f"{module.__name__}.__all__ names {n!r} twice" for n in sorted(set(names)) if names.count(n) > 1]
    assert not problems, "; ".join(problems)


def test_the_declaration_check_reports_what_is_left_out():
    files = {
        "jaxdepth/core/a.py": "__all__ = ['f']\ndef f(): pass\ndef g(): pass\nclass _H: pass\n",
        "jaxdepth/core/b.py": "def f(): pass\n",
        "jaxdepth/core/c.py": "import os\n__all__ = ['f', 'path']\nfrom os import path\ndef f(): pass\n",
    }
    assert undeclared(files) == {"jaxdepth.core.a": "its __all__ leaves out g", "jaxdepth.core.b": "no __all__"}
