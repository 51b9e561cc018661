"""Analysis results that save themselves (arrays plus the settings that produced them), atomically.

Every result type is a dataclass inheriting `SavedResult`: its numpy-array fields go into an
`.npz` file, every other field into a JSON header stored in the same file, so one file is the
whole result and plotting or tables never recompute. The header names the result's type: its
class name, the module defining it and its qualified name. `load_saved` reads a file back as that
type, importing the type's module first when it is not imported yet, so a plugin's result loads
in a process that never imported the plugin (as long as the plugin is installed or on
`sys.path`). A file saved before the module was recorded loads as the type of that class name
imported by then (the shell's `jaxdepth.lab.results.load_result` first imports every built-in
analysis).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import zipfile
from typing import Any, Optional

import numpy as np

from jaxdepth.core.atomic import atomic_write

__all__ = [
    "UnknownResultTypeError",
    "UnreadableResultError",
    "SavedResult",
    "load_saved",
]


_TYPES: dict[str, type] = {}  # every SavedResult subclass imported so far, by class name
_PLACES: dict[tuple[str, str], type] = {}  # the same, by (module, qualified name)


class UnknownResultTypeError(ValueError):
    """A saved result's type is not defined in this process, and its module cannot supply it."""


class UnreadableResultError(ValueError):
    """A result file that cannot be read as a result: cut short, not a result at all, missing an
    array its type needs, or written in a format this version does not read. Its message names
    the file, what is wrong and what to do; `path` and `reason` hold the first two."""

    def __init__(self, path: str, reason: str):
        super().__init__(
            f"{path} cannot be read as a result: {reason}. Remove it (or move it aside) and run the command that "
            "wrote it again: the result is computed anew"
        )
        self.path, self.reason = path, reason


class SavedResult:
    """Mixin for result dataclasses: `save(path)` and `load(path)` (any registered type)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _TYPES[cls.__name__] = cls
        _PLACES[(cls.__module__, cls.__qualname__)] = cls

    def save(self, path: str) -> str:
        """Write to `path` (an `.npz`) atomically: a temporary file renamed into place."""
        cls = type(self)
        arrays, meta = {}, {"type": cls.__name__, "type_module": cls.__module__, "type_qualname": cls.__qualname__}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, np.ndarray):
                arrays[field.name] = value
            else:
                meta[field.name] = value
        arrays["__meta__"] = np.frombuffer(json.dumps(meta, default=_jsonable).encode(), np.uint8)
        with atomic_write(path) as f:
            np.savez(f, **arrays)
        return path

    @classmethod
    def load(cls, path: str):
        """The result saved at `path`, refused (TypeError) unless it is of this type."""
        result = load_saved(path)
        if not isinstance(result, cls):
            raise TypeError(f"{path} holds a {type(result).__name__}, not a {cls.__name__}")
        return result


def load_saved(path: str) -> Any:
    """Load any result written by `SavedResult.save`, as its own type. A type not imported yet is
    imported from the module the file names; where that fails (or the file, from an older
    version, names no module), an `UnknownResultTypeError` (a ValueError) names the type and the
    module to import. A file that is no readable result (cut short, random bytes, no header, an
    array missing, fields of another version) is an `UnreadableResultError` (a ValueError)
    naming it; a missing file is a FileNotFoundError."""
    try:
        with np.load(path) as data:
            if "__meta__" not in data.files:
                raise UnreadableResultError(path, "it holds arrays but no result header (not written by jaxdepth)")
            meta = json.loads(data["__meta__"].tobytes().decode())
            if not isinstance(meta, dict) or "type" not in meta:
                raise UnreadableResultError(path, "its header names no result type (not written by jaxdepth)")
            arrays = {k: data[k] for k in data.files if k != "__meta__"}
    except (FileNotFoundError, IsADirectoryError, PermissionError, UnreadableResultError):
        raise
    except Exception as error:  # zipfile.BadZipFile, EOFError, a pickle refusal, a bad header, ...
        raise UnreadableResultError(path, _why_unreadable(error)) from None
    cls = _result_type(path, meta.pop("type"), meta.pop("type_module", None), meta.pop("type_qualname", None))
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else None
    given = set(arrays) | set(meta)
    if fields is not None:
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing, unknown = sorted(required - given), sorted(given - fields)
        if missing or unknown:
            what = [f"missing {', '.join(missing)}"] if missing else []
            what += [f"fields this version does not know: {', '.join(unknown)}"] if unknown else []
            raise UnreadableResultError(path, f"a {cls.__name__} of another format ({'; '.join(what)})")
    return cls(**arrays, **meta)


def _why_unreadable(error: Exception) -> str:
    """What is wrong with a file `np.load` could not read, said for a person."""
    if isinstance(error, (zipfile.BadZipFile, EOFError)):
        return f"it is cut short or is no .npz archive ({type(error).__name__}: {error})"
    if "pickled" in str(error):  # numpy's refusal of what is not an array archive
        return "it is not an .npz archive (its bytes read as neither a zip archive nor an array)"
    return f"{type(error).__name__}: {error}"


def _result_type(path: str, name: str, module: Optional[str], qualname: Optional[str]) -> type:
    """The class a saved file names: the one defined at `module`.`qualname` (imported now if it is
    not yet), else the class imported under the name `name` (a file saved before modules were
    recorded, or a type whose module has moved)."""
    place = (module, qualname or name)
    import_error = None
    if module is not None and place not in _PLACES:
        # Importing a module by the name a file gives runs only code already installed (on
        # sys.path), as loading a plugin by its entry point does.
        try:
            importlib.import_module(module)
        except Exception as error:  # whatever the module's import raises: said below, if it matters
            import_error = error
    cls = _PLACES.get(place) or _TYPES.get(name)
    if cls is not None:
        return cls
    if module is None:
        raise UnknownResultTypeError(
            f"{path}: unknown result type {name!r}; the file does not record the module that defines it (it was "
            f"saved by an older jaxdepth): import that module, then load the file again"
        )
    if import_error is not None:
        raise UnknownResultTypeError(
            f"{path}: result type {name!r} is defined in the module {module!r}, which cannot be imported "
            f"({type(import_error).__name__}: {import_error}): install the package that provides it or put it on "
            f"sys.path (PYTHONPATH), so that `import {module}` works"
        ) from import_error
    raise UnknownResultTypeError(
        f"{path}: result type {name!r}: the module {module!r} defines no SavedResult "
        f"{place[1]} (renamed or removed since the file was saved?)"
    )


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot store {type(x).__name__} in result settings")
