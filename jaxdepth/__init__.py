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
each module of `jaxdepth.analyses`); a name outside it is internal and may change.

The functions take `params` (`Model.params`: a nested dict of arrays, per-layer weights stacked
on a leading layer axis) as an argument and the `ModelConfig` as a static argument (hashable: a
new config compiles anew). Shapes are written with the axis names of `jaxdepth.core.model` (B
prompts, T positions, L layers, D residual width, V vocabulary, ...).
"""

from jaxdepth.core import sites, structure
from jaxdepth.core.decoding import generate, generate_orders
from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.loops import run_layers
from jaxdepth.core.model import forward, residual_stream
from jaxdepth.lab.loaded_model import Model
from jaxdepth.lab.sources import load
from jaxdepth.analyses.attribution import site_gradients
from jaxdepth.analyses.ig import (
    AdaptiveRule,
    Execution,
    FixedRule,
    NonFiniteAttributionError,
    SiteIG,
    integrated_gradients,
)
from jaxdepth.analyses.edges import edge_attribution, prompt_pairs

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
    "SiteIG",
    "NonFiniteAttributionError",
    "edge_attribution",
    "prompt_pairs",
]
