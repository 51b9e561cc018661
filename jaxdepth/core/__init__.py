"""The functional core: the model config, the Flax NNX decoder and its pure forward (one layer
step and the drivers that run it), intervention sites and interventions, sweeps over stacks of
interventions, compilation and sharding. Nothing here reads files or draws figures."""
