"""The EAP-IG package's definitions as options: 'clean-corrupted' is the average of EAP on the
pairs and minus EAP on the pairs swapped (the corrupt run's gradient, by hand), and the pooled
'activations' variant averages every reader's gradient over all nodes' paths with each node
detached: the logits reader's gradient is the clean one, and the last MLP's input loses exactly
its own node's share."""

import numpy as np
import pytest

from test_edge_scores import make_pairs, pairs, params  # noqa: F401  (the tiny model's fixtures)
from tiny_qwen import CONFIG
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import logit_difference, prompt_pairs
from jaxdepth.analyses.edges.scores import edge_attribution
from jaxdepth.analyses.ig import FixedRule
from jaxdepth.analyses.edges.ablations import Patching
from jaxdepth.analyses.edges.scores import Scoring

GRAPH = EdgeGraph.of(CONFIG)


def test_clean_corrupted_averages_the_clean_and_the_corrupt_runs_gradients(params, pairs):
    """EAP on the pairs swapped scores (a_corrupt - a_clean) . dF/d in_v (corrupt)."""
    clean, corrupt, labels = make_pairs()
    eap = edge_attribution(params, pairs, CONFIG, logit_difference)
    swapped = edge_attribution(params, prompt_pairs(corrupt, clean, labels), CONFIG, logit_difference)
    both = edge_attribution(params, pairs, CONFIG, logit_difference, "clean-corrupted")
    assert both.rule == "ends" and both.steps == 2 and np.all(both.evaluations == 2)
    by_hand = (eap.scores - swapped.scores) / 2
    assert np.max(np.abs(eap.scores + swapped.scores)) > 1e-2  # the two gradients differ
    np.testing.assert_allclose(both.scores, by_hand, rtol=1e-4, atol=1e-6)


def test_pooled_activations_detach_each_node_on_its_path(params, pairs):
    """With one 'right' step every path point is the clean run with one node detached. No node
    lies after the logits reader: its gradient is the clean one in every run, and its edges
    score as EAP's. The last MLP's input gets no gradient in its own node's run and the clean
    one in the 2L others: its edges score 2L / (2L + 1) of EAP's."""
    eap = edge_attribution(params, pairs, CONFIG, logit_difference)
    pooled = edge_attribution(
        params, pairs, CONFIG, logit_difference, Scoring("eap-ig-activations-pooled", FixedRule("right", 1))
    )
    L = CONFIG.num_layers
    logits, last_mlp = GRAPH.logits_reader, GRAPH.edge_index(f"m{L - 2}->m{L - 1}")[1]
    np.testing.assert_allclose(pooled.scores[..., logits], eap.scores[..., logits], rtol=1e-5, atol=1e-6)
    share = 2 * L / (2 * L + 1)
    np.testing.assert_allclose(pooled.scores[..., last_mlp], share * eap.scores[..., last_mlp], rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(eap.scores[..., last_mlp])) > 1e-2
    # elsewhere detaching changes the gradients: not EAP's
    assert np.max(np.abs(pooled.scores - eap.scores)) > 1e-2
    assert pooled.rule == "right" and np.all(pooled.evaluations == 2 * L + 1)


def test_the_package_s_methods_refuse_what_they_cannot_take(params, pairs):
    with pytest.raises(ValueError, match="'clean-corrupted' takes the gradients at the path's ends, no rule"):
        edge_attribution(params, pairs, CONFIG, logit_difference, Scoring("clean-corrupted", "left"))
    with pytest.raises(ValueError, match="no path to a 'zero' ablation"):
        edge_attribution(params, pairs, CONFIG, logit_difference, "clean-corrupted", patching=Patching("zero"))
