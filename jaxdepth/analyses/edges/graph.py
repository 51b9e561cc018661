"""The computational graph of a decoder as writers and readers of the residual stream.

Writers put a vector into the residual stream: the token embedding (`input`), every attention
head's output (`a{l}.h{h}`: head h's slice of o_proj applied to its output) and every MLP's
output (`m{l}`). Readers take the residual stream as their input, each through its own
normalization: every query head's query, key and value inputs (`a{l}.h{h}<q>`, `<k>`, `<v>`;
with grouped-query attention the key and value readers of a query head use its group's
weights), every MLP's input (`m{l}`) and the logits (`logits`, through the final norm). The
names follow the EAP-IG package's.

An edge u -> v exists when u writes before v reads: the embedding feeds every reader, the heads
of layer l feed the MLP of layer l and every reader of later layers, the MLP of layer l every
reader of later layers. In a parallel block (GPT-NeoX) the MLP of layer l reads the layer's
input beside its heads, so the heads of layer l do not feed it. The residual input of reader v
is the sum of its writers' outputs, so a model is exactly the sum over its edges
(`jaxdepth.analyses.edges.forward`).

Writers are numbered `0` (input), then per layer its H heads and its MLP
(`1 + l (H + 1) + h`, `1 + l (H + 1) + H`); readers per layer its H query, H key, H value
readers and its MLP (`l (3H + 1) + ...`), and last the logits.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from jaxdepth.core.config import ModelConfig

__all__ = [
    "EdgeGraph",
    "READER_KINDS",
]

READER_KINDS = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class EdgeGraph:
    """The writers, readers and edges of a decoder of `num_layers` layers with `num_heads`
    query heads. Build it with `EdgeGraph.of(config)`."""

    num_layers: int
    num_heads: int
    parallel: bool = False  # each layer's MLP reads the layer's input, beside its heads

    @classmethod
    def of(cls, config: ModelConfig) -> "EdgeGraph":
        """The graph of a model of `config`."""
        return cls(config.num_layers, config.num_heads, config.parallel_residual)

    # ------------------------------------------------------------------ sizes and indices

    @property
    def writers_per_layer(self) -> int:
        """H + 1: the heads and the MLP."""
        return self.num_heads + 1

    @property
    def readers_per_layer(self) -> int:
        """3H + 1: each head's q, k and v inputs, and the MLP's input."""
        return 3 * self.num_heads + 1

    @property
    def num_writers(self) -> int:
        """W = 1 + L (H + 1)."""
        return 1 + self.num_layers * self.writers_per_layer

    @property
    def num_readers(self) -> int:
        """R = L (3H + 1) + 1."""
        return self.num_layers * self.readers_per_layer + 1

    def head_writer(self, layer: int, head: int) -> int:
        """The writer index of head `head` of layer `layer`."""
        return 1 + layer * self.writers_per_layer + head

    def mlp_writer(self, layer: int) -> int:
        """The writer index of the MLP of layer `layer`."""
        return 1 + layer * self.writers_per_layer + self.num_heads

    def head_reader(self, layer: int, head: int, kind: str) -> int:
        """The reader index of query head `head`'s `kind` ('q', 'k' or 'v') input in layer `layer`."""
        return layer * self.readers_per_layer + READER_KINDS.index(kind) * self.num_heads + head

    def mlp_reader(self, layer: int) -> int:
        """The reader index of the MLP input of layer `layer`."""
        return layer * self.readers_per_layer + 3 * self.num_heads

    @property
    def logits_reader(self) -> int:
        """The reader index of the logits (the last reader)."""
        return self.num_layers * self.readers_per_layer

    # ------------------------------------------------------------------ which edges exist

    @functools.cached_property
    def writer_nodes(self) -> np.ndarray:
        """`[W]`: each writer's node, its place in the order of computation: 0 the input, 2l + 1
        the heads of layer l, 2l + 2 the MLP of layer l (`edge_forward`'s `shift` names nodes so)."""
        w = np.arange(self.num_writers)
        layer, slot = np.divmod(np.maximum(w - 1, 0), self.writers_per_layer)
        return np.where(w == 0, 0, 2 * layer + 1 + (slot == self.num_heads))

    @functools.cached_property
    def reader_nodes(self) -> np.ndarray:
        """`[R]`: the node each reader starts: 2l + 1 for the heads' inputs of layer l, 2l + 2 for
        its MLP's input (2l + 1 in a parallel block, where it reads what the heads read), 2L + 1
        for the logits. A writer feeds every reader of a later node."""
        r = np.arange(self.num_readers)
        layer, slot = np.divmod(r, self.readers_per_layer)
        mlp = (slot == 3 * self.num_heads) & (not self.parallel)
        return np.where(r == self.logits_reader, 2 * self.num_layers + 1, 2 * layer + 1 + mlp)

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
        return min(int(reader) // self.readers_per_layer, self.num_layers)

    # ------------------------------------------------------------------ names

    def writer_name(self, w: int) -> str:
        """'input', 'a{l}.h{h}' or 'm{l}'."""
        w = int(w)
        if w == 0:
            return "input"
        layer, h = divmod(w - 1, self.writers_per_layer)
        return f"m{layer}" if h == self.num_heads else f"a{layer}.h{h}"

    def reader_name(self, r: int) -> str:
        """'a{l}.h{h}<q>' (or <k>, <v>), 'm{l}' or 'logits'."""
        r = int(r)
        if r == self.logits_reader:
            return "logits"
        layer, i = divmod(r, self.readers_per_layer)
        if i == 3 * self.num_heads:
            return f"m{layer}"
        kind, h = divmod(i, self.num_heads)
        return f"a{layer}.h{h}<{READER_KINDS[kind]}>"

    def edge_name(self, w: int, r: int) -> str:
        """'writer->reader'."""
        return f"{self.writer_name(w)}->{self.reader_name(r)}"

    def writer_index(self, name: str) -> int:
        """The index of the writer named `name` (a ValueError for no writer of the graph)."""
        if name == "input":
            return 0
        layer, head = self._parse_node(name, "writer")
        return self.mlp_writer(layer) if head is None else self.head_writer(layer, head)

    def reader_index(self, name: str) -> int:
        """The index of the reader named `name` (a ValueError for no reader of the graph)."""
        if name == "logits":
            return self.logits_reader
        match = re.fullmatch(r"(a\d+\.h\d+)<([qkv])>", name)
        if match:
            layer, head = self._parse_node(match.group(1), "reader")
            return self.head_reader(layer, head, match.group(2))
        layer, head = self._parse_node(name, "reader")
        if head is not None:
            raise ValueError(f"reader {name!r}: a head reads its query, key or value: {name}<q>, <k> or <v>")
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

    def _parse_node(self, name: str, role: str) -> tuple[int, int | None]:
        match = re.fullmatch(r"m(\d+)|a(\d+)\.h(\d+)", name)
        if not match:
            raise ValueError(
                f"unknown {role} {name!r}: writers are input, a<layer>.h<head> and m<layer>; readers "
                "a<layer>.h<head><q|k|v>, m<layer> and logits"
            )
        layer = int(match.group(1) or match.group(2))
        head = None if match.group(1) else int(match.group(3))
        if not 0 <= layer < self.num_layers or (head is not None and not 0 <= head < self.num_heads):
            raise ValueError(
                f"{role} {name!r} is outside the model: layers 0..{self.num_layers - 1}, heads 0..{self.num_heads - 1}"
            )
        return layer, head

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
