"""jaxdepth: how much of its depth does a language model use? Analyses as pure JAX functions."""

from jaxdepth.core import sites
from jaxdepth.core.config import ModelConfig, UnsupportedConfigError
from jaxdepth.core.interventions import Interventions
from jaxdepth.core.model import forward, residual_stream, run_layers
from jaxdepth.lab.loaded_model import Model
from jaxdepth.lab.sources import load
from jaxdepth.analyses.attribution import site_gradients
from jaxdepth.analyses.ig_at_sites import SiteIG, integrated_gradients

__all__ = ["ModelConfig", "UnsupportedConfigError", "Interventions", "Model", "load", "forward",
           "residual_stream", "run_layers", "sites", "site_gradients", "integrated_gradients", "SiteIG"]
