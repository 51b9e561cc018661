"""experiments/gsm8k_deep_thinking.py's summary, on results made by hand: the accuracies pooled
over chunks by their prompts, the right and wrong answers' DTR, the quartiles and the
correlation as computed by hand, and a chunk saved then read back (what a rerun resumes from)."""

import os
import sys

import numpy as np

EXPERIMENTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "experiments"))
sys.path.insert(0, EXPERIMENTS)

import gsm8k_deep_thinking as G  # noqa: E402
from jaxdepth.analyses.generated_depth import GeneratedDepthResult  # noqa: E402


def _result(dtr, correct, lengths, answers):
    N, S = np.shape(dtr)
    counted = np.arange(8)[None, None, :] < np.asarray(lengths)[..., None]
    zeros = np.zeros((N, S, 8), np.int32)
    return GeneratedDepthResult(
        settling=zeros,
        decision=zeros,
        counted=counted,
        jsd=np.zeros((N, 4)),
        entropy=np.zeros((N, 5)),
        entropy_forced=np.zeros((N, 5)),
        dtr=np.asarray(dtr, float),
        correct=np.asarray(correct, bool),
        answers=answers,
        num_layers=4,
        settings=dict(threshold=0.5, rho=0.85, keep=0.5, samples=S, temperature=0.7, max_new_tokens=8, lens="logit"),
    )


def test_the_summary_equals_a_hand_computation(tmp_path):
    a = _result([[0.9, 0.1], [0.2, 0.3]], [[True, False], [False, False]], [[8, 2], [3, 4]], [["4", "5"], ["1", "2"]])
    b = _result([[0.8, 0.7]], [[True, True]], [[5, 6]], [["7", "7"]])
    path = a.save(str(tmp_path / "chunk_000.npz"))
    s = G.summarize([GeneratedDepthResult.load(path), b], resamples=200)
    assert (s["prompts"], s["answers"], s["right_answers"]) == (3, 6, 3)
    # one sample: 3 of 6; majority (first answer on a tie): 4 right, 1 wrong, 7 right; Think@n
    # keeps the deeper half: 4 (right), 2 (wrong), 7 (right)
    assert s["accuracy"] == {"mean": 0.5, "majority": 2 / 3, "think@n": 2 / 3}
    assert np.isclose(s["dtr_right"][0], (0.9 + 0.8 + 0.7) / 3) and np.isclose(s["dtr_wrong"][0], 0.6 / 3)
    assert s["dtr_right"][1] <= s["dtr_right"][0] <= s["dtr_right"][2]
    dtr = np.array([0.9, 0.1, 0.2, 0.3, 0.8, 0.7])
    right = np.array([1, 0, 0, 0, 1, 1], bool)
    assert np.isclose(s["dtr_correlation"], np.corrcoef(dtr, right)[0, 1])
    quartiles = s["dtr_quartiles"]
    assert sum(q["answers"] for q in quartiles) == 6 and quartiles[0]["accuracy"] == 0.0
    assert (quartiles[-1]["low"], quartiles[-1]["high"]) == (0.8, 0.9) and quartiles[-1]["accuracy"] == 1.0
    assert "| Think@n (deepest 50% by DTR) | 0.667 |" in G._markdown(s, "a CPU")
