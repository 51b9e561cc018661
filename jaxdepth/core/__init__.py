"""The functional core: the model config, the Flax NNX decoder and its pure forward (one layer
step and the drivers that run it), intervention sites and interventions, sweeps over stacks of
interventions, compilation and sharding; below the analyses, the result type they return
(`saved_result`, saved and loaded as one file) and atomic file writes (`atomic`). Nothing here
imports the analyses or the shell (`jaxdepth.lab`), parses a command line or draws figures."""

__all__: list[str] = []  # a package of modules: the modules are its public names
