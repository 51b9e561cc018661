"""jaxdepth: how much of its depth does a language model use? Analyses as pure JAX functions.

The top level holds what most code needs: `load` (a `Model` from a converted folder, a Hugging
Face folder or hub id, a `.gguf` file or the embedded `"smollm2"`), the pure forward pass
(`forward`, `run_layers`, `residual_stream`), named sites and interventions as data (`sites`:
`skip`, `replace`, `add`, `patch`, `keep`, `ablate_heads` and kinds of your own), the order of the
layers as data (`structure`: drop, swap, reverse, repeat or parallelise layers), generation
under interventions and in any layer order (`generate`, `generate_orders` for many orders at once;
`Model.generate` for text), and gradients
at any site (`site_gradients`; `integrated_gradients`, which returns a `SiteIG`, with its rule a
value, `FixedRule` or `AdaptiveRule`, and how it runs an `Execution`), and edge
attribution over clean/corrupt prompt pairs (`edge_attribution`, `prompt_pairs`; patching and
circuits in `jaxdepth.analyses.edges`). Each analysis
of the studies is a module of `jaxdepth.analyses`; files, the command line and the study runner
are in `jaxdepth.lab`. What a module offers is its `__all__` (here, in `jaxdepth.sites` and in
every module of `jaxdepth` and `conversion`, which the API reference documents); a name outside
it is internal and may change.

The functions take `params` (`Model.params`: a nested dict of arrays, per-layer weights stacked
on a leading layer axis) as an argument and the `ModelConfig` as a static argument (hashable: a
new config compiles anew). Shapes are written with the axis names of `jaxdepth.core.model` (B
prompts, T positions, L layers, D residual width, V vocabulary, ...).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Each name where it is defined. Loaded on first use (PEP 562), so that `import jaxdepth.core`
# or `import conversion` loads the core alone, not the analyses and the shell.
_WHERE = {
    "ModelConfig": "jaxdepth.core.config",
    "UnsupportedConfigError": "jaxdepth.core.config",
    "Model": "jaxdepth.lab.loaded_model",
    "load": "jaxdepth.lab.sources",
    "forward": "jaxdepth.core.model",
    "residual_stream": "jaxdepth.core.model",
    "run_layers": "jaxdepth.core.loops",
    "sites": "jaxdepth.core",
    "structure": "jaxdepth.core",
    "generate": "jaxdepth.core.decoding",
    "generate_orders": "jaxdepth.core.decoding",
    "site_gradients": "jaxdepth.analyses.attribution",
    "integrated_gradients": "jaxdepth.analyses.ig",
    "FixedRule": "jaxdepth.analyses.ig",
    "AdaptiveRule": "jaxdepth.analyses.ig",
    "Execution": "jaxdepth.core.execution",
    "metric": "jaxdepth.analyses.metrics",
    "Metric": "jaxdepth.analyses.metrics",
    "Readout": "jaxdepth.analyses.metrics",
    "metrics": "jaxdepth.analyses",
    "SiteIG": "jaxdepth.analyses.ig",
    "NonFiniteAttributionError": "jaxdepth.analyses.ig",
    "edge_attribution": "jaxdepth.analyses.edges",
    "prompt_pairs": "jaxdepth.analyses.edges",
}

__all__ = [
    "ModelConfig",
    "UnsupportedConfigError",
    "Model",
    "load",
    "forward",
    "residual_stream",
    "run_layers",
    "sites",
    "structure",
    "generate",
    "generate_orders",
    "site_gradients",
    "integrated_gradients",
    "FixedRule",
    "AdaptiveRule",
    "Execution",
    "metric",
    "Metric",
    "Readout",
    "metrics",
    "SiteIG",
    "NonFiniteAttributionError",
    "edge_attribution",
    "prompt_pairs",
]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'jaxdepth' has no attribute {name!r}")
    module = importlib.import_module(_WHERE[name])
    value = getattr(module, name) if hasattr(module, name) else importlib.import_module(f"{_WHERE[name]}.{name}")
    globals()[name] = value  # found once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what a type checker and an editor see: the names, imported as usual
    from jaxdepth.analyses import metrics
    from jaxdepth.analyses.attribution import site_gradients
    from jaxdepth.analyses.metrics import Metric, Readout, metric
    from jaxdepth.analyses.edges import edge_attribution, prompt_pairs
    from jaxdepth.analyses.ig import (
        AdaptiveRule,
        FixedRule,
        NonFiniteAttributionError,
        SiteIG,
        integrated_gradients,
    )
    from jaxdepth.core import sites, structure
    from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
    from jaxdepth.core.decoding import generate, generate_orders
    from jaxdepth.core.execution import Execution
    from jaxdepth.core.loops import run_layers
    from jaxdepth.core.model import forward, residual_stream
    from jaxdepth.lab.loaded_model import Model
    from jaxdepth.lab.sources import load
