"""Write docs/reference.md, the API reference, from the docstrings: `python docs/reference.py`.

The reference holds what the `__all__`s name, nothing chosen by hand: the public names of
`jaxdepth`, of `jaxdepth.sites` and `jaxdepth.structure`, of each module of `jaxdepth.analyses`
(its subpackages' modules too), then of each module of `jaxdepth.core`, `jaxdepth.lab` and
`conversion`: the functions and classes of each one's `__all__`, in that order, its other values
(constants, an analysis's `ANALYSIS`) named in one line. A module that has no `__all__` yet
(`NOT_YET_DECLARED` in tests/test_layout.py) stands in with what the rule says its `__all__`
will name: the public functions and classes it defines (`declared`). A name whose object has a
full entry elsewhere gets a link to it instead of a second copy. Each has its signature (a
dataclass its fields, a class its constructor and its own public methods and properties) and
its docstring, rendered as Markdown. Signatures are written in ```` ```text ```` fences, so that
no test runs them; a docstring's indented blocks become ```` ```text ```` fences too.

`tests/test_reference.py` renders the page in memory and fails when docs/reference.md differs:
rerun this script after changing a signature or a docstring. Nothing here loads a model.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
import re
import sys
import textwrap
from types import ModuleType
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "reference.md")
WIDTH = 100  # signatures longer than this wrap

if ROOT not in sys.path:  # `python docs/reference.py` from a checkout that is not installed
    sys.path.insert(0, ROOT)


# The packages whose modules follow the analyses' on the page, each module under its own name.
PACKAGES = ("jaxdepth.core", "jaxdepth.lab", "conversion")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One public name: `name` as a user writes it, the object, and, where the same object has
    a full entry elsewhere on the page, that entry's name."""

    name: str
    obj: Any
    same_as: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Section:
    """A module's part of the page: its public name, the module and its entries; `aliases`,
    names linking to a full entry that get a line rather than a heading, whose anchor would be
    a module's (`jaxdepth.analyses.edges.Circuit`, `jaxdepth.analyses.edges.circuit`); `values`,
    the other names of its `__all__` (constants, declarations), named in one line."""

    name: str
    module: ModuleType
    entries: tuple
    aliases: tuple = ()
    values: tuple = ()


# ----------------------------------------------------------------------------- what is public


def _documentable(obj: Any) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(inspect.unwrap(obj))


def declared(module: ModuleType) -> list[str]:
    """`module.__all__`: the reference documents what the modules declare, and only that
    (every module has one: tests/test_layout.py)."""
    if not hasattr(module, "__all__"):
        raise SystemExit(f"{module.__name__} declares no __all__: name its public names there")
    return list(module.__all__)


def _public(module: ModuleType) -> list[tuple[str, Any]]:
    """The functions and classes of the module's `declared` names, in their order (a package's
    names brought from its modules too, as `jaxdepth.analyses.edges.find_circuit`)."""
    return [(name, getattr(module, name)) for name in declared(module) if _documentable(getattr(module, name))]


def values(module: ModuleType) -> list[str]:
    """The `declared` names of `module` that are neither functions, classes nor modules:
    constants and declarations (`ANALYSIS`), which have no docstring of their own to show."""
    return [
        name
        for name in declared(module)
        if not (_documentable(getattr(module, name)) or inspect.ismodule(getattr(module, name)))
    ]


def analyses_modules() -> list[ModuleType]:
    """Every module of `jaxdepth.analyses`, subpackages' modules included, by name."""
    package = importlib.import_module("jaxdepth.analyses")
    return [
        importlib.import_module(info.name)
        for info in sorted(
            pkgutil.walk_packages(package.__path__, prefix="jaxdepth.analyses."), key=lambda info: info.name
        )
    ]


def package_modules() -> list[ModuleType]:
    """Every module of `PACKAGES`, each package first, then its modules (subpackages' too), by
    name."""
    found = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        found.append(package)
        found += [
            importlib.import_module(info.name)
            for info in sorted(pkgutil.walk_packages(package.__path__, prefix=f"{name}."), key=lambda info: info.name)
        ]
    return found


def _homes(named: list[tuple[str, ModuleType, list[tuple[str, Any]]]]) -> dict[int, str]:
    """`{id(object): the name of its full entry}`, from `(section, module, [(name, object)])` in
    page order: its name at the top level of `jaxdepth`, else in the module that defines it,
    else where the page first names it."""

    def rank(section: str, module: ModuleType, obj: Any) -> int:
        return 0 if section == "jaxdepth" else 1 if module.__name__ == getattr(obj, "__module__", None) else 2

    names = [(section, module, name, obj) for section, module, members in named for name, obj in members]
    candidates = sorted(
        (rank(section, module, obj), position, id(obj), f"{section}.{name}")
        for position, (section, module, name, obj) in enumerate(names)
    )
    homes = {}
    for _, _, key, name in candidates:
        homes.setdefault(key, name)
    return homes


def sections() -> list[Section]:
    """The page's sections, in order: `jaxdepth`, `jaxdepth.sites`, `jaxdepth.structure`, each
    analyses module, then each module of `PACKAGES` (but those two, and any that names nothing).
    An object has one full entry (`_homes`); its other names link to it."""
    import jaxdepth
    from jaxdepth import sites, structure

    top = [
        (name, getattr(jaxdepth, name)) for name in jaxdepth.__all__ if not inspect.ismodule(getattr(jaxdepth, name))
    ]
    named = [
        ("jaxdepth", jaxdepth, top),
        ("jaxdepth.sites", sites, _public(sites)),
        ("jaxdepth.structure", structure, _public(structure)),
    ]
    named += [(m.__name__, m, _public(m)) for m in analyses_modules()]
    named += [
        (m.__name__, m, _public(m))
        for m in package_modules()
        if m not in (sites, structure) and declared(m)  # sites and structure have their sections above
    ]
    homes = _homes(named)

    module_anchors = {anchor(section) for section, _, _ in named}

    def section(name: str, module: ModuleType, members: list[tuple[str, Any]]) -> Section:
        entries = [Entry(f"{name}.{member}", obj, homes[id(obj)]) for member, obj in members]
        entries = [Entry(e.name, e.obj) if e.same_as == e.name else e for e in entries]
        aliases = [e for e in entries if e.same_as is not None and anchor(e.name) in module_anchors]
        return Section(
            name, module, tuple(e for e in entries if e not in aliases), tuple(aliases), tuple(values(module))
        )

    return [section(name, module, members) for name, module, members in named]


def members(cls: type) -> list[tuple[str, Any]]:
    """The public methods and properties `cls` itself defines (not its fields, not inherited)."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    found = []
    for name, value in vars(cls).items():
        if name.startswith("_") or name in fields:
            continue
        if isinstance(value, (property, functools.cached_property, classmethod, staticmethod)) or inspect.isfunction(
            value
        ):
            found.append((name, value))
    return found


def public_names() -> dict[str, Any]:
    """Every name the reference must hold, each with its object (a section's name with its
    module), the members of classes as `Class.member` after their class."""
    names = {}
    for section in sections():
        names[section.name] = section.module
        for entry in section.entries:
            names[entry.name] = entry.obj
            if inspect.isclass(entry.obj) and entry.same_as is None:
                for member, value in members(entry.obj):
                    names[f"{entry.name}.{member}"] = value
    return names


def docstring(obj: Any) -> str:
    """The object's own docstring, cleaned; '' where it has none (a dataclass's generated
    `Name(field, ...)` text and a docstring inherited from a base class count as none). A
    property's is its own (`property(fget, doc=...)`'s, else its getter's)."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    doc = getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return ""
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
            return ""
        if any(doc == getattr(base, "__doc__", None) for base in obj.__mro__[1:]):
            return ""
    return inspect.cleandoc(doc)


# ----------------------------------------------------------------------------- signatures


class _Text:
    """Renders as its text: string annotations (`from __future__ import annotations`) and
    defaults written as code, not as their repr."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _public_path(obj: Any) -> str:
    """The shortest import path that reaches a class or function (`flax.nnx.Module`, not
    `flax.nnx.module.Module`)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", repr(obj))
    if module in (None, "builtins"):
        return qualname
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        try:
            candidate = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        found = candidate
        for attribute in qualname.split("."):
            found = getattr(found, attribute, None)
        if found is obj:
            return f"{'.'.join(parts[:i])}.{qualname}"
    return f"{module}.{qualname}"


def _default(value: Any) -> _Text:
    if inspect.isclass(value) or inspect.isroutine(value):
        return _Text(
            value.__qualname__ if getattr(value, "__module__", "").startswith("jaxdepth") else _public_path(value)
        )
    if dataclasses.is_dataclass(value) and not inspect.isclass(value):
        try:
            if value == type(value)():
                return _Text(f"{type(value).__name__}()")
        except TypeError:
            pass
    text = repr(value)
    if re.search(r" at 0x[0-9a-fA-F]+", text):  # an address differs from run to run
        text = type(value).__name__ + "(...)"
    return _Text(text)


def _annotation(annotation: Any) -> Any:
    if annotation is inspect.Parameter.empty:
        return annotation
    if isinstance(annotation, str):  # a quoted forward reference ('Model') reads as the name
        return _Text(re.sub(r"^(['\"])(.*)\1$", r"\2", annotation))
    return _Text(inspect.formatannotation(annotation))


def _parameters(signature: inspect.Signature) -> tuple[list[str], str]:
    """Each parameter as written (with the `/` and `*` markers), and the return annotation."""
    parts, star = [], False
    params = list(signature.parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        p = p.replace(
            annotation=_annotation(p.annotation), default=p.default if p.default is p.empty else _default(p.default)
        )
        parts.append(str(p))
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    ret = signature.return_annotation
    returns = "" if ret is signature.empty else f" -> {_annotation(ret)!r}"
    return parts, returns


def format_call(name: str, signature: inspect.Signature, prefix: str = "") -> str:
    """`prefix name(params) -> ret`, wrapped at `WIDTH` with continuation lines indented 4."""
    parts, returns = _parameters(signature)
    one_line = f"{prefix}{name}({', '.join(parts)}){returns}"
    if len(one_line) <= WIDTH:
        return one_line
    lines, line = [], f"{prefix}{name}("
    for i, part in enumerate(parts):
        piece = part + (", " if i + 1 < len(parts) else f"){returns}")
        if len(line) + len(piece.rstrip()) > WIDTH and line.strip():
            lines.append(line.rstrip())
            line = "    "
        line += piece
    return "\n".join(lines + [line.rstrip()])


def _signature(obj: Callable, *, drop_first: bool = False) -> Optional[inspect.Signature]:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if drop_first:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    return signature


def _bases(cls: type) -> str:
    bases = [b for b in cls.__bases__ if b is not object]
    return (
        ""
        if not bases
        else "(" + ", ".join(b.__name__ if b.__module__ == cls.__module__ else _public_path(b) for b in bases) + ")"
    )


def class_signature(cls: type) -> str:
    """A dataclass as its decorator and fields; another class as its header and constructor."""
    if dataclasses.is_dataclass(cls):
        params = cls.__dataclass_params__
        fields = dataclasses.fields(cls)
        flags = [f"{flag}=True" for flag in ("frozen", "order") if getattr(params, flag)]
        if fields and all(f.kw_only is True for f in fields):
            flags.append("kw_only=True")
        lines = [f"@dataclass({', '.join(flags)})" if flags else "@dataclass", f"class {cls.__name__}{_bases(cls)}:"]
        for f in fields:
            line = f"    {f.name}: {_annotation(f.type)!r}"
            if f.default is not dataclasses.MISSING:
                line += f" = {_default(f.default)!r}"
            elif f.default_factory is not dataclasses.MISSING:
                line += f" = field(default_factory={_default(f.default_factory)!r})"
            lines.append(line)
        return "\n".join(lines)
    header = f"class {cls.__name__}{_bases(cls)}"
    init = next((vars(c)["__init__"] for c in cls.__mro__ if "__init__" in vars(c)), None)
    if init is None or not inspect.isfunction(init):
        return header
    signature = _signature(init, drop_first=True)
    return header if signature is None else header + "\n" + format_call(cls.__name__, signature)


def member_signature(owner: str, name: str, value: Any) -> str:
    if isinstance(value, (property, functools.cached_property)):
        fget = value.fget if isinstance(value, property) else value.func
        signature = _signature(fget)  # None for a getter such as operator.attrgetter
        ret = inspect.Signature.empty if signature is None else signature.return_annotation
        kind = "property" if isinstance(value, property) else "cached property"
        return f"{kind} {owner}.{name}" + ("" if ret is inspect.Signature.empty else f" -> {_annotation(ret)!r}")
    if isinstance(value, staticmethod):
        return format_call(f"{owner}.{name}", _signature(value.__func__), "staticmethod ")
    if isinstance(value, classmethod):
        return format_call(f"{owner}.{name}", _signature(value.__func__, drop_first=True), "classmethod ")
    return format_call(f"{owner}.{name}", _signature(value, drop_first=True))


def jit_note(obj: Any) -> str:
    """What a user of a jitted function must know: that it is jitted, and its static arguments."""
    options = vars(obj).get("_jit_kwargs") if hasattr(obj, "__dict__") else None
    if options is None:
        return ""
    static = options.get("static_argnames", ())
    static = (static,) if isinstance(static, str) else tuple(static)
    names = ", ".join(f"`{name}`" for name in static)
    return "Jitted (`jaxdepth.core.compilation.jit`)" + (
        f"; static arguments (a new value compiles anew): {names}." if static else "."
    )


# ----------------------------------------------------------------------------- docstrings as Markdown


def anchor(heading: str) -> str:
    """The anchor GitHub and mkdocs both give a heading made of one code span of a dotted name
    (and, for a name that differs from an earlier one only in case, its kind: `titles`)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading.lower()).strip())


def titles(sections: list[Section]) -> dict[str, str]:
    """`{entry name: its heading's text}`: the name as a code span, and, where its anchor would be
    an earlier entry's (`jaxdepth.Metric` after `jaxdepth.metric`: anchors ignore case), its kind
    after it, so that every heading has an anchor of its own."""
    found, taken = {}, set()
    for entry in (e for section in sections for e in section.entries):
        text = f"`{entry.name}`"
        if anchor(text) in taken:
            text += " (class)" if inspect.isclass(entry.obj) else " (function)"
        found[entry.name] = text
        taken.add(anchor(text))
    return found


def _escape_text(text: str) -> str:
    """Plain docstring text (outside code spans) made safe for Markdown: no HTML tag, link,
    emphasis or hard break where the docstring means its characters."""
    text = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", text)
    text = text.replace("](", "]\\(")
    text = re.sub(r"\*", r"\\*", text)
    text = re.sub(r"(?<![^\W_])_|_(?![^\W_])", r"\\_", text)
    return text


def _escape_line_starts(line: str) -> str:
    """A line that Markdown would read as a heading, a quote, a list item or a numbered item,
    escaped (a docstring's own `- ` items are kept)."""
    indent, stripped = line[: len(line) - len(line.lstrip())], line.lstrip()
    if stripped[:1] in ("#", ">", "+"):
        return f"{indent}\\{stripped}"
    number = re.match(r"(\d+)([.)])(\s|$)", stripped)
    if number:
        return f"{indent}{number.group(1)}\\{stripped[len(number.group(1)) :]}"
    return line


LIST_ITEM = r"(?:[-*+]|\d+[.)])\s"  # a docstring's own list marker


def _paragraph(lines: list[str]) -> str:
    """A paragraph of a docstring as Markdown. Lines with a hanging indent (an unindented line,
    then its indented continuation lines, as in `name: what it is`) become list items when the
    paragraph has several of them, so that they do not run together; items that the docstring
    marks itself (`- `, `1. `) keep their markers."""
    starts = [i for i, line in enumerate(lines) if not line.startswith(" ")]
    markers = []  # kept out of the escaping below as placeholders

    def marker(text: str) -> str:
        markers.append(text)
        return f"\0{len(markers) - 1}\0"

    if len(starts) > 1 and any(line.startswith(" ") for line in lines):
        out, indent = [], "  "
        for i, line in enumerate(lines):
            if i in starts:
                own = re.match(LIST_ITEM, line)
                indent = " " * (own.end() if own else 2)
                out.append(marker(own.group(0) if own else "- ") + line[own.end() if own else 0 :].strip())
            else:
                out.append(marker(indent) + line.strip())
        lines = out
    else:
        lines = [line.strip() for line in lines]
    pieces = re.split(r"(`+)(.+?)\1", "\n".join(lines), flags=re.S)
    out = []
    for k in range(0, len(pieces), 3):  # re.split with two groups: text, ticks, code, text, ...
        out.append(_escape_text(pieces[k]))
        if k + 2 < len(pieces):
            out.append(f"{pieces[k + 1]}{pieces[k + 2]}{pieces[k + 1]}")
    text = "\n".join(_escape_line_starts(line) for line in "".join(out).split("\n"))
    return re.sub(r"\0(\d+)\0", lambda m: markers[int(m.group(1))], text)


def markdown(doc: str) -> str:
    """A cleaned docstring as Markdown: paragraphs as text (code spans kept), blocks indented
    under a blank line as ```text fences, a title over a line of dashes as a bold line."""
    if re.search(r"^\s*(```|~~~)", doc, flags=re.M):
        raise ValueError("a docstring with a fenced block: write the block indented instead")
    lines, out, i = doc.split("\n"), [], 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        if lines[i].startswith("    "):  # an indented block after a blank line: verbatim
            block = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out.append("```text\n" + textwrap.dedent("\n".join(block)) + "\n```")
            continue
        para = []
        while i < len(lines) and lines[i].strip():
            if para and re.fullmatch(r"\s*(-{3,}|={3,})\s*", lines[i]):  # a setext underline: a title
                if para[:-1]:
                    out.append(_paragraph(para[:-1]))
                out.append("**" + _escape_text(para[-1].strip()) + "**")
                para = []
            else:
                para.append(lines[i])
            i += 1
        if para:
            if i < len(lines) - 1 and lines[i + 1].startswith("    ") and para[-1].endswith("::"):
                para[-1] = para[-1][:-1]  # reST's "Example::" before its literal block
            out.append(_paragraph(para))
    return "\n\n".join(out)


# ----------------------------------------------------------------------------- the page

INTRO = """\
# API reference

Every public name of `jaxdepth`, of `jaxdepth.sites` and `jaxdepth.structure`, of each module of
`jaxdepth.analyses`, then of each module of `jaxdepth.core`, `jaxdepth.lab` and `conversion`: what
each one's `__all__` names (a name outside it is internal and may change), each with its
signature and docstring (a name that is another's, such as `jaxdepth.core.model.forward`, links
to that entry). The page is generated from the docstrings by `python docs/reference.py`, and
`tests/test_reference.py` fails when it is out of date; edit the docstrings, not this page.
Shapes use the axis names of the glossary in `jaxdepth.core.model` (B batch, L layers, T
positions, D residual width, H heads, Dh head width, F MLP width, V vocabulary; L+1 residual
boundaries h_0..h_L). The [Python API](api.md) page shows how the pieces fit together, with
examples."""


def _heading(level: int, name: str, title: Optional[str] = None) -> str:
    return f"{'#' * level} {title or f'`{name}`'}"


def _described(obj: Any, name: str) -> str:
    """The docstring of `obj` (called `name` on the page) as Markdown."""
    doc = docstring(obj)
    if not doc:
        return "*No docstring.*"
    try:
        return markdown(doc)
    except ValueError as e:
        raise ValueError(f"the docstring of {name}: {e}") from None


def _entry(entry: Entry, top: bool, where: str = "above", heads: Optional[dict] = None) -> list[str]:
    """The entry's heading and text; `where` the full entry is, for a name that links to it;
    `heads`, the headings' texts (`titles`)."""
    heads = heads or {}
    obj, short = entry.obj, entry.name.rsplit(".", 1)[1]
    out = [_heading(3, entry.name, heads.get(entry.name))]
    if entry.same_as is not None:
        kind = "class" if inspect.isclass(obj) else "function"
        target = anchor(heads.get(entry.same_as, entry.same_as))
        return out + [f"The same {kind} as [`{entry.same_as}`](#{target}) {where}."]
    if inspect.isclass(obj):
        out.append("```text\n" + class_signature(obj) + "\n```")
    else:
        signature = _signature(obj)
        out.append("```text\n" + (format_call(short, signature) if signature else short) + "\n```")
    notes = []
    if top:
        notes.append(f"Defined in `{obj.__module__}`.")
    if jit_note(obj):
        notes.append(jit_note(obj))
    if notes:
        out.append(" ".join(notes))
    out.append(_described(obj, entry.name))
    if inspect.isclass(obj):
        for name, value in members(obj):
            out.append(_heading(4, f"{obj.__name__}.{name}"))
            out.append("```text\n" + member_signature(obj.__name__, name, value) + "\n```")
            out.append(_described(value, f"{entry.name}.{name}"))
        inherited = [
            f"`{name}`"
            for base in obj.__mro__[1:]
            if base.__module__.startswith("jaxdepth")
            for name, _ in members(base)
            if name not in vars(obj)
        ]
        if inherited:
            out.append(f"Inherited: {', '.join(dict.fromkeys(inherited))}.")
    return out


def render() -> str:
    """The whole page, as docs/reference.md holds it."""
    all_sections = sections()
    heads = titles(all_sections)
    contents = []
    for section in all_sections:
        names = ", ".join(f"[`{e.name.rsplit('.', 1)[1]}`](#{anchor(heads[e.name])})" for e in section.entries)
        contents.append(f"- [`{section.name}`](#{anchor(section.name)})" + (f": {names}" if names else ""))
    parts = [INTRO, "## Contents", "\n".join(contents)]
    order = {entry.name: i for i, entry in enumerate(e for section in all_sections for e in section.entries)}
    for section in all_sections:
        parts.append(_heading(2, section.name))
        if section.module.__name__ != section.name:
            parts.append(f"Defined in `{section.module.__name__}`.")
        if docstring(section.module):
            parts.append(_described(section.module, section.name))
        if section.name == "jaxdepth":
            # each module of the top level links to its section (`jaxdepth.metrics`: jaxdepth.analyses.metrics)
            homes = {id(s.module): s.name for s in reversed(all_sections)}
            modules = [getattr(section.module, name) for name in section.module.__all__]
            parts.append(
                " ".join(
                    f"`jaxdepth.{name}` is a module: [below](#{anchor(homes[id(module)])})."
                    for name, module in zip(section.module.__all__, modules)
                    if inspect.ismodule(module)
                )
            )
        if section.values:
            named = ", ".join(f"`{name}` ({type(getattr(section.module, name)).__name__})" for name in section.values)
            parts.append(f"Also public (values): {named}.")
        for alias in section.aliases:
            kind = "class" if inspect.isclass(alias.obj) else "function"
            parts.append(
                f"`{alias.name}` is the {kind} [`{alias.same_as}`](#{anchor(heads.get(alias.same_as, alias.same_as))})"
                " (no heading of its"
                f" own: its anchor would be the module's, `{alias.name.lower()}`)."
            )
        for entry in section.entries:
            where = "below" if entry.same_as is not None and order[entry.same_as] > order[entry.name] else "above"
            parts.extend(_entry(entry, top=section.name == "jaxdepth", where=where, heads=heads))
    page = "\n\n".join(part for part in parts if part) + "\n"
    headings = re.findall(r"^#+ (`[^`]+`.*)$", page, flags=re.M)
    duplicates = {anchor(h) for h in headings if [anchor(x) for x in headings].count(anchor(h)) > 1}
    if duplicates:
        raise ValueError(f"headings with the same anchor: {sorted(duplicates)}")
    return page


def main() -> int:
    page = render()
    with open(PAGE, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"wrote {os.path.relpath(PAGE)}: {len(public_names())} names, {page.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
