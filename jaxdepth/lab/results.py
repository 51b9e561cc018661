"""Loading analysis results saved on disk, as their own types, with every built-in result type
known (the result types and their saving live in `jaxdepth.core.saved_result`), and the config
of the model they are of, which a study saves beside them (`MODEL_CONFIG` in the model's
folder, `OUT/<model key>/`): what the shell needs of the model without loading it (the kinds of
its layers, `jaxdepth.lab.kind_comparison`)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

from jaxdepth.core.saved_result import load_saved

__all__ = [
    "load_result",
    "RESULT_FORMAT",
    "MODEL_CONFIG",
    "save_model_config",
    "saved_model_config",
]


# Part of every study result's cache identity: bumped when result types gain fields, so a rerun
# recomputes results saved without them (per-prompt curves, since 2) instead of reusing them.
RESULT_FORMAT = 2

MODEL_CONFIG = "model_config.json"  # in a model's results folder: its `ModelConfig.to_json()`


def load_result(path: str) -> Any:
    """Load any result written by `SavedResult.save`, as its own type: a built-in one (their
    modules are imported here), or any other, a plugin's included, whose module the file records
    and Python can import (installed, or on `sys.path`). A type that cannot be found raises a
    ValueError (`jaxdepth.core.saved_result.UnknownResultTypeError`) naming it and its module."""
    import jaxdepth.lab.registry  # noqa: F401  (a result type registers itself when its module is imported)

    return load_saved(path)


def save_model_config(model_folder: str, config) -> Optional[str]:
    """Write `config` (a `jaxdepth.ModelConfig`) as `MODEL_CONFIG` in `model_folder` (a model's
    results folder, above its datasets' folders), atomically; nothing is written where the same
    config is there already or the folder cannot be written (a read-only folder of results that
    are all reused). Returns the file's path, or None when nothing was written."""
    from jaxdepth.core.atomic import atomic_write, writable

    path = os.path.join(model_folder, MODEL_CONFIG)
    text = config.to_json() + "\n"
    try:
        with open(path) as f:
            if f.read() == text:
                return None
    except OSError:
        pass
    if not writable(model_folder):
        return None
    with atomic_write(path, "w") as f:
        f.write(text)
    return path


def saved_model_config(results_folder: str):
    """The `jaxdepth.ModelConfig` saved for the results in `results_folder` (a dataset's folder,
    `OUT/<model key>/<dataset>`, or the model's own): `MODEL_CONFIG` in the folder or the one
    above it; None where neither has one (results saved before it was recorded: a rerun of
    `jaxdepth run` reuses them and records it). Fields this version does not know are left out;
    a file that is no config raises a ValueError naming it."""
    from jaxdepth.core.config import ModelConfig

    for folder in (results_folder, os.path.dirname(os.path.normpath(results_folder))):
        path = os.path.join(folder, MODEL_CONFIG)
        if not os.path.isfile(path):
            continue
        known = {f.name for f in dataclasses.fields(ModelConfig)}
        try:
            with open(path) as f:
                fields = json.load(f)
            return ModelConfig.from_dict({k: v for k, v in fields.items() if k in known})
        except (OSError, ValueError, TypeError, AttributeError) as error:
            raise ValueError(
                f"{path} is not a readable model config ({type(error).__name__}: {error}): remove it, "
                "or let a rerun of `jaxdepth run` on the model write it again"
            ) from None
    return None
