"""The decoder as a Flax NNX module.

`Decoder` holds the weights as `nnx.Param`s, per-layer weights stacked on a leading layer axis,
each carrying its partition spec from `jaxdepth.core.sharding.PARTITION_RULES` (derived from the
parameters' declaration, `jaxdepth.core.parameters`) as `out_sharding` metadata. It computes
nothing of its own: calling it runs the pure `jaxdepth.core.model.forward` on `params()`, and
`nnx.split(decoder)` gives a state whose `to_pure_dict()` is exactly that params pytree, the
same arrays, not copies. So the module is the object a user holds, and the pure, jitted
functions the analyses call take its state: no NNX graph traversal inside any hot loop.
"""

from __future__ import annotations

from flax import nnx

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.layer import Params
from jaxdepth.core.model import check_params, forward
from jaxdepth.core.sharding import PARTITION_RULES

__all__ = [
    "Decoder",
    "partition_specs",
    "abstract_decoder",
]


def _param(name: str, value) -> nnx.Param:
    # eager_sharding=False: the spec is metadata for whoever places the params on a mesh
    # (`jaxdepth.core.sharding`, a sharded orbax restore); creating the module never moves data.
    return nnx.Param(value, out_sharding=PARTITION_RULES[name], eager_sharding=False)


class Decoder(nnx.Module):
    """The decoder of any supported family (`ModelConfig`) whose weights are `nnx.Param`s.

    Build it from a params pytree with `Decoder(params, config)` (no copy); read the pytree back
    with `params()` or `nnx.split(decoder)[1].to_pure_dict()`.
    """

    def __init__(self, params: Params, config: ModelConfig):
        check_params(params, config)
        self.config = config
        for name, w in params.items():  # embed, final_norm, ... as the family has them
            if name != "layers":
                setattr(self, name, _param(name, w))
        self.layers = nnx.Dict({name: _param(name, w) for name, w in params["layers"].items()})

    def params(self) -> Params:
        """The params pytree the pure functions take: the module's `nnx.Param` values, as plain
        nested dicts (the same arrays)."""
        return nnx.state(self, nnx.Param).to_pure_dict()

    def __call__(self, tokens, *, valid=None, interventions=None):
        """Logits `[B, T, V]`, exactly `jaxdepth.core.model.forward(self.params(), ...)` (jit the pure
        function, or `nnx.jit` this call, for speed)."""
        return forward(self.params(), tokens, self.config, valid=valid, interventions=interventions)


def partition_specs(decoder: Decoder):
    """The `PartitionSpec` of every parameter, as a pytree shaped like `decoder.params()`."""
    return nnx.get_partition_spec(nnx.state(decoder, nnx.Param)).to_pure_dict()


def abstract_decoder(config: ModelConfig, dtype) -> Decoder:
    """A `Decoder` of `config` whose params are `jax.ShapeDtypeStruct`s (no memory): the target
    of an orbax restore."""
    import jax

    from jaxdepth.core.model import param_shapes

    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(config), is_leaf=lambda x: isinstance(x, tuple)
    )
    return Decoder(shapes, config)
