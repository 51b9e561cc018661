"""The order of the layers as data: which layers a run applies, in which order, and which of
them run side by side (Gromov et al., arXiv 2403.17887; Lad, Gurnee and Tegmark, arXiv
2406.19384; Sun et al., arXiv 2407.09298).

A `LayerOrder` is a sequence of steps, each a group of layer indices into the stacked weights
(`layers [N, G]`, with `used [N, G]` marking the real entries):

- a step of one layer sets the residual to that layer's output, bit for bit what the plain
  forward does;
- a step of several layers (a parallel group) gives each the same input h and adds their
  contributions: h + sum_g (layer_g(h) - h);
- a step of none leaves the residual unchanged (padding: orders of different lengths stack
  into one array, `stack_orders`, and `vmap` over it).

The identity order is `[0, 1, ..., L-1]`; a dropped layer is a missing step; a repeated layer
appears twice. Interventions address layers by their original index (an intervention on layer
3 acts wherever layer 3 runs, every time it runs); the embedding, final norm and head are
unchanged. `run_layers(run=LayerRun(order=...))` runs an order (`jaxdepth.core.loops`).

Many concrete orders run together either as a vmapped stack (`stack_orders`: each order runs
its own layer on its own rows, so every step reads each order's copy of that layer's weights)
or layer-major (`group_orders`: at each step every distinct layer runs once, on the rows of all
the orders that run it there; `jaxdepth.core.loops.run_grouped_orders`). A family of drops and
swaps runs three distinct layers per step, so layer-major decoding reads three layers' weights
per step where the vmapped stack reads one per order.

The mask, not a sentinel index, says which entries are real: -1 is the last layer elsewhere in
jaxdepth (`jaxdepth.core.sites`), so it cannot also mean "no layer" here.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import numpy as np
from jaxtyping import Array, Bool, Int

__all__ = [
    "LayerOrder",
    "layer_order",
    "identity_order",
    "drop_block",
    "swap_pair",
    "reverse_block",
    "repeat_block",
    "parallel_block",
    "stack_orders",
    "check_order",
    "describe_order",
    "GroupedSteps",
    "group_orders",
]

Step = Union[int, Sequence[int]]


class LayerOrder(NamedTuple):
    """Steps of layer indices `layers [..., N, G]` (int32) and which entries are real
    `used [..., N, G]` (bool); leading axes stack orders for `vmap` (`stack_orders`). A pytree:
    it passes through `jit` and `vmap` as two arrays, so every order of one shape shares one
    compiled program."""

    layers: Int[Array, "... N G"]
    used: Bool[Array, "... N G"]


def layer_order(num_layers: int, steps: Sequence[Step]) -> LayerOrder:
    """The order of `steps`: each an index in 0..L-1, or a group of them (a tuple or list) that
    runs in parallel on the same input. E.g. `[0, 1, (2, 3), 5]` on 6 layers runs 2 and 3 side
    by side and drops 4. Refuses an index outside 0..L-1 (negative ones too: an order names
    layers, not positions from the end), an empty order or group, and a layer twice in a group."""
    groups = [(s,) if isinstance(s, (int, np.integer)) else tuple(s) for s in steps]
    if not groups:
        raise ValueError("an empty layer order: give at least one layer")
    G = max(len(g) for g in groups)
    layers = np.zeros((len(groups), G), np.int32)
    used = np.zeros((len(groups), G), bool)
    for n, group in enumerate(groups):
        if not group:
            raise ValueError(f"step {n} of the layer order is an empty group")
        for g, index in enumerate(group):
            if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
                raise TypeError(f"step {n}: layer indices are ints, got {index!r}")
            layers[n, g], used[n, g] = index, True
    return check_order(LayerOrder(layers, used), num_layers)


def check_order(order: LayerOrder, num_layers: int) -> LayerOrder:
    """`order` as numpy arrays after checking it against a model of `num_layers` layers: int
    layers and bool used of the same shape `[..., N, G]`, every used index in 0..L-1, at least
    one used entry per order, no layer twice in one step. Raises ValueError naming the fault."""
    layers, used = np.asarray(order.layers), np.asarray(order.used)
    if not np.issubdtype(layers.dtype, np.integer) or used.dtype != bool:
        raise TypeError(f"a LayerOrder holds int layers and bool used, got {layers.dtype} and {used.dtype}")
    if layers.ndim < 2 or layers.shape != used.shape:
        raise ValueError(f"a LayerOrder's layers and used are [..., steps, group], got {layers.shape} and {used.shape}")
    bad = used & ((layers < 0) | (layers >= num_layers))
    if bad.any():
        raise ValueError(
            f"layer order: index {int(layers[bad][0])} is outside 0..{num_layers - 1} (a model of {num_layers} layers)"
        )
    empty = ~used.any(axis=(-2, -1))
    if empty.any():
        raise ValueError("an empty layer order (no step uses a layer): give at least one layer")
    same = (layers[..., :, None] == layers[..., None, :]) & used[..., :, None] & used[..., None, :]
    if (same.sum(axis=-1) > 1).any():
        raise ValueError("a layer appears twice in one parallel step: its contribution would be counted twice")
    return LayerOrder(layers.astype(np.int32), used)


def identity_order(num_layers: int) -> LayerOrder:
    """Every layer once, in order: the plain forward."""
    return layer_order(num_layers, list(range(num_layers)))


def _block(num_layers: int, start: int, size: int) -> range:
    if size < 1 or start < 0 or start + size > num_layers:
        raise ValueError(f"a block of {size} layers from {start} does not fit in 0..{num_layers - 1}")
    return range(start, start + size)


def drop_block(num_layers: int, start: int, size: int) -> LayerOrder:
    """Layers start..start+size-1 removed (Gromov et al.'s pruning)."""
    block = _block(num_layers, start, size)
    if size == num_layers:
        raise ValueError("dropping every layer leaves an empty order")
    return layer_order(num_layers, [i for i in range(num_layers) if i not in block])


def swap_pair(num_layers: int, first: int) -> LayerOrder:
    """Layers `first` and `first + 1` exchanged (Lad et al.)."""
    _block(num_layers, first, 2)
    steps = list(range(num_layers))
    steps[first], steps[first + 1] = first + 1, first
    return layer_order(num_layers, steps)


def reverse_block(num_layers: int, start: int, size: int) -> LayerOrder:
    """Layers start..start+size-1 run in reverse order (Sun et al.)."""
    block = list(_block(num_layers, start, size))
    return layer_order(num_layers, list(range(start)) + block[::-1] + list(range(start + size, num_layers)))


def repeat_block(num_layers: int, start: int, size: int, times: int = 2) -> LayerOrder:
    """Layers start..start+size-1 run `times` times in a row, as a loop (Sun et al.)."""
    if times < 1:
        raise ValueError(f"times must be at least 1, got {times}")
    block = list(_block(num_layers, start, size))
    return layer_order(num_layers, list(range(start)) + block * times + list(range(start + size, num_layers)))


def parallel_block(num_layers: int, start: int, size: int) -> LayerOrder:
    """Layers start..start+size-1 read the same input and add their contributions (Sun et al.)."""
    block = tuple(_block(num_layers, start, size))
    return layer_order(num_layers, list(range(start)) + [block] + list(range(start + size, num_layers)))


def stack_orders(orders: Sequence[LayerOrder]) -> LayerOrder:
    """Orders stacked on a leading axis, padded with unused steps and group entries to the
    longest: one array pair to `vmap` over (every member compiles into one program; a member
    pays for the longest order and the widest group)."""
    if not orders:
        raise ValueError("no orders to stack")
    arrays = [(np.asarray(o.layers), np.asarray(o.used)) for o in orders]
    if any(layers.ndim != 2 for layers, _ in arrays):
        raise ValueError("stack_orders takes single orders ([N, G] each)")
    N = max(layers.shape[0] for layers, _ in arrays)
    G = max(layers.shape[1] for layers, _ in arrays)
    pad = lambda a: np.pad(a, ((0, N - a.shape[0]), (0, G - a.shape[1])))  # noqa: E731
    return LayerOrder(
        np.stack([pad(layers) for layers, _ in arrays]).astype(np.int32), np.stack([pad(used) for _, used in arrays])
    )


def describe_order(order: LayerOrder) -> str:
    """One order as text: `0 1 (2 3) 5` (parallel groups in parentheses, padding left out)."""
    layers, used = np.asarray(order.layers), np.asarray(order.used)
    if layers.ndim != 2:
        raise ValueError("describe_order takes a single order ([N, G])")
    words = []
    for row, mask in zip(layers, used):
        group = [str(int(i)) for i, u in zip(row, mask) if u]
        if group:
            words.append(group[0] if len(group) == 1 else "(" + " ".join(group) + ")")
    return " ".join(words)


class GroupedSteps(NamedTuple):
    """A stack of concrete orders arranged layer-major (`group_orders`): `steps[n]` holds, for
    each distinct layer some order runs at step n, `(layer, members)` with `members` the orders
    that run it there (ascending); `applied[n][c]` lists where order c's layers of step n sit,
    `(group, member position)` pairs in the order of its parallel group (empty: the step leaves
    order c's residual as it is). Tuples throughout: hashable, a static argument of `jit`."""

    num_orders: int
    steps: tuple
    applied: tuple


def group_orders(orders: LayerOrder, num_layers: int) -> GroupedSteps:
    """The layer-major plan of `orders` (a concrete stack `[C, N, G]`, `stack_orders`) on a model
    of `num_layers` layers, checked as `check_order` checks one."""
    layers, used = check_order(orders, num_layers)
    if layers.ndim != 3:
        raise ValueError(
            f"group_orders takes a stack of orders [orders, steps, group] (stack_orders), got {layers.shape}"
        )
    C, N, G = layers.shape
    steps, applied = [], []
    for n in range(N):
        members: dict[int, list[int]] = {}
        for c in range(C):
            for g in range(G):
                if used[c, n, g]:
                    members.setdefault(int(layers[c, n, g]), []).append(c)
        groups = tuple((layer, tuple(cs)) for layer, cs in sorted(members.items()))
        where = {layer: j for j, (layer, _) in enumerate(groups)}
        applied.append(
            tuple(
                tuple(
                    (where[int(layers[c, n, g])], groups[where[int(layers[c, n, g])]][1].index(c))
                    for g in range(G)
                    if used[c, n, g]
                )
                for c in range(C)
            )
        )
        steps.append(groups)
    return GroupedSteps(C, tuple(steps), tuple(applied))
