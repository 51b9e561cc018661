"""Edge attribution as the EAP-IG package formulates it, in PyTorch: the reference that
`experiments/benchmark_edges.py` times jaxdepth's edge attribution against.

The package (Hanna et al., `eap.attribute` over a TransformerLens model with split q/k/v inputs)
works with hooks:

- forward hooks on every writer (the embeddings, each head's output, each MLP's output) fill an
  activation-difference matrix `[B, T, W, D]` (here clean - corrupt, jaxdepth's sign);
- backward hooks on every reader's input (each head's q, k and v input, split per query head,
  so grouped-query key/value weights are unrolled to one copy per query head; each MLP's input;
  the logits' input) add `einsum(activation difference of the writers before the reader,
  gradient)` into the score matrix at every backward pass;
- EAP: one backward of the clean run; EAP-IG: one forward and backward per step on the
  interpolated input embeddings (α = k / steps, k = 0..steps-1), scores averaged over steps;
- exact patching: one forward per patched edge set, in which every reader's input gets
  `einsum(corrupt - current output of its writers, patched edges)` (the package's
  `evaluate_graph`, with every edge but the patched ones in the graph);
- the greedy search (the package's `Graph.apply_greedy`): from the logits, the best-scoring edge
  among those into nodes already in the circuit, its writer's node joining the circuit;
- per position (not in the package; its hooks summed over positions): the same einsum keeping
  the position axis, `[W, R, T]`; neurons (the package's neuron-level scores on the MLP hidden
  units): a hook on each MLP's hidden activations, activation difference times gradient.

Every pass runs the whole batch of pairs at every position. The model is written here directly
over the jaxdepth params (numpy), not through jaxdepth's code.
"""

from __future__ import annotations

import heapq

import numpy as np

from jaxdepth.lab.optional import require

torch = require(
    "torch",
    purpose="the PyTorch reference of edge attribution (experiments/reference_edges_torch.py)",
    install="pip install torch==2.13.0 (the CPU build; or the README's test set-up)",
)


class EdgeReference:
    """A decoder (Llama/Qwen2 layout) over per-head reader inputs, with the package's hooks."""

    def __init__(self, params, config):
        t = lambda x: torch.as_tensor(np.asarray(x, np.float32))
        c = self.config = config
        H, K, Dh, D = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
        G = H // K
        lay = params["layers"]
        self.embed = t(params["embed"])
        self.lm_head = self.embed.T if c.tie_word_embeddings else t(params["lm_head"])
        self.final_norm = t(params["final_norm"])
        self.layers = []
        for l in range(c.num_layers):
            per_head = lambda w, n: t(w[l]).reshape(D, n, Dh).permute(1, 0, 2)  # [n, D, Dh]
            unrolled = lambda w: per_head(w, K).repeat_interleave(G, dim=0)  # GQA: one copy per query head
            bias = lambda name, n: t(lay[name][l]).reshape(n, Dh) if c.qkv_bias else None
            layer = dict(
                attn_norm=t(lay["attn_norm"][l]),
                mlp_norm=t(lay["mlp_norm"][l]),
                q=per_head(lay["q"], H),
                k=unrolled(lay["k"]),
                v=unrolled(lay["v"]),
                q_bias=bias("q_bias", H),
                k_bias=None if not c.qkv_bias else bias("k_bias", K).repeat_interleave(G, dim=0),
                v_bias=None if not c.qkv_bias else bias("v_bias", K).repeat_interleave(G, dim=0),
                o=t(lay["o"][l]).reshape(H, Dh, D),
                gate=t(lay["gate"][l]),
                up=t(lay["up"][l]),
                down=t(lay["down"][l]),
            )
            self.layers.append(layer)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, Dh, 2, dtype=torch.float32) / Dh))
        self.inv_freq = inv
        self.W = 1 + c.num_layers * (H + 1)
        self.R = c.num_layers * (3 * H + 1) + 1

    # ------------------------------------------------------------------ the forward pass

    def _norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    def _rotary(self, x):
        T, Dh = x.shape[1], x.shape[-1]
        angles = torch.arange(T, dtype=torch.float32)[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], -1)[None, :, None, :]
        rotated = torch.cat([-x[..., Dh // 2 :], x[..., : Dh // 2]], -1)
        return x * angles.cos() + rotated * angles.sin()

    def forward(self, h0, valid, last, *, writer_hook=None, reader_hook=None, hidden_hook=None):
        """Logits `[B, V]` at `last`. `writer_hook(first, outputs [B, T, n, D])` sees each
        group of writers; `reader_hook(first, inputs [B, T, n, D], layer)` may return a changed
        input for a group of readers (and registers gradient hooks); `hidden_hook(layer, hidden
        [B, T, F])` sees each MLP's hidden activations and returns them."""
        c = self.config
        H, Dh = c.num_heads, c.head_dim
        B, T, D = h0.shape
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
        mask = causal[None, None] & valid[:, None, None, :]
        if writer_hook:
            writer_hook(0, h0[:, :, None])
        h = h0
        for l, p in enumerate(self.layers):
            first = l * (3 * H + 1)
            inputs = h[:, :, None, :].expand(B, T, 3 * H, D)
            if reader_hook:
                inputs = reader_hook(first, inputs, l)
            x = self._norm(inputs, p["attn_norm"])
            q, k, v = (
                torch.einsum("bthd,hde->bthe", x[:, :, i * H : (i + 1) * H], p[name])
                + (0 if p[f"{name}_bias"] is None else p[f"{name}_bias"])
                for i, name in enumerate("qkv")
            )
            q, k = self._rotary(q), self._rotary(k)
            scores = torch.einsum("bthe,bshe->bhts", q, k) / Dh**0.5
            weights = torch.softmax(scores.masked_fill(~mask, torch.finfo(torch.float32).min), -1)
            heads = torch.einsum("bhts,bshe->bthe", weights, v)
            head_out = torch.einsum("bthe,hed->bthd", heads, p["o"])
            if writer_hook:
                writer_hook(1 + l * (H + 1), head_out)
            a = head_out.sum(2)
            mlp_in = (h + a)[:, :, None]
            if reader_hook:
                mlp_in = reader_hook(first + 3 * H, mlp_in, l)
            y = self._norm(mlp_in[:, :, 0], p["mlp_norm"])
            hidden = torch.nn.functional.silu(y @ p["gate"]) * (y @ p["up"])
            if hidden_hook:
                hidden = hidden_hook(l, hidden)
            m = hidden @ p["down"]
            if writer_hook:
                writer_hook(1 + l * (H + 1) + H, m[:, :, None])
            h = h + a + m
        final = h[:, :, None]
        if reader_hook:
            final = reader_hook(self.R - 1, final, c.num_layers)
        x = self._norm(final[:, :, 0], self.final_norm)
        return x[torch.arange(B), last] @ self.lm_head

    # ------------------------------------------------------------------ the package's hooks

    def _prev_writers(self, first_reader: int) -> int:
        """How many writers come before reader `first_reader` (the package's `prev_index`)."""
        H = self.config.num_heads
        layer, slot = divmod(first_reader, 3 * H + 1)
        if first_reader == self.R - 1:
            return self.W
        return 1 + layer * (H + 1) + (H if slot == 3 * H else 0)

    def _activations(self, tokens, valid, last, store, sign, hidden_store=None):
        def record(first, outputs):
            store[:, :, first : first + outputs.shape[2]] += sign * outputs.detach()

        def record_hidden(layer, hidden):
            hidden_store[layer] += sign * hidden.detach()
            return hidden

        with torch.no_grad():
            hook = None if hidden_store is None else record_hidden
            return self.forward(self.embed[tokens], valid, last, writer_hook=record, hidden_hook=hook)

    def _score_hooks(self, difference, scores, per_position: bool):
        spec = "btwd,btrd->wrt" if per_position else "btwd,btrd->wr"

        def reader_hook(first, inputs, layer):
            inputs = inputs.clone().requires_grad_(True)
            prev = self._prev_writers(first)

            def backward(grad):
                scores[:prev, first : first + grad.shape[2]] += torch.einsum(spec, difference[:, :, :prev], grad)

            inputs.register_hook(backward)
            return inputs

        return reader_hook

    def eap(self, clean, corrupt, valid, last, labels, steps: int = 0):
        """Scores `[W, R]` summed over the pairs: EAP (`steps` 0) or EAP-IG over the inputs
        with `steps` steps (averaged over the steps)."""
        return self.attribute(clean, corrupt, valid, last, labels, steps)["scores"]

    def attribute(self, clean, corrupt, valid, last, labels, steps: int = 0, per_position=False, neurons=False):
        """`{"scores": [W, R] (per_position: [W, R, T]), "neurons": [L, F] (with neurons)}`,
        summed over the pairs: EAP (`steps` 0) or EAP-IG over the inputs with `steps` steps."""
        c = self.config
        B, T = clean.shape
        difference = torch.zeros(B, T, self.W, c.hidden_size)
        hidden_difference = torch.zeros(c.num_layers, B, T, c.intermediate_size) if neurons else None
        self._activations(clean, valid, last, difference, 1.0, hidden_difference)
        self._activations(corrupt, valid, last, difference, -1.0, hidden_difference)
        scores = torch.zeros((self.W, self.R, T) if per_position else (self.W, self.R))
        hook = self._score_hooks(difference, scores, per_position)
        hidden_gradient = torch.zeros_like(hidden_difference) if neurons else None

        def gradient_at_hidden(layer, hidden):
            def backward(grad):
                hidden_gradient[layer] += grad

            hidden.register_hook(backward)
            return hidden

        e_clean, e_corrupt = self.embed[clean], self.embed[corrupt]
        for k in range(max(steps, 1)):
            h0 = e_clean if steps == 0 else e_corrupt + (k / steps) * (e_clean - e_corrupt)
            logits = self.forward(
                h0, valid, last, reader_hook=hook, hidden_hook=gradient_at_hidden if neurons else None
            )
            metric(logits, labels).sum().backward()
        out = {"scores": scores / max(steps, 1)}
        if neurons:
            out["neurons"] = torch.einsum("lbtf,lbtf->lf", hidden_difference, hidden_gradient) / max(steps, 1)
        return out

    def greedy(self, scores: np.ndarray, n: int) -> np.ndarray:
        """`[n, 2]` (writer, reader): the package's `apply_greedy` by |score| (`scores [W, R]`)."""
        H = self.config.num_heads
        per_layer = 3 * H + 1

        def writer_of_reader(r):  # the node a reader belongs to, as a writer index (-1: the logits)
            if r == self.R - 1:
                return -1
            layer, slot = divmod(r, per_layer)
            return 1 + layer * (H + 1) + (H if slot == 3 * H else slot % H)

        def in_edges(node):  # every edge into the readers of a node, best first
            readers = [r for r in range(self.R) if writer_of_reader(r) == node]
            edges = [(w, r) for r in readers for w in range(self._prev_writers(r))]
            return sorted(edges, key=lambda e: -abs(float(scores[e])))

        candidates = heapq.merge(in_edges(-1), key=lambda e: -abs(float(scores[e])))
        in_circuit, order = set(), []
        while len(order) < n:
            w, r = next(candidates)
            order.append((w, r))
            if w not in in_circuit:
                in_circuit.add(w)
                candidates = heapq.merge(candidates, in_edges(w), key=lambda e: -abs(float(scores[e])))
        return np.array(order, np.int64)

    def patched(self, clean, corrupt, valid, last, labels, patched_edges: list[np.ndarray]):
        """F `[n, B]` with each edge set (a `[W, R]` bool array) patched, one forward each."""
        B, T = clean.shape
        corrupt_out = torch.zeros(B, T, self.W, self.config.hidden_size)
        self._activations(corrupt, valid, last, corrupt_out, 1.0)
        out = []
        with torch.no_grad():
            for edges in patched_edges:
                patched = torch.as_tensor(edges, dtype=torch.float32)
                missing = corrupt_out.clone()  # corrupt - current, filled as writers run

                def writer_hook(first, outputs):
                    missing[:, :, first : first + outputs.shape[2]] -= outputs

                def reader_hook(first, inputs, layer):
                    prev = self._prev_writers(first)
                    n = inputs.shape[2]
                    update = torch.einsum("btwd,wr->btrd", missing[:, :, :prev], patched[:prev, first : first + n])
                    return inputs + update

                logits = self.forward(self.embed[clean], valid, last, writer_hook=writer_hook, reader_hook=reader_hook)
                out.append(metric(logits, labels).numpy())
        return np.stack(out)


def metric(logits, labels):
    """The logit difference of (right, wrong) `labels [B, 2]` per pair."""
    rows = torch.arange(logits.shape[0])
    return logits[rows, labels[:, 0]] - logits[rows, labels[:, 1]]
