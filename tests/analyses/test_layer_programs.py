"""The search over layer programs: the edits by hand, a program found run alone gives the answer
the search recorded, and on a model whose later layers are zeroed the shortest right program
drops them."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdepth.analyses import layer_programs as P
from jaxdepth.core.batch import make_batch
from jaxdepth.core.decoding import generate
from jaxdepth.core.execution import Execution
from jaxdepth.core.model import random_params
from jaxdepth.core.structure import LayerOrder
from tiny_qwen import CONFIG


def _words(ids):
    """Token ids as letters only (no digits, so answers compare as text, token for token)."""
    return " ".join(chr(97 + int(i) % 26) + chr(97 + int(i) // 26) for i in ids)


def test_edits_by_hand():
    got = P.edited_programs((0, 1, 2), ("skip", "repeat", "swap"), max_length=4)
    assert got == [
        (1, 2),
        (0, 2),
        (0, 1),
        (0, 0, 1, 2),
        (0, 1, 1, 2),
        (0, 1, 2, 2),
        (1, 0, 2),
        (0, 2, 1),
    ]
    assert P.edited_programs((0, 1, 2), ("repeat",), max_length=3) == []  # none longer than the bound
    assert P.edited_programs((3,), ("skip", "swap"), max_length=4) == []  # never empty
    assert P.edited_programs((1, 1), ("swap",), max_length=4) == []  # never the program itself
    order = P.program_order((2, 0), 4)
    np.testing.assert_array_equal(order.layers[:, 0], [2, 0, 0, 0])
    np.testing.assert_array_equal(order.used[:, 0], [True, True, False, False])
    with pytest.raises(ValueError, match="edits are some of"):
        P.ProgramSearch(edits=("shuffle",))


def _zeroed_model(seed, zeroed=(2, 3)):
    """The tiny model with the layers of `zeroed` writing nothing (attention output and MLP down
    projections zero): each leaves the residual exactly as it found it."""
    params = random_params(CONFIG, seed, scale=0.6)
    layers = dict(params["layers"])
    for name in ("o", "down"):
        w = np.array(layers[name])
        w[list(zeroed)] = 0
        layers[name] = jnp.asarray(w)
    return {**params, "layers": layers}


def _prompts(params, n=3, seed=4):
    """Prompts whose reference answers are the intact model's greedy answers (4 tokens)."""
    rng = np.random.default_rng(seed)
    questions = [rng.integers(0, 97, 6 + i).tolist() for i in range(n)]
    answers = []
    for q in questions:
        out = generate(params, jnp.asarray([q]), CONFIG, max_new_tokens=4)
        answers.append([int(t) for t in np.asarray(out.tokens[0])])
    return make_batch([q + a for q, a in zip(questions, answers)], [len(q) for q in questions])


def test_the_shortest_right_program_drops_layers_that_write_nothing():
    params = _zeroed_model(7)
    batch = _prompts(params)
    search = P.ProgramSearch(rounds=3, keep=8, edits=("skip",), max_new_tokens=4)
    result = P.search_programs(params, batch, CONFIG, _words, search)
    assert result.intact_right.all()  # the references are its own answers
    for program in result.shortest:
        assert 2 not in program and 3 not in program  # dropped: they change nothing
        assert len(program) <= 2
    for i, (program, answer) in enumerate(zip(result.shortest, result.answers)):
        # run alone, the program generates the answer the search recorded
        question = jnp.asarray([batch.tokens[i, : batch.answer_start[i]]])
        order = P.program_order(tuple(program), len(program))
        out = generate(params, question, CONFIG, max_new_tokens=4, order=LayerOrder(order.layers, order.used))
        assert _words(np.asarray(out.tokens[0])) == answer
    assert result.shares()["shorter"] == 1.0
    assert np.isnan(result.shares()["fixed"])  # no wrong prompt to fix
    assert list(result.scored[:1]) == [3 * 4]  # round 1: each prompt's four skips


def test_likelihood_search_keeps_the_answer_within_the_margin():
    params = _zeroed_model(8, zeroed=(3,))
    batch = _prompts(params, n=2, seed=5)
    search = P.ProgramSearch(rounds=1, keep=4, edits=("skip",), score="likelihood", margin=0.0)
    result = P.search_programs(params, batch, CONFIG, None, search)
    # one round of skips: the drop of layer 3 is right (the same likelihood), none shorter exists
    assert [len(program) for program in result.shortest] == [3, 3]
    # the drop of layer 3 leaves every likelihood as it was: within a margin of 0
    members = [(i, (0, 1, 2)) for i in range(2)]
    prompts = P._prompts(batch, None)
    loglik, right, texts = P.score_programs(params, prompts, CONFIG, members, search, Execution(), None)
    np.testing.assert_array_equal(loglik, result.intact_loglik)
    assert right is None and texts is None
