"""Padding by cost (`jaxdepth.core.padding`): the chosen lengths are the cheapest, by brute force."""

import itertools

import numpy as np
import pytest

from jaxdepth.core.batch import make_batch
from jaxdepth.core.padding import ChosenLengths, DeviceSpeed, cheapest_lengths


def _total(lengths, chosen: ChosenLengths, seconds, compile_seconds):
    padded = [chosen.padded(n) for n in lengths]
    return sum(seconds(p) for p in padded) + compile_seconds * len(set(padded))


def _brute_force(lengths, seconds, compile_seconds, multiple):
    """The cheapest total over every way of cutting the sorted distinct rounded lengths into runs."""
    candidates = sorted({-(-n // multiple) * multiple for n in lengths})
    best = np.inf
    for cuts in itertools.product([False, True], repeat=len(candidates) - 1):
        kept = [c for c, cut in zip(candidates, list(cuts) + [True]) if cut]
        best = min(best, _total(lengths, ChosenLengths(tuple(kept), multiple), seconds, compile_seconds))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_chosen_lengths_cost_the_least_of_all_cuts(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 400, rng.integers(1, 12)).tolist()
    seconds = lambda T: 0.01 * T + 2e-5 * T * T  # noqa: E731 (linear layers and quadratic attention)
    compile_seconds = float(rng.choice([0.0, 0.5, 3.0, 50.0]))
    chosen = cheapest_lengths(lengths, seconds, compile_seconds)
    assert all(chosen.padded(n) >= n and chosen.padded(n) % 8 == 0 for n in lengths)
    assert chosen.lengths == tuple(sorted({chosen.padded(n) for n in lengths}))  # no length left unused
    np.testing.assert_allclose(
        _total(lengths, chosen, seconds, compile_seconds), _brute_force(lengths, seconds, compile_seconds, 8)
    )


def test_free_compilation_pads_each_prompt_to_its_own_length_and_dear_compilation_to_one():
    lengths = [121, 130, 200, 349, 30]
    seconds = lambda T: float(T)  # noqa: E731
    assert cheapest_lengths(lengths, seconds, 0.0).lengths == (32, 128, 136, 200, 352)
    assert cheapest_lengths(lengths, seconds, 1e9).lengths == (352,)
    # a compilation worth 10 padded tokens: 121 joins 130 (9 tokens), the others stay apart
    assert cheapest_lengths(lengths, seconds, 10.0).lengths == (32, 136, 200, 352)


def test_chosen_lengths_pad_a_batch_as_buckets_do():
    chosen = ChosenLengths((136, 32, 352))
    assert chosen.lengths == (32, 136, 352) and str(chosen) == "lengths:32,136,352"
    assert [chosen.padded(n) for n in (1, 32, 33, 136, 353)] == [32, 32, 136, 136, 360]  # beyond: a multiple
    batch = make_batch([[1] * 20, [2] * 100])
    assert batch.single(0, chosen).tokens.shape == (1, 32)
    assert batch.single(1, chosen).tokens.shape == (1, min(136, batch.tokens.shape[1]))


def test_clear_errors():
    with pytest.raises(ValueError, match="no prompt lengths"):
        cheapest_lengths([], float, 1.0)
    with pytest.raises(ValueError, match="positive"):
        cheapest_lengths([0, 3], float, 1.0)
    with pytest.raises(ValueError, match="flops_per_second > 0"):
        DeviceSpeed(0.0, 1.0)
    assert DeviceSpeed.estimate("cpu").compile_seconds > 0 and DeviceSpeed.estimate("gpu").flops_per_second > 1e12
