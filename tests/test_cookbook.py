"""docs/cookbook.md runs as written, block after block in one namespace, on the embedded model,
and each recipe computes what it says (checked against plain forwards edited by hand)."""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_docs import ROOT, python_blocks

COOKBOOK = os.path.join(ROOT, "docs", "cookbook.md")


def test_the_cookbook_has_at_least_eight_recipes():
    text = open(COOKBOOK).read()
    assert len(re.findall(r"^## \d+\. ", text, flags=re.M)) >= 8
    assert len(python_blocks("docs/cookbook.md")) >= 9  # set-up and one block per recipe


@pytest.mark.slow(seconds=300)
def test_cookbook_runs_as_written(smollm2, tmp_path, monkeypatch, capsys):
    from jaxdepth import sites
    from jaxdepth.core.model import forward, residual_stream, unembed
    from jaxdepth.analyses.logit_lens import lens_statistics

    from jaxdepth.lab.registry import ANALYSES

    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    try:
        for block in python_blocks("docs/cookbook.md"):
            exec(compile(block, COOKBOOK, "exec"), ns)
    finally:  # recipe 9 registers an analysis: other tests in this process see the built-in suite
        ANALYSES.pop("final_entropy", None)
    printed = capsys.readouterr().out
    for line in (
        "logit difference:",
        "steering moves",
        "heads whose patch",
        "IG per (layer, head)",
        "lens KL",
        "skipping layer s moves the difference by at most",
        "erasing h_l[t]",
        "correlation",
        "projecting",
        "final entropy:",
        "exact effect",
        "of the logit difference",
        "right, answers",
    ):
        assert line in printed, line
    params, config, tokens, metric = ns["params"], ns["config"], ns["tokens"], ns["paris_vs_rome"]
    L, H, T = ns["L"], ns["H"], ns["T"]
    run = jax.jit(lambda p, iv: metric(forward(p, tokens, config, interventions=iv)))
    base = float(run(params, None))

    # 1. steering: member l is the forward steered at layer l
    for layer in (0, L - 1):
        iv = sites.add("resid_pre", layer, ns["vector"], jnp.ones(T))
        assert float(ns["steering"][layer]) == pytest.approx(float(run(params, iv)), abs=1e-3)
    # 2. patching: member (l, h) is the forward with that one head patched
    for layer, head in ((0, 1), (L - 1, H - 1)):
        where = np.zeros((L, 1, 1, H, 1), bool)
        where[layer, :, :, head] = True
        iv = sites.patch("head_out", ns["cached"], where)
        assert float(ns["patching"][layer, head]) == pytest.approx(float(run(params, iv)), abs=1e-3)
    # 3. IG: shapes, F(x) the clean metric, the gap its definition
    ig = ns["ig"]
    assert ig.attributions.shape == (L, 1, T, H, config.head_dim)
    assert float(ig.f_input[0]) == pytest.approx(base, abs=1e-3)
    np.testing.assert_allclose(ig.gap, ig.per_position.sum(-1) - (ig.f_input[None] - ig.f_baseline), atol=1e-4)
    # 4. the lens after the ablation: from the intervened residual stream, by hand
    hs = residual_stream(params, tokens, config, interventions=ns["ablate"])
    final = unembed(params, hs[-1], config)
    kl, _ = lens_statistics(
        unembed(params, hs[L // 2 + 1], config), jax.nn.log_softmax(final, -1), jax.lax.top_k(final, 5)[1]
    )
    np.testing.assert_allclose(ns["kl_ablated"][L // 2 + 1], kl, rtol=1e-3, atol=1e-4)
    assert np.abs(np.asarray(ns["kl_ablated"]) - np.asarray(ns["kl_clean"])).max() > 1e-4
    # 5. layer skip: the change of skipping layer s before a split, against the forward with that skip

    skips, one = ns["skips"], ns["batch"].single(0)
    n = len(ns["long_prompt"])
    read = jax.jit(
        lambda p, iv: ns["paris_vs_rome_at"](n - 1)(
            forward(p, jnp.asarray(one.tokens), config, valid=jnp.asarray(one.valid), interventions=iv)
        )
    )
    pos = np.arange(one.tokens.shape[1])
    for s in (0, L // 2):
        t = int(skips.split_positions[0, 0])
        iv = sites.skip("delta", s, ((pos >= 1) & (pos < t)).astype(np.float32))
        assert float(skips.metric_change_per_prompt[0, s, 0]) == pytest.approx(
            float(read(params, iv) - read(params, None)), abs=1e-3
        )
    assert np.all(np.abs(skips.metric_change) >= np.nanmax(np.abs(skips.metric_change_per_prompt[0]), -1) - 1e-6)
    # 6. erasure: the change of h_l[t] erased, against a forward with the replacement by hand
    change = ns["erased"].metric_change[0]
    answered = jnp.asarray(ns["short"].tokens[:, : T + 1])
    at_question_end = jax.jit(lambda p, iv: metric(forward(p, answered, config, interventions=iv)[:, :T]))
    for layer, t in ((0, T - 1), (L // 2, 3)):
        iv = sites.replace("resid_pre", layer, (jnp.arange(T + 1) == t).astype(jnp.float32), ns["baseline"][layer])
        assert float(change[layer, t]) == pytest.approx(
            float(at_question_end(params, iv) - at_question_end(params, None)), abs=1e-3
        )
    # 7. exact patching against the forward with h_l[t] from the corrupted run; the estimate's shape
    other = ns["other_h"]
    for layer, t in ((1, 2), (L - 1, T - 1)):
        iv = sites.replace("resid_pre", layer, (jnp.arange(T) == t).astype(jnp.float32), other[layer])
        assert float(ns["exact_change"][layer, t]) == pytest.approx(float(run(params, iv)) - base, abs=1e-3)
    assert ns["estimate"].shape == (L, T)
    # 8. projection: the layer's clean output with the direction removed, written in by hand
    u = ns["direction"] / jnp.linalg.norm(ns["direction"])
    for layer in (0, L // 2):
        out = ns["clean_h"][layer + 1] if layer + 1 < L else None
        projected = out - (out @ u)[..., None] * u
        iv = sites.replace("resid_post", layer, jnp.ones(T), projected)
        assert float(ns["projection"][layer]) == pytest.approx(float(run(params, iv)), abs=1e-3)
    # 9. the user analysis: saved where the study keeps results, its numbers the entropy itself
    from jaxdepth.lab.study import model_results_key

    key = model_results_key(ns["model"], "smollm2")[0]  # the model's name and fingerprint
    saved = tmp_path / "cookbook-results" / key / "cookbook" / "final_entropy.npz"
    assert saved.exists()
    logits = ns["model"].logits(ns["short"].tokens, ns["short"].valid)[0, ns["short"].lengths[0] - 1]
    logp = jax.nn.log_softmax(jnp.asarray(logits))
    assert float(ns["results"]["final_entropy"].entropy[0]) == pytest.approx(
        float(-(jnp.exp(logp) * logp).sum()), abs=1e-4
    )
    # 10. edges: an edge into the logits patched by hand (the final residual read by the logits
    # moved by the writer's corrupt-minus-clean output, from taps of the plain forward)
    pairs, top, effects = ns["pairs"], ns["top"], ns["effects"]
    graph = ns["scores"].graph
    into_logits = [i for i, (w, r) in enumerate(top) if r == graph.logits_reader and w != 0]
    assert into_logits, "no edge into the logits among the top edges"
    i = into_logits[0]
    name = graph.writer_name(top[i][0])
    tap = (lambda rec, _: rec.mlp) if name.startswith("m") else (lambda rec, _: rec.head_out)
    layer = int(name[1:].split(".")[0])

    def writer_output(tokens):
        h, taps = ns["model"].run(tokens, valid=pairs.valid, tap=tap)
        out = taps[layer]
        if not name.startswith("m"):  # one head's output through its slice of o_proj
            head, Dh = int(name.split(".h")[1]), config.head_dim
            out = out[:, :, head] @ params["layers"]["o"][layer][head * Dh : (head + 1) * Dh]
        return h, out

    h_clean, clean_out = writer_output(pairs.clean)
    _, corrupt_out = writer_output(pairs.corrupt)
    rows = jnp.arange(len(pairs))
    labels = jnp.asarray(pairs.labels)

    def read(h):  # the logit difference by hand, at each pair's last position
        logits = unembed(params, h[rows, pairs.last], config)
        return logits[rows, labels[:, 0]] - logits[rows, labels[:, 1]]

    by_hand = read(h_clean) - read(h_clean + corrupt_out - clean_out)
    np.testing.assert_allclose(effects[i], by_hand, rtol=1e-3, atol=1e-4)
    assert 0 < ns["circuit"].faithfulness <= 1.5
    # 11. generated answers: one structure's continuations are Model.generate's under its order
    from jaxdepth.analyses.answers import same_answer

    family, right, read = ns["family"], ns["right"], ns["read"]
    texts = ns["model"].generate(
        [ns["model"].tokenizer.decode(q) for q in ns["questions"]], max_new_tokens=4, order=family[2].order(L)
    )
    assert read[2] == [t.split("\n")[0] for t in texts]
    assert [bool(r) for r in right[2]] == [same_answer(t, str(a + b)) for t, (a, b) in zip(read[2], ns["sums"])]
    assert right[0].sum() > 0  # the intact model adds some of them
