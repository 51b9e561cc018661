"""Saving analysis results (arrays plus the settings that produced them) atomically.

Every result type is a dataclass inheriting `SavedResult`: its numpy-array fields go into an
`.npz` file, every other field into a JSON header stored in the same file, so one file is the
whole result and plotting or tables never recompute.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from jaxdepth.atomic import atomic_write

_REGISTRY: dict[str, type] = {}
# Part of every study result's cache identity: bumped when result types gain fields, so a rerun
# recomputes results saved without them (per-prompt curves, since 2) instead of reusing them.
RESULT_FORMAT = 2


class SavedResult:
    """Mixin for result dataclasses: `save(path)` and `load(path)` (any registered type)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[cls.__name__] = cls

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
        result = load_result(path)
        if not isinstance(result, cls):
            raise TypeError(f"{path} holds a {type(result).__name__}, not a {cls.__name__}")
        return result


def load_result(path: str) -> Any:
    """Load any result written by `SavedResult.save`, as its own type (any type defined in a
    module imported by now; the registered analyses' modules are imported here)."""
    import jaxdepth.registry  # noqa: F401  (a result type registers itself when its module is imported)

    with np.load(path) as data:
        meta = json.loads(data["__meta__"].tobytes().decode())
        arrays = {k: data[k] for k in data.files if k != "__meta__"}
    cls = _REGISTRY.get(meta.pop("type"))
    if cls is None:
        raise ValueError(f"{path}: unknown result type")
    return cls(**arrays, **meta)


def _jsonable(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"cannot store {type(x).__name__} in result settings")
