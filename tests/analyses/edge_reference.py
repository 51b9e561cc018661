"""A decoder forward written apart from the package, head by head in float64, in which one
reader's input can be changed: the finite differences the edge scores are checked against."""

import numpy as np


def _norm(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rotate(x, theta):
    """Rotate-half rotary embedding of `x [T, Dh]` at positions 0..T-1."""
    T, Dh = x.shape
    inv = 1.0 / theta ** (np.arange(0, Dh, 2) / Dh)
    angles = np.arange(T)[:, None] * np.concatenate([inv, inv])[None, :]
    rotated = np.concatenate([-x[:, Dh // 2 :], x[:, : Dh // 2]], axis=1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def reference_run(params, tokens, config, last, labels, reader=None, change=0.0):
    """`(logit difference at position last, writers)` of one prompt `tokens [T]`: writers maps
    'input', (layer, head) and ('m', layer) to their outputs `[T, D]`. `reader` (None, ('q' |
    'k' | 'v', layer, head), ('m', layer) or 'logits') reads `change [T, D]` more."""
    p = {k: np.asarray(v, np.float64) for k, v in params["layers"].items()}
    c = config
    H, K, Dh, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
    h = np.asarray(params["embed"], np.float64)[np.asarray(tokens)]
    T = h.shape[0]
    writers = {"input": h.copy()}
    causal = np.tril(np.ones((T, T), bool))
    for l in range(c.num_layers):
        outs = []
        for head in range(H):
            g = head // (H // K)

            def project(kind, w, cols):
                x = h + (change if reader == (kind, l, head) else 0.0)
                y = _norm(x, p["attn_norm"][l], eps) @ p[w][l][:, cols]
                return y + p[f"{w}_bias"][l][cols] if c.qkv_bias else y

            q = _rotate(project("q", "q", slice(head * Dh, (head + 1) * Dh)), c.rope_theta)
            k = _rotate(project("k", "k", slice(g * Dh, (g + 1) * Dh)), c.rope_theta)
            v = project("v", "v", slice(g * Dh, (g + 1) * Dh))
            scores = np.where(causal, q @ k.T / np.sqrt(Dh), -np.inf)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            outs.append(weights @ v @ p["o"][l][head * Dh : (head + 1) * Dh])
            writers[(l, head)] = outs[-1]
        a = sum(outs)
        x = _norm(h + a + (change if reader == ("m", l) else 0.0), p["mlp_norm"][l], eps)
        gate = x @ p["gate"][l]
        m = (gate / (1 + np.exp(-gate)) * (x @ p["up"][l])) @ p["down"][l]
        writers[("m", l)] = m
        h = h + a + m
    x = _norm(h + (change if reader == "logits" else 0.0), np.asarray(params["final_norm"], np.float64), eps)
    head_w = np.asarray(params["embed"], np.float64).T if c.tie_word_embeddings else np.asarray(params["lm_head"])
    logits = x[last] @ np.asarray(head_w, np.float64)
    return logits[labels[0]] - logits[labels[1]], writers


def logit_difference_of(logits, labels):
    """The logit difference by hand, `[B]`: the logits `[B, V]` at each pair's last position,
    of the right answer minus the wrong one (`labels [B, 2]`), what the built-in
    `logit_difference` measures."""
    rows = np.arange(logits.shape[0])
    return logits[rows, labels[:, 0]] - logits[rows, labels[:, 1]]
