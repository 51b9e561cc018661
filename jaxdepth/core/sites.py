"""Named intervention sites of a decoder layer, and interventions as data.

Every layer exposes these sites, in the order the layer computes them (names as in
TransformerLens, shapes in the glossary of `jaxdepth.core.model`):

    resid_pre   h_l, the layer's input                               [B, T, D]
    q_in        each query head's query input, before the norm *     [B, T, H, D]
    k_in        each query head's key input, before the norm *       [B, T, H, D]
    v_in        each query head's value input, before the norm *     [B, T, H, D]
    head_out    each attention head's output, before o_proj ¶          [B, T, H, Dh]
    head_result each head's output through its slice of o_proj *      [B, T, H, D]
    attn_out    a_l, the attention output after o_proj                 [B, T, D]
    mlp_in      h_l + a_l, the MLP's input before its norm             [B, T, D]
    mlp_hidden  silu(gate) * up, the MLP's hidden activations †        [B, T, F]
    router_logits     the router's logits ‡                            [B, T, E]
    router_probs      the router's scores, softmax of the logits ‡     [B, T, E]
    router_selection  what the k experts are picked by ‡               [B, T, E]
    expert_weights    each expert's weight, 0 off the chosen k ‡       [B, T, E]
    expert_hidden     each chosen expert's hidden activations ‡        [B, T, k, F]
    expert_out        each chosen expert's output, unweighted ‡        [B, T, k, D]
    shared_out        the shared experts' output (DeepSeek) ‡          [B, T, D]
    mlp_out     m_l, the MLP output (a mixture: the weighted sum)      [B, T, D]
    per_layer_out     the per-layer input's contribution (Gemma 4) §   [B, T, D]
    delta       the layer's contribution a_l + m_l                     [B, T, D]
    resid_post  h_{l+1}, the layer's output                            [B, T, D]

Sites marked † exist in a dense MLP only, those marked ‡ in a mixture of experts only
(`jaxdepth.core.experts`, which says what each means and what editing `expert_weights` runs),
the one marked § in a model with per-layer inputs only (Gemma 4, whose `delta` adds it, scaled
by the layer's scalar with the rest: `jaxdepth.core.config.ModelConfig`);
an intervention at a site the model's layers do not have is an `InterventionError` at trace
time (`refuse_absent_sites`), never an edit that silently does nothing.

The sites marked * exist in a layer whose attention input is split per head (TransformerLens's
`use_split_qkv_input`): every query head reads its query, key and value from an input of its
own (each h_l until an intervention changes it), the key and value inputs of the heads of a
group are projected with the group's weights (never copied), and `attn_out` is the sum of the
heads' `head_result`. A layer is split exactly when an intervention acts at one of those sites
(`SPLIT_SITES`); its keys and values (`LayerRecord.k`, `.v`) are then per query head, and its
numbers equal the unsplit layer's to float rounding. Editing `mlp_in` changes what the MLP
reads, not the residual: `resid_post` is still h_l + a_l + m_l.
A linear-attention layer (`jaxdepth.core.config.ModelConfig.linear_layers`) splits per value
head (`jaxdepth.core.linear_attention.gated_delta_net_heads`): each value head reads its key
head's query channels and its output gate from its `q_in`, its key head's key channels, beta
and the decay from its `k_in`, its value channels from its `v_in`, and `head_result` is its
output through its rows of the output projection. Among layers of the two kinds the split
sites hold `ModelConfig.split_heads` rows (the most of the query and the value heads), zeros
past a layer's own heads.

¶ In a linear-attention layer, each value head's gated, normed output before the output
projection (`jaxdepth.core.linear_attention.gated_delta_net`'s `heads_only`); among layers of
the two kinds the site holds `ModelConfig.head_out_shape` (the most heads, the widest width),
zeros past a layer's own heads and width.

`resid_pre` at layer index L (one past the last layer) is the final residual h_L, the input of
the final norm: an intervention there edits boundary L.

Layer indices. An intervention acts at layers 0..L-1 (and, at `resid_pre`, at L: the final
residual). Negative indices count layers from the end, as in Python and TransformerLens's
`blocks[-1]`: -1 is layer L-1 at every site (at `resid_pre`, its input h_{L-1}; the final residual
is only index L). An index outside -L..L-1 (-L..L at `resid_pre`) is an `InterventionError`
naming the site, the index and the valid range, raised where the index is known: when the model
runs on it outside `jit`, or when it is handed to any jitted function of jaxdepth (they check
the interventions among their arguments against the model's config before tracing,
`check_layer_indices`). Inside a `jit` or `vmap` of your own the index is traced: negatives are
still counted from the end, but an out-of-range traced index matches no layer and so edits
nothing; check concrete indices yourself first with `check_layer_indices(ivs, L)`. Taps (see
`jaxdepth.core.layer.LayerRecord`) also read the queries, keys, values and attention probabilities.

An `Intervention` is a site name, a pure function `fn(value, layer, data) -> value` and `data`,
a pytree of arrays. `layer` is the (traced) layer index, so one intervention can act on any
subset of layers; `data` is the only part JAX traces: a new value never recompiles, a stack of
interventions (data with a leading axis) `vmap`s, and gradients flow into `data`. `site` and
`fn` are static: define `fn` once (at module level), not as a new lambda per call, or every call
compiles anew. Write `fn` with `where` and multiplications, not Python `if` on values: under
`vmap` both branches of a `lax.cond` run anyway.

A `StatefulIntervention` carries a state (a pytree of arrays) through the layer loop: it acts
at several sites, in the order the layer computes them, and each call returns the value and the
new state. It is what an edit needs that depends on what the run itself computed earlier
(exact edge patching: a reader receives a writer's corrupt output minus what that writer wrote
in this very run).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

__all__ = [
    "SITES",
    "SPLIT_SITES",
    "SITE_TABLE",
    "Site",
    "Role",
    "site_shape",
    "Intervention",
    "StatefulIntervention",
    "InterventionError",
    "as_interventions",
    "check_layer_indices",
    "unchanged",
    "keep",
    "skip",
    "replace",
    "add",
    "patch",
    "probe",
    "ablate_heads",
    "acting_sites",
    "splits_layer",
    "refuse_absent_sites",
    "initial_states",
    "apply_at",
]


@dataclasses.dataclass(frozen=True)
class Role:
    """What a site is to the residual stream: the stream receives its value (`acts='writes'`)
    or its value is what a sublayer reads of the stream (`acts='reads'`), for the `sublayer`
    ('attention' or 'mlp') it belongs to, one per query head (`per_head`) or one for the
    sublayer, `tag` naming a head's input in the edge graph ('q', 'k', 'v'), and `post_norms`:
    the role holds only in a layer with (True) or without (False) norms after the sublayers
    (None: in every layer). `jaxdepth.analyses.edges.graph.EdgeGraph` is built from these."""

    acts: str
    sublayer: str
    per_head: bool = False
    tag: str = ""
    post_norms: Optional[bool] = None

    def holds(self, post_norms: bool) -> bool:
        """Whether the role holds in a layer with (`post_norms` True) or without norms after the
        sublayers."""
        return self.post_norms is None or self.post_norms == post_norms


@dataclasses.dataclass(frozen=True)
class Site:
    """One named site of a layer: `name`, the field of `jaxdepth.core.layer.LayerRecord` that
    holds its value (`record`; the record answers to `name` too), `features(config)`, the
    shape of its value after the batch and position axes, whether it exists only in a layer
    whose attention input is split per head (`split`, module docstring), its `role` to the
    residual stream (a writer or a reader of it, `Role`; None for the others), and whether the
    layers of a config have it at all (`present(config)`: a dense MLP's hidden units, a
    mixture's router)."""

    name: str
    record: str
    features: Callable[[Any], tuple]
    split: bool = False  # computed only in a layer whose attention input is split per head
    role: Optional[Role] = None
    present: Callable[[Any], bool] = lambda config: True  # in the layers of this config?


def _width(config) -> tuple:
    return (config.hidden_size,)


def _per_head_width(config) -> tuple:
    return (config.split_heads, config.hidden_size)


# The one table of sites, in the order the layer computes them: a new site is one entry here
# (and its computation in `layer_step`); the names, shapes and the record's aliases follow, and
# from the roles the edge graph's writers and readers, numbered in this order. Each head reads
# its query, key and value inputs; the stream receives each head's result, or, behind a norm
# after the attention (a normalised sum, of which no head writes a part of its own), the
# attention's output as one; the MLP reads its input and writes its output (after its norm).
SITE_TABLE = (
    Site("resid_pre", "h", _width),
    Site("q_in", "q_in", _per_head_width, split=True, role=Role("reads", "attention", per_head=True, tag="q")),
    Site("k_in", "k_in", _per_head_width, split=True, role=Role("reads", "attention", per_head=True, tag="k")),
    Site("v_in", "v_in", _per_head_width, split=True, role=Role("reads", "attention", per_head=True, tag="v")),
    Site("head_out", "head_out", lambda c: c.head_out_shape),
    Site(
        "head_result",
        "head_result",
        _per_head_width,
        split=True,
        role=Role("writes", "attention", per_head=True, post_norms=False),
    ),
    Site("attn_out", "attn", _width, role=Role("writes", "attention", post_norms=True)),
    Site("mlp_in", "mlp_in", _width, role=Role("reads", "mlp")),
    Site("mlp_hidden", "mlp_hidden", lambda c: (c.widest_mlp,), present=lambda c: bool(c.dense_mlp_layers)),
    *(
        Site(name, name, lambda c: (c.num_experts,), present=lambda c: c.is_moe)
        for name in ("router_logits", "router_probs", "router_selection", "expert_weights")
    ),
    Site(
        "expert_hidden",
        "expert_hidden",
        lambda c: (c.experts_per_token, c.intermediate_size),
        present=lambda c: c.is_moe,
    ),
    Site("expert_out", "expert_out", lambda c: (c.experts_per_token, c.hidden_size), present=lambda c: c.is_moe),
    Site("shared_out", "shared_out", _width, present=lambda c: c.shared_expert_size > 0),
    Site("mlp_out", "mlp", _width, role=Role("writes", "mlp")),
    Site("per_layer_out", "per_layer", _width, present=lambda c: c.per_layer_input_size > 0),
    Site("delta", "delta", _width),
    Site("resid_post", "out", _width),
)
SITES = tuple(site.name for site in SITE_TABLE)
SPLIT_SITES = tuple(site.name for site in SITE_TABLE if site.split)
_BY_NAME = {site.name: site for site in SITE_TABLE}


def site_shape(site: str, config, batch: int, length: int) -> tuple[int, ...]:
    """The value's shape at `site` of one layer (a `ModelConfig`'s), for `batch` prompts of
    `length` positions."""
    if site not in _BY_NAME:
        raise ValueError(f"unknown site {site!r}; sites: {', '.join(SITES)}")
    return (batch, length) + tuple(_BY_NAME[site].features(config))


class InterventionError(ValueError):
    """An intervention whose data does not fit its site (raised at trace time)."""


@dataclasses.dataclass(frozen=True)
class Intervention:
    """Apply `fn(value, layer, data)` to the value at `site` of every layer (and, for
    `resid_pre`, to the final residual h_L with layer = L).

    `layer_data` declares which parts of `data` are indexed by layer (`fn` reads row `layer` of
    them): `()` (default) none, `True` every leaf, or a tuple of keys / indices of the entries of
    `data` (a dict or tuple) whose leaves are. Declared data is checked at trace time: it must
    have exactly L rows (one per layer), or, at `resid_pre` only, L+1 (boundaries h_0..h_L).
    Data with L rows never touches the final residual; with L+1 rows, row L edits h_L. Without
    the declaration JAX would clamp `data[L]` to row L-1 and edit h_L silently.

    `layer_index` declares which entry of `data` (a key of a dict, an index of a tuple, or
    `True` for `data` itself) holds the layer index (an int scalar, or an int array of them for
    a stack) that `fn` compares with `layer`. Declared indices are checked and negative ones
    counted from the end (module docstring, "Layer indices"); `fn` then sees indices in 0..L.
    """

    site: str
    fn: Callable[[Array, Array, Any], Array]
    data: Any = None
    layer_data: Union[bool, tuple] = ()
    layer_index: Union[None, bool, int, str] = None

    def __post_init__(self):
        if self.site not in SITES:
            raise ValueError(f"unknown intervention site {self.site!r}; sites: {', '.join(SITES)}")
        if not isinstance(self.layer_data, (bool, tuple)):
            raise TypeError(f"layer_data must be True, False or a tuple of keys of data, got {self.layer_data!r}")
        if not (self.layer_index is None or self.layer_index is True or isinstance(self.layer_index, (int, str))):
            raise TypeError(f"layer_index must be None, True, or a key or index of data, got {self.layer_index!r}")

    def _name(self) -> str:
        return f"intervention {getattr(self.fn, '__name__', self.fn)!r} at site {self.site!r}"

    def layer_rows(self, num_layers: int) -> Optional[int]:
        """The number of rows of the data declared layer-indexed (None if none is), after
        checking it against `num_layers` (module docstring): a `InterventionError` otherwise."""
        if self.layer_data is False or self.layer_data == ():
            return None
        if self.layer_data is True:
            parts = [("data", self.data)]
        else:
            try:
                parts = [(f"data[{key!r}]", self.data[key]) for key in self.layer_data]
            except (KeyError, IndexError, TypeError) as e:
                raise InterventionError(
                    f"{self._name()}: layer_data names {self.layer_data}, not entries of its data ({e})"
                ) from None
        leaves = [
            (name + jax.tree_util.keystr(path), leaf)
            for name, part in parts
            for path, leaf in jax.tree_util.tree_flatten_with_path(part)[0]
        ]
        allowed = (num_layers, num_layers + 1) if self.site == "resid_pre" else (num_layers,)
        expected = (
            f"{num_layers} (one per layer) or {num_layers + 1} (boundaries h_0..h_L, the last the final residual)"
            if self.site == "resid_pre"
            else f"{num_layers} (one per layer)"
        )
        rows = set()
        for name, leaf in leaves:
            shape = jnp.shape(leaf)
            if not shape or shape[0] not in allowed:
                raise InterventionError(
                    f"{self._name()}: data indexed by layer must have {expected} rows; {name} has shape {shape}"
                )
            rows.add(shape[0])
        if len(rows) > 1:
            raise InterventionError(
                f"{self._name()}: its layer-indexed data disagree on the number of rows: "
                + ", ".join(f"{name} {jnp.shape(leaf)}" for name, leaf in leaves)
            )
        return rows.pop() if rows else None

    def _layer_entry(self):
        if self.layer_index is True:
            return self.data
        try:
            return self.data[self.layer_index]
        except (KeyError, IndexError, TypeError) as e:
            raise InterventionError(
                f"{self._name()}: layer_index names {self.layer_index!r}, not an entry of its data ({e})"
            ) from None

    def _with_layer_entry(self, index) -> "Intervention":
        if self.layer_index is True:
            data = index
        elif isinstance(self.data, dict):
            data = {**self.data, self.layer_index: index}
        else:
            data = type(self.data)(index if i == self.layer_index else d for i, d in enumerate(self.data))
        return dataclasses.replace(self, data=data)

    def with_layer_index_checked(self, num_layers: int) -> "Intervention":
        """This intervention with its declared layer index (`layer_index`) in 0..L: a concrete
        index outside the site's range is an `InterventionError`, a negative one counts from the
        end (-1 is layer L-1). A traced index cannot be checked: only its negatives are mapped."""
        if self.layer_index is None:
            return self
        index = self._layer_entry()
        if isinstance(index, jax.core.Tracer):
            return self._with_layer_entry(jnp.where(index < 0, index + num_layers, index))
        values = np.asarray(index)
        if not np.issubdtype(values.dtype, np.integer):
            raise InterventionError(f"{self._name()}: a layer index must be an integer, got {values.dtype}")
        top = num_layers if self.site == "resid_pre" else num_layers - 1
        bad = values[(values < -num_layers) | (values > top)]
        if bad.size:
            final = f"; {num_layers} is the final residual h_{num_layers}" if self.site == "resid_pre" else ""
            raise InterventionError(
                f"{self._name()}: layer index {bad.ravel()[0]} is out of range for a model of {num_layers} layers: "
                f"valid are 0..{top}, or -{num_layers}..-1 counting from the end (-1 is layer {num_layers - 1})"
                f"{final}"
            )
        if not (values < 0).any():
            return self
        return self._with_layer_entry(jnp.asarray(np.where(values < 0, values + num_layers, values), values.dtype))

    def apply(self, value: Array, layer) -> Array:
        """`value` after this intervention at layer `layer`, its result checked at trace time:
        the site's shape, a float dtype (cast to the value's)."""
        try:
            out = self.fn(value, layer, self.data)
        except InterventionError as e:
            raise InterventionError(f"{self._name()}: {e}") from None
        _check_result(self._name(), out, value)
        return out.astype(value.dtype)


def _check_result(name: str, out, value: Array) -> None:
    """Refuse an intervention's result that is not a float array of the site value's shape."""
    if jnp.shape(out) != value.shape:
        raise InterventionError(
            f"{name}: returned shape {jnp.shape(out)}, but the site's value has shape {value.shape}"
        )
    if not jnp.issubdtype(jnp.result_type(out), jnp.inexact):
        raise InterventionError(f"{name}: returned {jnp.result_type(out)}, a float is needed")


jax.tree_util.register_dataclass(
    Intervention, data_fields=["data"], meta_fields=["site", "fn", "layer_data", "layer_index"]
)


@dataclasses.dataclass(frozen=True)
class StatefulIntervention:
    """Apply `fn(site, value, layer, data, state) -> (value, state)` at each site of `sites`
    of every layer, in the order the layer computes them (and, when `sites` holds `resid_pre`,
    to the final residual h_L with layer = L), carrying `state` from each call to the next
    through the layer loop (module docstring).

    `state` is the initial state, a pytree of arrays; every call must return a state of the
    same structure, shapes and dtypes (checked at trace time). `data` and `state` are traced
    (a new value never recompiles; a stack of them `vmap`s); `sites` and `fn` are static.
    Layer-indexed data is `fn`'s to index: nothing is declared or checked for it. The layer
    loops that run backwards layer by layer (`jaxdepth.core.loops.suffix_value_and_grad`)
    refuse it; under `jax.grad` of `run_layers` it differentiates like any carry."""

    sites: tuple
    fn: Callable
    data: Any = None
    state: Any = None

    def __post_init__(self):
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        unknown = [site for site in sites if site not in SITES]
        if not sites or unknown:
            raise ValueError(f"unknown intervention sites {unknown or sites!r}; sites: {', '.join(SITES)}")
        object.__setattr__(self, "sites", sites)

    def _name(self) -> str:
        return f"stateful intervention {getattr(self.fn, '__name__', self.fn)!r} at sites {self.sites!r}"

    def apply(self, site: str, value: Array, layer, state):
        """`(value, state)` after this intervention at `site` of layer `layer`, both checked at
        trace time (the value's shape and a float dtype; the state's structure and shapes)."""
        try:
            out, new_state = self.fn(site, value, layer, self.data, state)
        except InterventionError as e:
            raise InterventionError(f"{self._name()}: {e}") from None
        _check_result(self._name(), out, value)
        signature = lambda tree: jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)  # noqa: E731
        if jax.tree.structure(new_state) != jax.tree.structure(state) or signature(new_state) != signature(state):
            raise InterventionError(
                f"{self._name()}: at {site!r} its state changed from {signature(state)} to {signature(new_state)}; "
                "the state carried through the layer loop keeps its structure, shapes and dtypes"
            )
        return out.astype(value.dtype), new_state


jax.tree_util.register_dataclass(StatefulIntervention, data_fields=["data", "state"], meta_fields=["sites", "fn"])

InterventionsLike = Union[None, Intervention, StatefulIntervention, Sequence[Any]]
AnyIntervention = Union[Intervention, StatefulIntervention]


def as_interventions(interventions: InterventionsLike) -> tuple[AnyIntervention, ...]:
    """A flat tuple of interventions (`Intervention`, `StatefulIntervention`) from None, one
    intervention, or a (nested) sequence of them. Anything else is a `TypeError`."""
    if interventions is None:
        return ()
    if isinstance(interventions, (Intervention, StatefulIntervention)):
        return (interventions,)
    if not isinstance(interventions, (tuple, list)):
        raise TypeError(
            f"interventions must be None, an Intervention (jaxdepth.sites) or a sequence of them, "
            f"got {type(interventions).__name__}"
        )
    return tuple(iv for item in interventions for iv in as_interventions(item))


def check_layer_indices(interventions: InterventionsLike, num_layers: int) -> tuple[AnyIntervention, ...]:
    """`as_interventions(interventions)`, each declared layer index checked against a model of
    `num_layers` layers and counted from the end where negative
    (`Intervention.with_layer_index_checked`). Every driver of the model calls it; jaxdepth's
    jitted functions call it on their arguments before tracing, where the indices are known."""
    return tuple(
        iv.with_layer_index_checked(num_layers) if isinstance(iv, Intervention) else iv
        for iv in as_interventions(interventions)
    )


def acting_sites(interventions: tuple[AnyIntervention, ...]) -> set:
    """The names of the sites at which any of `interventions` acts."""
    return {site for iv in interventions for site in (iv.sites if isinstance(iv, StatefulIntervention) else (iv.site,))}


def splits_layer(interventions: tuple[AnyIntervention, ...]) -> bool:
    """Whether a layer under `interventions` is split per head: one of them acts at a split site
    (`SPLIT_SITES`, module docstring)."""
    return bool(acting_sites(interventions) & set(SPLIT_SITES))


def refuse_absent_sites(interventions: tuple[AnyIntervention, ...], config) -> None:
    """Refuse an intervention at a site the layers of `config` do not compute (a dense MLP's
    `mlp_hidden` in a mixture of experts, a router in a dense model): it would edit nothing.
    Among layers of two kinds (`ModelConfig.mixed_mlps`) each kind's sites are computed on its
    own layers: there an intervention edits them only, and a tap reads zeros on the others."""
    for name in sorted(acting_sites(interventions)):
        site = _BY_NAME[name]
        if not site.present(config):
            kind = "a mixture of experts" if config.is_moe else "a dense MLP"
            raise InterventionError(
                f"an intervention acts at site {name!r}, which the layers of this {config.model_type!r} model "
                f"({kind}) do not have: it would edit nothing"
            )


def _unchanged(value, layer, data):
    return value


def unchanged(site: str) -> Intervention:
    """An intervention that changes nothing at `site`. At a split site it splits every layer
    per head, so that a tap reads that site (`record.head_result`, ...) or a run computes the
    way runs that edit it do."""
    return Intervention(site, _unchanged)


def initial_states(interventions: tuple[AnyIntervention, ...]) -> tuple:
    """The states the layer loop carries: each stateful intervention's initial state, None for
    the others (aligned with `interventions`)."""
    return tuple(iv.state if isinstance(iv, StatefulIntervention) else None for iv in interventions)


def apply_at(
    site: str,
    value: Array,
    layer,
    interventions: tuple[AnyIntervention, ...],
    num_layers: int,
    states: tuple = (),
    *,
    final: bool = False,
) -> tuple[Array, tuple]:
    """`(value, states)`: `value` at `site` of `layer` after every intervention on that site,
    in order, and the carried `states` (`initial_states`; () when none is stateful) after them.

    `final=True` is boundary L (the final residual, `site` 'resid_pre', `layer` = L): there,
    interventions with L rows of layer-indexed data do not act (they have no row for it)."""
    states = list(states) or [None] * len(interventions)
    for k, iv in enumerate(interventions):
        if isinstance(iv, StatefulIntervention):
            if site in iv.sites:
                value, states[k] = iv.apply(site, value, layer, states[k])
            continue
        if iv.site != site:
            continue
        rows = iv.layer_rows(num_layers)
        if final and rows == num_layers:
            continue
        value = iv.apply(value, layer)
    return value, tuple(states)


# ----------------------------------------------------------------------------- built-in kinds
#
# Each kind is a module-level function of (value, layer, data) and a constructor that packs
# its data. Layer indices in data may be traced, so a vmapped sweep over layers compiles once.
# The functions check their data against the site's value at trace time (shapes are static).


def _float(x, what: str) -> Array:
    """`x` as a float array: Python numbers become float32; an int or bool array is refused
    (it would be cast silently, and is almost always the wrong argument)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return jnp.asarray(x, jnp.float32)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise InterventionError(f"{what} must be a float array, got {x.dtype}")
    return x


def _check_broadcast(shape: tuple, target: tuple, what: str) -> None:
    """Refuse `shape` unless it broadcasts to `target` without changing it."""
    try:
        ok = jnp.broadcast_shapes(tuple(shape), tuple(target)) == tuple(target)
    except ValueError:
        ok = False
    if not ok:
        raise InterventionError(f"{what} of shape {tuple(shape)} does not broadcast to {tuple(target)}")


def _expand(mask, value, what: str = "position mask"):
    """A position mask `[T]` or `[B, T]` as a multiplier of `value` `[B, T, ...]`."""
    if mask.ndim > 2:
        raise InterventionError(f"{what} must be [T] or [B, T], got shape {mask.shape}")
    _check_broadcast(mask.shape, value.shape[:2], what)
    return mask.reshape(mask.shape + (1,) * (value.ndim - 2)).astype(value.dtype)


def _multiply(value, layer, masks):
    return value * _expand(masks[layer], value, "a row of masks")


def keep(site: str, masks: Float[Array, " layer *bt"]) -> Intervention:
    """Multiply the value at `site` by `masks[l]` at every layer l: 1 keeps it, 0 removes it
    (`skip` is the same for one layer).

    Args:
        site: a name of `SITES`.
        masks: float `[L, T]` or `[L, B, T]`, one row per layer, a multiplier per position. At
            `resid_pre`, `[L+1, ...]` masks also multiply the final residual h_L by their last
            row; `[L, ...]` masks leave it alone.

    Example: `keep("delta", 1 - jnp.eye(L)[:, :1] * np.ones(T))` skips layer 0 at every position.
    """
    return Intervention(site, _multiply, jnp.asarray(masks, jnp.float32), layer_data=True)


def _skip(value, layer, data):
    at, positions = data
    return value * _expand(jnp.where(layer == at, 1.0 - positions, 1.0), value, "positions")


def skip(site: str, layer, positions) -> Intervention:
    """Remove the value at `site` of one layer where `positions` is 1 (multiply it by
    1 - positions there, by 1 elsewhere): at `delta` the whole layer is skipped (its residual
    passes through unchanged), at `attn_out` or `mlp_out` one sublayer. Zeroing `attn_out` also
    changes the MLP's input, exactly as zeroing the attention output in a hook does.

    Args:
        site: a name of `SITES` (the studies skip at `delta`, `attn_out` and `mlp_out`).
        layer: int in 0..L-1, or negative from the end (-1 is the last layer). An int array of
            them stacks interventions for `vmap`; a traced index sweeps layers in one program.
            Out of range is an `InterventionError` (module docstring, "Layer indices").
        positions: float `[T]` or `[B, T]`: 1 skips, 0 keeps (fractions scale).

    Example: `skip("delta", 3, np.arange(T) >= 1)` skips layer 3 at every position but the first.
    """
    return Intervention(
        site, _skip, (jnp.asarray(layer, jnp.int32), jnp.asarray(positions, jnp.float32)), layer_index=0
    )


def _replace(value, layer, data):
    at, positions, new = data
    _check_broadcast(new.shape, value.shape, "the replacement value")
    hit = (layer == at) & (positions > 0)
    return jnp.where(_expand(hit, value) > 0, jnp.broadcast_to(new, value.shape).astype(value.dtype), value)


def replace(site: str, layer, positions, value) -> Intervention:
    """Replace the value at `site` of one layer by `value` where `positions` is > 0.

    Args:
        site: a name of `SITES`.
        layer: int in 0..L-1, or negative from the end (-1 is the last layer); at `resid_pre`,
            L is the final residual h_L. An int array of them stacks interventions for `vmap`.
            Out of range is an `InterventionError` (module docstring, "Layer indices").
        positions: `[T]` or `[B, T]`; where > 0 the value is replaced.
        value: a float array broadcast to the site's value (`[B, T, D]` at a residual, `[D]`
            for one vector everywhere, `[B, T, H, Dh]` at `head_out`, ...).

    Example: `replace("resid_pre", 3, np.arange(T) == 5, mean_h3)` erases position 5 of h_3.
    """
    return Intervention(
        site,
        _replace,
        (jnp.asarray(layer, jnp.int32), jnp.asarray(positions, jnp.float32), _float(value, "the replacement value")),
        layer_index=0,
    )


def _add(value, layer, data):
    at, positions, vector = data
    _check_broadcast(vector.shape, value.shape, "the added vector")
    return value + jnp.where(layer == at, 1.0, 0.0) * _expand(positions, value) * vector.astype(value.dtype)


def add(site: str, layer, vector, positions) -> Intervention:
    """Add `vector` to the value at `site` of one layer, scaled per position: steering.

    Args:
        site: a name of `SITES`.
        layer: int in 0..L-1, or negative from the end (-1 is the last layer); at `resid_pre`,
            L is the final residual h_L. An int array of them stacks interventions for `vmap`.
            Out of range is an `InterventionError` (module docstring, "Layer indices").
        vector: a float array broadcast to the site's value, e.g. `[D]` (one steering vector) or
            `[B, T, D]`.
        positions: `[T]` or `[B, T]`, the scale of the addition per position (1 adds, 0 not).

    Example: `add("resid_post", -1, 4.0 * direction, np.ones(T))` steers the last layer's output.
    """
    return Intervention(
        site,
        _add,
        (jnp.asarray(layer, jnp.int32), jnp.asarray(positions, jnp.float32), _float(vector, "the added vector")),
        layer_index=0,
    )


def _add_rows(value, layer, rows):
    return value + rows[layer].astype(value.dtype)


def probe(site: str, rows) -> Intervention:
    """A gradient probe: at every layer l, add `rows[l]` to the value at `site` (`rows` `[L,
    ...]`, each row broadcastable to the site's value; `[L+1, ...]` at `resid_pre` also reaches
    the final residual). Zeros change nothing, and the gradient of a function of the run with
    respect to `rows` is its gradient at the site, after the interventions before it."""
    return Intervention(site, _add_rows, rows, layer_data=True)


def _patch(value, layer, data):
    cached, where = data
    row = cached[layer]
    if row.ndim != value.ndim or row.shape[2:] != value.shape[2:]:
        raise InterventionError(
            f"a row of cached has shape {row.shape}; the site's value is {value.shape} "
            f"(rows must be [B, T, {', '.join(map(str, value.shape[2:]))}], B and T may be 1)"
        )
    _check_broadcast(row.shape, value.shape, "a row of cached")
    _check_broadcast(where[layer].shape, value.shape, "a row of where")
    return jnp.where(where[layer], row.astype(value.dtype), value)


def patch(site: str, cached, where) -> Intervention:
    """Activation patching: at every layer l, take the value cached from another run where
    `where[l]` is true.

    Args:
        site: a name of `SITES`.
        cached: float `[L, B, T, ...]`, the other run's values at the site, one row per layer
            (e.g. the tap of `run_layers` returning that site; B and T may be 1 to broadcast).
            At `resid_pre`, `[L+1, ...]` data (every boundary, e.g. `residual_stream` of the
            other run) also patches the final residual h_L with its last row; `[L, ...]` data
            leaves h_L alone.
        where: bool, one row per layer, each row broadcastable to the site's value: e.g.
            `[L, 1, T, 1]` for positions, `[L, 1, 1, H, 1]` for heads at `head_out`.

    Sweeps (each layer, position or head patched alone) stack `where` on a leading axis and
    `vmap` over it.
    """
    return Intervention(site, _patch, (_float(cached, "cached"), jnp.asarray(where, bool)), layer_data=True)


def _ablate_heads(value, layer, data):
    heads, means = data
    H, Dh = value.shape[2:]
    if heads.shape[1:] != (H,) or means.shape[1:] != (H, Dh):
        raise InterventionError(f"heads must be [L, {H}] and means [L, {H}, {Dh}], got {heads.shape} and {means.shape}")
    hit = heads[layer][None, None, :, None]
    return jnp.where(hit > 0, means[layer][None, None].astype(value.dtype), value)


def ablate_heads(heads, means: Optional[Any] = None, *, head_dim: Optional[int] = None) -> Intervention:
    """Ablate attention heads at `head_out`, at every position.

    Args:
        heads: `[L, H]`; where `heads[l, h]` > 0, head h of layer l is ablated.
        means: float `[L, H, Dh]`, what an ablated head outputs instead (mean ablation: e.g. the
            head's mean output over a dataset, from a tap of `head_out`); None for zero
            ablation, which then needs `head_dim`.
        head_dim: Dh, for zero ablation only.

    Example: `ablate_heads(np.eye(L, H), means=dataset_means)` mean-ablates head l of each
    layer l; stack `heads` on a leading axis and `vmap` to sweep over heads.
    """
    heads = jnp.asarray(heads, jnp.float32)
    if means is None:
        if head_dim is None:
            raise ValueError("zero ablation needs head_dim (or give the means)")
        means = jnp.zeros(heads.shape + (head_dim,), jnp.float32)
    return Intervention("head_out", _ablate_heads, (heads, _float(means, "means")), layer_data=True)
