"""Analysis results that save themselves (arrays plus the settings that produced them), atomically.

Every result type is a dataclass inheriting `SavedResult`: its numpy-array fields go into an
`.npz` file, every other field into a JSON header stored in the same file, so one file is the
whole result and plotting or tables never recompute. A result type registers itself by name when
its module is imported; `load_saved` reads a file back as any type registered by then (the shell's
`jaxdepth.lab.results.load_result` first imports every built-in analysis).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from jaxdepth.core.atomic import atomic_write

_TYPES: dict[str, type] = {}  # every SavedResult subclass imported so far, by class name


class SavedResult:
    """Mixin for result dataclasses: `save(path)` and `load(path)` (any registered type)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _TYPES[cls.__name__] = cls

    def save(self, path: str) -> str:
        """Write to `path` (an `.npz`) atomically: a temporary file renamed into place."""
        arrays, meta = {}, {"type": type(self).__name__}
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
        result = load_saved(path)
        if not isinstance(result, cls):
            raise TypeError(f"{path} holds a {type(result).__name__}, not a {cls.__name__}")
        return result


def load_saved(path: str) -> Any:
    """Load any result written by `SavedResult.save`, as its own type: any type defined in a
    module imported by now (a type whose module is not imported yet is an unknown type)."""
    with np.load(path) as data:
        meta = json.loads(data["__meta__"].tobytes().decode())
        arrays = {k: data[k] for k in data.files if k != "__meta__"}
    cls = _TYPES.get(meta.pop("type"))
    if cls is None:
        raise ValueError(f"{path}: unknown result type")
    return cls(**arrays, **meta)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot store {type(x).__name__} in result settings")
