"""Matmul FLOPs of the pieces every case's FLOP model is built from."""

from __future__ import annotations

from jaxdepth.core.flops import forward_flops, layer_flops, lm_head_flops  # noqa: F401 (the cases import them from here)


def answers(one) -> int:
    """How many answer-predicting positions a one-prompt batch has (where the LM head is read)."""
    return len(one.answer_positions(0)[0])
