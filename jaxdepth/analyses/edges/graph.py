"""The computational graph of a decoder as writers and readers of the residual stream.

Nothing here is kept by hand: a layer's writers and readers are the sites that declare the role
(`jaxdepth.core.sites.Role`, next to each site in `jaxdepth.core.sites.SITE_TABLE`), numbered in
the table's order, a per-head role once per query head; the model adds its ends, the embedding
(a writer) and the logits (a reader); the config says which roles hold (`post_norms`) and where
a sublayer reads (`parallel`). What follows is what the roles declare today.

Writers are what the residual stream receives: the token embedding (`input`), every attention
head's output (`a{l}.h{h}`: head h's slice of o_proj applied to its output) and every MLP's
output (`m{l}`). In a family with norms after the sublayers (Gemma 2/3, OLMo 2:
`EdgeGraph.post_norms`) the stream receives a layer's attention output only after its norm, a
normalised sum of the heads, of which no head writes a part of its own: there a layer's
attention is one writer (`a{l}`, its whole output after the norm; the MLP's writer is its output
after its norm, as everywhere). `EdgeGraph.attention_writers` (H, or 1) is the one number every
piece of the edges reads.

Readers take the residual stream as their input, each through its own normalization (OLMo 2 has
none before the sublayers: there a reader reads the stream itself): every query head's query,
key and value inputs (`a{l}.h{h}<q>`, `<k>`, `<v>`; with grouped-query attention the key and
value readers of a query head use its group's weights), every MLP's input (`m{l}`) and the
logits (`logits`, through the final norm). Readers are the same in every family. The names
follow the EAP-IG package's.

An edge u -> v exists when u writes before v reads: the embedding feeds every reader, the
attention writers of layer l feed the MLP of layer l and every reader of later layers, the MLP
of layer l every reader of later layers. In a parallel block (GPT-NeoX) the MLP of layer l reads
the layer's input beside its heads, so the heads of layer l do not feed it. The residual input
of reader v is the sum of its writers' outputs, in both graphs, so a model is exactly the sum
over its edges (`jaxdepth.analyses.edges.readers.edge_run`).

A linear-attention layer (Qwen3.5's gated DeltaNet, `EdgeGraph.linear_layers`) has the same
writers and readers, per value head (`linear_heads` of them): head h's output through its rows
of the output projection (`a{l}.h{h}`), and its query, key and value inputs (`a{l}.h{h}<q>`,
`<k>`, `<v>`): from the first it reads its key head's query channels and its output gate, from
the second its key head's key channels, beta and the decay, from the third its value channels
(`jaxdepth.core.linear_attention.gated_delta_net_heads`).

Writers are numbered `0` (input), then per layer its A attention writers (A =
`attention_writers`: the H heads, or the one output after the norm) and its MLP
(`1 + l (A + 1) + h`, `1 + l (A + 1) + A`); readers per layer its H query, H key, H value
readers and its MLP (`l (3H + 1) + ...`), and last the logits. Where layers have heads of
different counts (a linear layer's value heads beside attention's query heads) each layer's
writers and readers follow the layer before's (`first_writer`, `first_reader`); the runs then
compute in the layout of a graph with the most heads in every layer (`EdgeGraph.padded`), where
each writer and reader has its index `padded_writers`, `padded_readers`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Optional, Union

import jax.numpy as jnp
import numpy as np

from jaxdepth.core.config import ModelConfig
from jaxdepth.core.sites import SITE_TABLE

__all__ = [
    "EdgeGraph",
    "READER_KINDS",
]

# The sublayers in the order a layer computes them, as the sites' roles name them, and the
# prefix of their nodes' names (the EAP-IG package's: `a3.h1`, `m2`).
_SUBLAYERS = ("attention", "mlp")
_PREFIX = {"attention": "a", "mlp": "m"}


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One writer or reader of a layer: the site whose role it is, its sublayer, its query head
    (None: one for the sublayer) and its tag ('q', 'k', 'v' of a head's input; '' else)."""

    site: str
    sublayer: str
    head: Optional[int]
    tag: str

    def name(self, layer: int) -> str:
        """'a{l}.h{h}', 'a{l}' or 'm{l}', then '<tag>' for a head's input."""
        head = "" if self.head is None else f".h{self.head}"
        return f"{_PREFIX[self.sublayer]}{layer}{head}" + (f"<{self.tag}>" if self.tag else "")


def _slots(acts: str, num_heads: int, post_norms: bool) -> tuple[_Slot, ...]:
    """The writers (`acts='writes'`) or readers (`'reads'`) of one layer, from the roles of the
    sites (`jaxdepth.core.sites.SITE_TABLE`), in the table's order, a per-head role's heads in
    order: what numbers them."""
    return tuple(
        _Slot(site.name, site.role.sublayer, head, site.role.tag)
        for site in SITE_TABLE
        if site.role is not None and site.role.acts == acts and site.role.holds(post_norms)
        for head in (range(num_heads) if site.role.per_head else (None,))
    )


# The tags of the heads' inputs, in the order of their sites: ('q', 'k', 'v').
READER_KINDS = tuple(
    site.role.tag for site in SITE_TABLE if site.role is not None and site.role.acts == "reads" and site.role.per_head
)


def _refuse_gemma4_edges(config: ModelConfig) -> None:
    """Refuse the edge graph of a model with Gemma 4's features: per-layer inputs (a third writer
    of each layer), a layer scalar (a layer's output is not h + a + m), keys and values shared
    among layers (a key reader of one layer read by another), full-attention layers of their
    own head shapes; the graph's writers and readers do not model them (edge attribution,
    circuits, AtP*)."""
    features = dict(
        per_layer_inputs=config.per_layer_input_size,
        layer_scalar=config.layer_scalar,
        shared_kv_layers=config.shared_kv_layers,
        global_layers=config.global_layers,
    )
    if any(features.values()):
        raise ValueError(
            f"the edge graph of a model with Gemma 4's {', '.join(k for k, v in features.items() if v)} is not "
            "implemented (edge attribution, circuits, AtP*): its writers and readers do not model them"
        )


@dataclasses.dataclass(frozen=True)
class EdgeGraph:
    """The writers, readers and edges of a decoder of `num_layers` layers with `num_heads`
    query heads. Build it with `EdgeGraph.of(config)`. `parallel`: each layer's MLP reads the
    layer's input, beside its heads (GPT-NeoX). `post_norms`: norms after the sublayers, so
    that each layer's attention writes one vector, its output after the norm (Gemma 2/3,
    OLMo 2: `attention_writers` is 1). `linear_layers`: the layers of linear attention (Qwen3.5's
    gated DeltaNet), whose heads are its `linear_heads` value heads, each with a writer and
    q, k and v readers as an attention head has (`jaxdepth.core.linear_attention.gated_delta_net_heads`
    says what each reads). The writers and readers of a layer are the sites whose
    `jaxdepth.core.sites.Role` holds in it, in the order of `jaxdepth.core.sites.SITE_TABLE`,
    a per-head role once per head of the layer (`heads_of`)."""

    num_layers: int
    num_heads: int
    parallel: bool = False  # each layer's MLP reads the layer's input, beside its heads
    post_norms: bool = False  # a layer's attention is one writer: its output after the norm
    linear_layers: tuple = ()  # the layers of linear attention, whose heads are value heads
    linear_heads: int = 0  # the value heads of a linear-attention layer

    def __post_init__(self):
        # (a saved result reads the layers back as a list: a graph is hashable, a static argument)
        object.__setattr__(self, "linear_layers", tuple(int(i) for i in self.linear_layers))

    @classmethod
    def of(cls, config: ModelConfig) -> "EdgeGraph":
        """The graph of a model of `config`; refused for Gemma 4's features (`_refuse_gemma4_edges`)."""
        _refuse_gemma4_edges(config)
        linear = (config.linear_layers, config.linear_value_heads) if config.mixed_mixers else ((), 0)
        return cls(config.num_layers, config.num_heads, config.parallel_residual, config.post_norms, *linear)

    @classmethod
    def of_result(cls, result) -> "EdgeGraph":
        """The graph a result records in fields of the graph's own names (`EdgeScores`,
        `Circuit`: `num_layers`, `num_heads`, `parallel`, `post_norms`, `linear_layers`,
        `linear_heads`)."""
        return cls(**{field.name: getattr(result, field.name) for field in dataclasses.fields(cls)})

    def fields(self) -> dict:
        """The graph's fields by name, as a result records them (`of_result` reads them back)."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    # ------------------------------------------------------------------ one layer, from the roles

    def heads_of(self, layer: int) -> int:
        """The heads of layer `layer`: its query heads, or a linear-attention layer's value heads."""
        return self.linear_heads if int(layer) in self.linear_layers else self.num_heads

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same heads: then the graph is its own `padded` layout."""
        return not self.linear_layers or self.linear_heads == self.num_heads

    @functools.cached_property
    def padded(self) -> "EdgeGraph":
        """The graph of the layout a run computes in: every layer with `slots` heads (a split
        layer's sites hold that many rows, `jaxdepth.core.config.ModelConfig.split_heads`), the
        heads beyond a layer's own writing zeros and read by nothing. The index of each of this
        graph's writers and readers there: `padded_writers`, `padded_readers`."""
        if self.uniform:
            return self
        return EdgeGraph(self.num_layers, self.slots, self.parallel, self.post_norms)

    @property
    def slots(self) -> int:
        """The most heads of any layer: the rows of a split layer's per-head sites."""
        return max(self.num_heads, self.linear_heads) if self.linear_layers else self.num_heads

    @functools.cached_property
    def _layer_writers(self) -> tuple[tuple[_Slot, ...], ...]:
        return tuple(_slots("writes", self.heads_of(layer), self.post_norms) for layer in range(self.num_layers))

    @functools.cached_property
    def _layer_readers(self) -> tuple[tuple[_Slot, ...], ...]:
        return tuple(_slots("reads", self.heads_of(layer), self.post_norms) for layer in range(self.num_layers))

    @functools.cached_property
    def _writer_starts(self) -> np.ndarray:
        """`[L + 1]`: the index of each layer's first writer (the input is writer 0), then W."""
        return 1 + np.concatenate([[0], np.cumsum([len(slots) for slots in self._layer_writers])])

    @functools.cached_property
    def _reader_starts(self) -> np.ndarray:
        """`[L + 1]`: the index of each layer's first reader, then the logits'."""
        return np.concatenate([[0], np.cumsum([len(slots) for slots in self._layer_readers])])

    def _sublayer_nodes(self, layer: int, slots: tuple[_Slot, ...], reads: bool) -> np.ndarray:
        """The node of each slot of layer `layer`: 1 + l S + s for sublayer s of S, where a
        writer's sublayer writes and a reader's starts; in a parallel block every sublayer reads
        the layer's input, so its readers all start the layer's first node."""
        sublayer = np.array([_SUBLAYERS.index(slot.sublayer) for slot in slots])
        if reads and self.parallel:
            sublayer = np.zeros_like(sublayer)
        return 1 + len(_SUBLAYERS) * layer + sublayer

    def _reader_offset(self, layer: int, sublayer: str, tag: str = "") -> int:
        """The place in layer `layer`'s readers of the first (head 0's) reader of `sublayer`
        tagged `tag`."""
        for i, slot in enumerate(self._layer_readers[layer]):
            if (slot.sublayer, slot.tag) == (sublayer, tag):
                return i
        raise ValueError(f"no reader {_PREFIX[sublayer]}<layer>{'<' + tag + '>' if tag else ''}: kinds {READER_KINDS}")

    @staticmethod
    def _feeds(writers: tuple[_Slot, ...], reader: _Slot) -> int:
        """The place among a layer's `writers` of the writer whose computation `reader` feeds: its
        head's, or its sublayer's one writer."""
        for i, slot in enumerate(writers):
            if slot.sublayer == reader.sublayer and slot.head in (reader.head, None):
                return i
        raise ValueError(f"no writer of {reader.sublayer} is fed by {reader.site}")

    # ------------------------------------------------------------------ sizes and indices

    @functools.cached_property
    def attention_writers(self) -> int:
        """A: the writers of one layer's attention: its H heads, or 1 (its whole output after
        the post-attention norm) where `post_norms`; among linear-attention layers, those of
        an attention layer (a linear one has `len(layer_attention_writers(l))`)."""
        return len(_slots("writes", self.num_heads, self.post_norms)) - 1

    @property
    def writers_per_layer(self) -> int:
        """A + 1: the attention's writers (`attention_writers`) and the MLP (a graph whose layers
        all have the same heads: `uniform`)."""
        self._refuse_mixed("writers_per_layer", "first_writer(l + 1) - first_writer(l)")
        return len(self._layer_writers[0])

    @property
    def readers_per_layer(self) -> int:
        """3H + 1: each head's q, k and v inputs, and the MLP's input (a `uniform` graph)."""
        self._refuse_mixed("readers_per_layer", "the readers of layer l, first_reader(l)..first_reader(l + 1)")
        return len(self._layer_readers[0])

    def _refuse_mixed(self, what: str, instead: str) -> None:
        if not self.uniform:
            raise ValueError(f"{what}: the layers of this graph have heads of different counts; use {instead}")

    @property
    def num_writers(self) -> int:
        """W = 1 + L (A + 1): L (H + 1) + 1, or 2L + 1 where `post_norms` (each layer with its own heads)."""
        return int(self._writer_starts[-1])

    @property
    def num_readers(self) -> int:
        """R = L (3H + 1) + 1 (each layer with its own heads)."""
        return int(self._reader_starts[-1]) + 1

    def attention_writer(self, layer: int, head: Optional[int] = None) -> int:
        """The writer index of layer `layer`'s attention: of its head `head`, or, where
        `post_norms`, of its one output (`head` None). A ValueError for a head where heads
        write no vector of their own, and for no head where they do."""
        heads_write = not self.post_norms
        if heads_write == (head is None):
            raise ValueError(self._attention_writer_error(f"a{layer}" + ("" if head is None else f".h{head}")))
        return self.first_writer(layer) + (0 if head is None else head)

    def head_writer(self, layer: int, head: int) -> int:
        """The writer index of head `head` of layer `layer` (a graph whose heads write: not
        `post_norms`, where `attention_writer(layer)` is the layer's one)."""
        return self.attention_writer(layer, head)

    def first_writer(self, layer):
        """The index of layer `layer`'s first attention writer; its attention writers follow,
        then its MLP (`layer` may be traced)."""
        if isinstance(layer, (int, np.integer)):
            return int(self._writer_starts[layer])
        return jnp.asarray(self._writer_starts, jnp.int32)[layer]

    def first_reader(self, layer: int) -> int:
        """The index of layer `layer`'s first reader (at L: the logits)."""
        return int(self._reader_starts[layer])

    def layer_attention_writers(self, layer: int) -> np.ndarray:
        """The writer indices of layer `layer`'s attention (its node)."""
        count = sum(slot.sublayer == "attention" for slot in self._layer_writers[layer])
        return self.first_writer(layer) + np.arange(count)

    def mlp_writer(self, layer: int) -> int:
        """The writer index of the MLP of layer `layer` (`layer` may be traced): the layer's last
        (the MLP writes after the attention)."""
        return self.first_writer(layer + 1) - 1

    def head_reader(self, layer: int, head: int, kind: str) -> int:
        """The reader index of head `head`'s `kind` ('q', 'k' or 'v') input in layer `layer`."""
        return self.first_reader(layer) + self._reader_offset(layer, "attention", kind) + head

    def mlp_reader(self, layer: int) -> int:
        """The reader index of the MLP input of layer `layer`."""
        return self.first_reader(layer) + self._reader_offset(layer, "mlp")

    @property
    def logits_reader(self) -> int:
        """The reader index of the logits (the last reader)."""
        return int(self._reader_starts[-1])

    # ------------------------------------------------------------------ the padded layout

    @functools.cached_property
    def padded_writers(self) -> np.ndarray:
        """`[W]`: each writer's index in the `padded` graph (the identity in a `uniform` graph)."""
        return np.concatenate([[0], *(self._padded_slots(layer, False) for layer in range(self.num_layers))])

    @functools.cached_property
    def padded_readers(self) -> np.ndarray:
        """`[R]`: each reader's index in the `padded` graph (the identity in a `uniform` graph)."""
        layers = [self._padded_slots(layer, True) for layer in range(self.num_layers)]
        return np.concatenate([*layers, [self.padded.logits_reader]])

    def _padded_slots(self, layer: int, reads: bool) -> np.ndarray:
        """The `padded` graph's index of each writer (reader) of layer `layer`: the slot of the
        same site and head."""
        padded = self.padded
        own = (self._layer_readers if reads else self._layer_writers)[layer]
        theirs = (padded._layer_readers if reads else padded._layer_writers)[layer]
        start = padded.first_reader(layer) if reads else padded.first_writer(layer)
        where = {(slot.site, slot.head): i for i, slot in enumerate(theirs)}
        return np.array([start + where[slot.site, slot.head] for slot in own], np.int64)

    # ------------------------------------------------------------------ which edges exist

    @functools.cached_property
    def writer_nodes(self) -> np.ndarray:
        """`[W]`: each writer's node, its place in the order of computation: 0 the input, 2l + 1
        the attention of layer l (its heads, or its one writer), 2l + 2 the MLP of layer l
        (`readers.shift_node` names nodes so)."""
        per_layer = [self._sublayer_nodes(l, slots, False) for l, slots in enumerate(self._layer_writers)]  # noqa: E741
        return np.concatenate([[0], *per_layer]).astype(np.int64)

    @functools.cached_property
    def reader_nodes(self) -> np.ndarray:
        """`[R]`: the node each reader starts: 2l + 1 for the heads' inputs of layer l, 2l + 2 for
        its MLP's input (2l + 1 in a parallel block, where it reads what the heads read), 2L + 1
        for the logits. A writer feeds every reader of a later node."""
        logits = 1 + len(_SUBLAYERS) * self.num_layers
        per_layer = [self._sublayer_nodes(l, slots, True) for l, slots in enumerate(self._layer_readers)]  # noqa: E741
        return np.concatenate([*per_layer, [logits]]).astype(np.int64)

    @functools.cached_property
    def reader_writers(self) -> np.ndarray:
        """`[R]`: the writer whose computation each reader feeds (its node's output): a head's q,
        k and v inputs feed that head (the layer's one attention writer where `post_norms`), an
        MLP's input its MLP; -1 for the logits, which feed no writer. A circuit's path runs
        writer -> reader -> that reader's writer -> ..."""
        per_layer = [
            [self.first_writer(layer) + self._feeds(self._layer_writers[layer], slot) for slot in readers]
            for layer, readers in enumerate(self._layer_readers)
        ]
        return np.concatenate([*map(np.asarray, per_layer), [-1]]).astype(np.int64)

    @functools.cached_property
    def edge_mask(self) -> np.ndarray:
        """`[W, R]` bool: whether writer w feeds reader r."""
        return self.writer_nodes[:, None] < self.reader_nodes[None, :]

    @property
    def num_edges(self) -> int:
        """How many edges the graph has."""
        return int(self.edge_mask.sum())

    def reader_layer(self, reader: int) -> int:
        """The layer whose computation reader `reader` starts (L for the logits)."""
        return int(np.searchsorted(self._reader_starts, int(reader), side="right")) - 1

    def _writer_place(self, w: int) -> tuple[int, int]:
        """`(layer, slot)` of writer `w` > 0."""
        layer = int(np.searchsorted(self._writer_starts, w, side="right")) - 1
        return layer, w - int(self._writer_starts[layer])

    # ------------------------------------------------------------------ names

    def writer_name(self, w: int) -> str:
        """'input', 'a{l}.h{h}' (a head; 'a{l}' where `post_norms`: the layer's attention) or 'm{l}'."""
        w = int(w)
        if w == 0:
            return "input"
        layer, slot = self._writer_place(w)
        return self._layer_writers[layer][slot].name(layer)

    def reader_name(self, r: int) -> str:
        """'a{l}.h{h}<q>' (or <k>, <v>), 'm{l}' or 'logits'."""
        r = int(r)
        if r == self.logits_reader:
            return "logits"
        layer = self.reader_layer(r)
        return self._layer_readers[layer][r - self.first_reader(layer)].name(layer)

    def edge_name(self, w: int, r: int) -> str:
        """'writer->reader'."""
        return f"{self.writer_name(w)}->{self.reader_name(r)}"

    def writer_index(self, name: str) -> int:
        """The index of the writer named `name` (a ValueError for no writer of the graph)."""
        if name == "input":
            return 0
        layer, head = self._parse_node(name, "writer")
        if head == "mlp":
            return self.mlp_writer(layer)
        return self.attention_writer(layer, head)

    def reader_index(self, name: str) -> int:
        """The index of the reader named `name` (a ValueError for no reader of the graph)."""
        if name == "logits":
            return self.logits_reader
        match = re.fullmatch(rf"(a\d+\.h\d+)<({'|'.join(READER_KINDS)})>", name)
        if match:
            layer, head = self._parse_node(match.group(1), "reader")
            return self.head_reader(layer, head, match.group(2))
        layer, head = self._parse_node(name, "reader")
        if head != "mlp":
            head_name = name if head is not None else f"a{layer}.h<head>"
            raise ValueError(f"reader {name!r}: a head reads its query, key or value: {head_name}<q>, <k> or <v>")
        return self.mlp_reader(layer)

    def edge_index(self, name: str) -> tuple[int, int]:
        """`(writer, reader)` of an edge named `'u->v'` (e.g. `'a3.h1->a5.h0<k>'`, `'m2->logits'`);
        a ValueError for a name that is no edge of this graph."""
        if name.count("->") != 1:
            raise ValueError(f"an edge is named 'writer->reader', e.g. 'a0.h1->m2', got {name!r}")
        u, v = name.split("->")
        w, r = self.writer_index(u.strip()), self.reader_index(v.strip())
        if not self.edge_mask[w, r]:
            raise ValueError(f"there is no edge {name!r}: {u} does not write before {v} reads")
        return w, r

    def _parse_node(self, name: str, role: str) -> tuple[int, Union[int, str, None]]:
        """`(layer, head)` of a node named 'm{l}' (head 'mlp'), 'a{l}.h{h}' (head h) or 'a{l}'
        (head None: a layer's attention)."""
        match = re.fullmatch(r"m(\d+)|a(\d+)(?:\.h(\d+))?", name)
        if not match:
            attention = "a<layer>" if self.post_norms else "a<layer>.h<head>"
            raise ValueError(
                f"unknown {role} {name!r}: writers are input, {attention} and m<layer>; readers "
                "a<layer>.h<head><q|k|v>, m<layer> and logits"
            )
        layer = int(match.group(1) or match.group(2))
        head = "mlp" if match.group(1) else (None if match.group(3) is None else int(match.group(3)))
        if not 0 <= layer < self.num_layers or (isinstance(head, int) and not 0 <= head < self.heads_of(layer)):
            heads = self.heads_of(layer) if 0 <= layer < self.num_layers else self.num_heads
            raise ValueError(
                f"{role} {name!r} is outside the model: layers 0..{self.num_layers - 1}, heads 0..{heads - 1}"
                + (" (in that layer)" if not self.uniform else "")
            )
        return layer, head

    def _attention_writer_error(self, name: str) -> str:
        """Why `name` names no writer of this graph's attention."""
        if self.post_norms:
            layer = name.split(".")[0]
            return (
                f"{name!r} is no writer: this model's norm after attention makes a layer's output a normalised sum "
                f"of its heads, so the layer's attention writes as one, {layer!r}"
            )
        return f"{name!r} is no writer: each head of a layer writes its own output, {name}.h<head>"

    def check_edge(self, w, r) -> tuple[int, int]:
        """`(w, r)` as ints, or a ValueError when writer w does not feed reader r in this graph."""
        w, r = int(w), int(r)
        if not (0 <= w < self.num_writers and 0 <= r < self.num_readers and self.edge_mask[w, r]):
            raise ValueError(f"({w}, {r}) is not an edge of the graph")
        return w, r

    def edges_mask(self, edges) -> np.ndarray:
        """`[W, R]` bool of a set of edges, given as names, `(writer, reader)` index pairs or a
        `[W, R]` bool mask (checked: only edges of the graph)."""
        if isinstance(edges, np.ndarray) and edges.dtype == bool:
            if edges.shape != self.edge_mask.shape:
                raise ValueError(f"an edge mask must be [W, R] = {self.edge_mask.shape}, got {edges.shape}")
            if np.any(edges & ~self.edge_mask):
                w, r = np.argwhere(edges & ~self.edge_mask)[0]
                raise ValueError(f"the mask holds {self.edge_name(w, r)}, which is not an edge of the graph")
            return edges
        mask = np.zeros(self.edge_mask.shape, bool)
        for edge in edges:
            w, r = self.edge_index(edge) if isinstance(edge, str) else self.check_edge(*edge)
            mask[w, r] = True
        return mask
