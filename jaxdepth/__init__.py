"""jaxdepth: how much of its depth does a language model use? Analyses as pure JAX functions."""

from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.interventions import Interventions
from jaxdepth.loading import Model, load
from jaxdepth.core.model import forward, residual_stream, run_layers

__all__ = ["ModelConfig", "UnsupportedConfigError", "Interventions", "Model", "load", "forward",
           "residual_stream", "run_layers"]
