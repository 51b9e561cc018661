"""Edge attribution: which writer -> reader edges of the residual stream carry a task, scored by
EAP and EAP-IG, checked by exact patching, and gathered into circuits.

- `graph`: the writers (input, heads, MLPs) and readers (each head's q/k/v input, MLP inputs,
  logits) of a decoder, and the names of its edges (`EdgeGraph`);
- `readers`: the graph's readers and writers as sites of the core's split layer: interventions
  that probe, move or patch readers' inputs (`patch_edges`), and the runs that read the
  writers (`edge_run`);
- `pairs`: clean/corrupt prompt pairs from token ids (`prompt_pairs`), texts (`text_pairs`) or a
  JSON Lines file (`read_pairs`), and the positions a metric reads in them. The metric is the
  package's one form, a `jaxdepth.Metric` (`jaxdepth.analyses.metrics`), whose built-ins are
  re-exported here: `logit_difference` (the circuit command's), `answer_probability`, and of
  the clean run's logits `kl_clean_to_run`, `kl_run_to_clean`, `mean_kl_clean_to_run`;
- `ablations`: what an ablated edge carries: the corrupt run's values (the default), zero, or
  means over a prompt set (`mean_ablation`, per token or per position), and with the
  interventions on every run the `Patching` the edge functions take;
- `scores`: `edge_attribution` (EAP, EAP-IG over inputs or activations, fixed or adaptive rule:
  a `Scoring`);
- `patching`: exact patching of edges one at a time or in sets (`edge_effects`,
  `patched_metric`, `circuit_metric`, `faithfulness`), and of nodes (`node_effects`);
- `atp_star`: attribution patching of nodes (a head's query, key or value at a position, a head's
  or an MLP's output at a position, an MLP hidden unit), AtP* with the QK fix and GradDrop
  (`atp_star`);
- `selection`: the order in which circuits take edges (by score, or grown greedily from the
  logits) and which of a circuit's edges are live (`live_edges`);
- `circuit`: circuits from scores (`find_circuit`, searching as a `CircuitSearch` says) and their
  figures (`position_figure`: edges over the prompt's positions, from per-position scores).

The definitions (signs, which run each gradient comes from, what is patched) are in
`docs/circuits.md`. How any of them runs (chunk sizes, memory, progress) is one
`jaxdepth.Execution`.
"""

from jaxdepth.analyses.edges.ablations import ABLATIONS, CORRUPT, ZERO, Ablation, Patching, mean_ablation
from jaxdepth.analyses.edges.atp_star import (
    ATP_METHODS,
    NODE_KINDS,
    NodeAttribution,
    atp_star,
    missed_nodes,
    node_shape,
)
from jaxdepth.analyses.edges.circuit import (
    LEVELS,
    Circuit,
    CircuitSearch,
    circuit_figure,
    faithfulness_figure,
    find_circuit,
    position_figure,
    ranked_nodes,
    top_circuits,
)
from jaxdepth.analyses.edges.graph import EdgeGraph
from jaxdepth.analyses.edges.pairs import PromptPairs, TaskPairs, answer_token, prompt_pairs, read_pairs, text_pairs
from jaxdepth.analyses.metrics import (
    answer_probability,
    kl_clean_to_run,
    kl_run_to_clean,
    logit_difference,
    mean_kl_clean_to_run,
)
from jaxdepth.analyses.edges.readers import EdgeRun, edge_run, move_reader, patch_edges, probe_readers, shift_node
from jaxdepth.analyses.edges.patching import (
    circuit_metric,
    edge_effects,
    faithfulness,
    neuron_effects,
    node_effects,
    patched_metric,
)
from jaxdepth.analyses.edges.scores import DETAILS, METHODS, EdgeScores, Scoring, edge_attribution, ranked_edges
from jaxdepth.analyses.edges.selection import SEARCHES, greedy_edges, live_edges, ordered_edges

__all__ = [
    "EdgeGraph",
    "EdgeRun",
    "edge_run",
    "probe_readers",
    "move_reader",
    "patch_edges",
    "shift_node",
    "Ablation",
    "ABLATIONS",
    "CORRUPT",
    "ZERO",
    "Patching",
    "mean_ablation",
    "PromptPairs",
    "prompt_pairs",
    "TaskPairs",
    "text_pairs",
    "read_pairs",
    "answer_token",
    "logit_difference",
    "answer_probability",
    "kl_clean_to_run",
    "kl_run_to_clean",
    "mean_kl_clean_to_run",
    "METHODS",
    "Scoring",
    "DETAILS",
    "EdgeScores",
    "edge_attribution",
    "ranked_edges",
    "SEARCHES",
    "greedy_edges",
    "live_edges",
    "ordered_edges",
    "edge_effects",
    "patched_metric",
    "circuit_metric",
    "faithfulness",
    "neuron_effects",
    "node_effects",
    "NODE_KINDS",
    "ATP_METHODS",
    "NodeAttribution",
    "atp_star",
    "node_shape",
    "missed_nodes",
    "Circuit",
    "CircuitSearch",
    "find_circuit",
    "top_circuits",
    "circuit_figure",
    "faithfulness_figure",
    "position_figure",
    "ranked_nodes",
    "LEVELS",
]
