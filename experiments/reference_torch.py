"""The reference approach, in PyTorch: a Hugging Face `transformers` model with forward hooks,
batch 1, one forward pass per intervention, as the published code of the two studies does.

This is the baseline `experiments/benchmark.py` times jaxdepth against. It implements every
analysis of `shared/METHODS.md` independently of jaxdepth (nothing here calls the library's
analysis code), so that agreement between the two is evidence that both compute the same thing:

- contributions / cosine (§1): one forward per prompt; hooks capture h_l (layer input),
  a_l (`self_attn` output) and m_l (`mlp` output);
- logit lens (§2): one forward per prompt with `output_hidden_states`, then final norm + LM head
  per layer;
- layer skip (§3): per prompt, skipped layer s and split t_s, one forward with a hook making
  layer s return its input at positions 1..t_s-1; pre-hooks record every boundary h_0..h_L;
- residual erasure (§4): per prompt, boundary l and position t, one forward with a pre-hook on
  layer l (l = 0: the embeddings, i.e. layer 0's input; l = L: the final norm's input) replacing
  h_l[t] by the baseline;
- integrated gradients (§5), as the first study's published code batches it: per prompt and
  layer l, the layers up to l run once; the interpolated outputs of layer l are stacked into
  blocks of 16 steps (`IG_BLOCK`), and each block runs layers l+1.. and the head as one batch
  forward and one backward (`integrated_gradients`). `integrated_gradients_batch1` is the
  slower batch-1 form (one forward and backward per (layer, step)), kept for comparison.

Token inputs are plain lists of ints (one prompt each, no padding: batch 1 needs none).

Device: every tensor the reference makes is created on the device of the model's parameters
(`Reference.device`: build or move the model there, e.g. `with torch.device("cuda"):` around its
construction), and results come back to the host as numpy arrays. Nothing here sets torch's
default device: `torch.set_default_device` adds a per-operation cost that would slow the
reference down.
"""

from __future__ import annotations

import contextlib
import os
from typing import Sequence

import numpy as np

from jaxdepth.lab.optional import require

torch = require(
    "torch",
    purpose="the PyTorch reference (experiments/reference_torch.py)",
    install="pip install torch==2.13.0 accelerate (the CPU build; or the README's test set-up)",
)

NORM_EPS = 1e-6
TOP_K = 5
IG_BLOCK = 16  # interpolation steps per forward and backward in the published code (BLOCK_SIZE)


def load_hf_model(gguf_path: str):
    """transformers' own float32 model, read from the same GGUF file jaxdepth converts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    model.eval()
    model.requires_grad_(False)  # gradients are only ever taken w.r.t. injected activations
    return model


@contextlib.contextmanager
def hooks(*handles_or_registrations):
    """Remove every hook handle on exit, whatever happens inside."""
    handles = list(handles_or_registrations)
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()


def _ids(tokens: Sequence[int], device=None) -> torch.Tensor:
    return torch.as_tensor(np.asarray(tokens, np.int64), device=device)[None]


def _host(x: torch.Tensor) -> np.ndarray:
    """A result tensor as a numpy array (a copy from the device when it is not on the CPU)."""
    return x.cpu().numpy()


def _rel_norm(x, y):
    return x.norm(dim=-1) / y.norm(dim=-1).clamp_min(NORM_EPS)


def _cos(x, y):
    return (x * y).sum(-1) / (x.norm(dim=-1) * y.norm(dim=-1)).clamp_min(NORM_EPS)


class Reference:
    """Hook-based analyses on a `LlamaForCausalLM` / `Qwen2ForCausalLM`."""

    def __init__(self, model):
        self.model = model
        self.layers = model.model.layers
        self.final_norm = model.model.norm
        self.L = len(self.layers)
        self.device = next(model.parameters()).device  # where every tensor of the analyses is made
        self.forwards = 0  # forward passes run (backward passes are counted in `backwards`)
        self.backwards = 0

    # ------------------------------------------------------------------ plumbing
    def _ids(self, tokens: Sequence[int]) -> torch.Tensor:
        return _ids(tokens, self.device)

    def _arange(self, *args, **kw) -> torch.Tensor:
        return torch.arange(*args, device=self.device, **kw)

    def _logits(self, ids: torch.Tensor, **kw) -> torch.Tensor:
        self.forwards += 1
        return self.model(input_ids=ids, use_cache=False, **kw)

    def _boundary_recorders(self, store: list):
        """Pre-hooks recording every residual boundary h_0..h_L (the inputs of the layers and of
        the final norm), after any modification made by earlier hooks."""
        store.extend([None] * (self.L + 1))

        def rec(index):
            def pre_hook(module, args):
                store[index] = args[0].detach()[0].float()

            return pre_hook

        modules = list(self.layers) + [self.final_norm]
        return [m.register_forward_pre_hook(rec(i)) for i, m in enumerate(modules)]

    def _boundary_module(self, boundary: int):
        return self.final_norm if boundary == self.L else self.layers[boundary]

    # ------------------------------------------------------------------ §1
    @torch.no_grad()
    def contributions(self, token_lists) -> dict:
        """Per-layer curves `[L]` of the six statistics (token mean over every token of every
        prompt) and the per-token values `[P][L, T, 6]`."""
        per_prompt = []
        for tokens in token_lists:
            h, a, m = [None] * self.L, [None] * self.L, [None] * self.L

            def cap(store, index, pre=False):
                if pre:
                    return lambda mod, args: store.__setitem__(index, args[0][0].float())
                return lambda mod, args, out: store.__setitem__(
                    index, (out[0] if isinstance(out, tuple) else out)[0].float()
                )

            handles = []
            for i, layer in enumerate(self.layers):
                handles.append(layer.register_forward_pre_hook(cap(h, i, pre=True)))
                handles.append(layer.self_attn.register_forward_hook(cap(a, i)))
                handles.append(layer.mlp.register_forward_hook(cap(m, i)))
            with hooks(*handles):
                self._logits(self._ids(tokens))
            stats = []
            for hl, al, ml in zip(h, a, m):
                mid, lay = hl + al, al + ml
                stats.append(
                    torch.stack(
                        [
                            _rel_norm(al, hl),
                            _rel_norm(ml, mid),
                            _rel_norm(lay, hl),
                            _cos(al, hl),
                            _cos(ml, mid),
                            _cos(lay, hl),
                        ],
                        dim=-1,
                    )
                )
            per_prompt.append(_host(torch.stack(stats)))  # [L, T, 6]
        allv = np.concatenate(per_prompt, axis=1)  # [L, sum T, 6]
        names = ("norm_attn", "norm_mlp", "norm_layer", "cos_attn", "cos_mlp", "cos_layer")
        curves = {n: allv[:, :, k].mean(axis=1) for k, n in enumerate(names)}
        return {"curves": curves, "per_token": per_prompt}

    # ------------------------------------------------------------------ §2
    @torch.no_grad()
    def logit_lens(self, token_lists) -> dict:
        """Prompt-weighted curves `[L]` of KL(P_l || P) and top-5 overlap, and per-token values."""
        kls, overlaps = [], []
        for tokens in token_lists:
            out = self._logits(self._ids(tokens), output_hidden_states=True)
            final = out.logits[0].float()
            final_logp = torch.log_softmax(final, -1)
            final_top = final.topk(TOP_K, dim=-1).indices
            kl_p, ov_p = [], []
            for l in range(self.L):  # hidden_states[l] = h_l for l < L (h_0 = the embeddings)
                logits = self.model.lm_head(self.final_norm(out.hidden_states[l]))[0].float()
                logp = torch.log_softmax(logits, -1)
                kl_p.append((logp.exp() * (logp - final_logp)).sum(-1))
                top = logits.topk(TOP_K, dim=-1).indices
                ov_p.append((top[:, :, None] == final_top[:, None, :]).sum((-2, -1)).float() / TOP_K)
            kls.append(_host(torch.stack(kl_p)))
            overlaps.append(_host(torch.stack(ov_p)))
        return {
            "kl": np.mean([k.mean(axis=1) for k in kls], axis=0),
            "overlap": np.mean([o.mean(axis=1) for o in overlaps], axis=0),
            "kl_per_token": kls,
            "overlap_per_token": overlaps,
        }

    # ------------------------------------------------------------------ §3
    @torch.no_grad()
    def layer_skip(self, token_lists, splits: Sequence[Sequence[int]]) -> dict:
        """`later [L, L]` and `output [L]`: max over positions p >= t_s, splits and prompts."""
        L = self.L
        P = len(token_lists)
        later = np.zeros((P, L, L), np.float32)
        output = np.zeros((P, L), np.float32)
        for i, tokens in enumerate(token_lists):
            if not splits[i]:
                continue
            ids = self._ids(tokens)
            hs: list = []
            with hooks(*self._boundary_recorders(hs)):
                clean_probs = torch.softmax(self._logits(ids).logits[0].float(), -1)
            clean_delta = torch.stack([hs[j + 1] - hs[j] for j in range(L)])  # [L, T, D]
            for s in range(L):
                for t in splits[i]:

                    def skip(module, args, out, t=t):
                        new = out.clone()
                        new[:, 1:t] = args[0][:, 1:t]
                        return new

                    hs = []
                    with hooks(self.layers[s].register_forward_hook(skip), *self._boundary_recorders(hs)):
                        probs = torch.softmax(self._logits(ids).logits[0].float(), -1)
                    delta = torch.stack([hs[j + 1] - hs[j] for j in range(L)])
                    change = _rel_norm(clean_delta - delta, clean_delta)[:, t:]  # [L, T - t]
                    later[i, s] = np.maximum(later[i, s], _host(change.max(dim=1).values))
                    out_change = (probs - clean_probs)[t:].norm(dim=-1).max().item()
                    output[i, s] = max(output[i, s], out_change)
        return {
            "later": later.max(axis=0),
            "output": output.max(axis=0),
            "later_per_prompt": later,
            "output_per_prompt": output,
        }

    # ------------------------------------------------------------------ §4
    @torch.no_grad()
    def erasure(self, token_lists, answer_starts: Sequence[int], baseline: np.ndarray) -> list:
        """Per prompt `[L+1, T]`: max over answer-predicting positions of ||y - ȳ||_2 when h_l[t]
        is replaced by `baseline[l]`."""
        base = torch.as_tensor(np.asarray(baseline, np.float32), device=self.device)
        results = []
        for tokens, start in zip(token_lists, answer_starts):
            ids = self._ids(tokens)
            T = len(tokens)
            predicting = slice(start - 1, T - 1)  # positions p whose output predicts answer token p+1
            clean = torch.softmax(self._logits(ids).logits[0].float(), -1)[predicting]
            effects = np.zeros((self.L + 1, T), np.float32)
            for l in range(self.L + 1):
                for t in range(T):

                    def erase(module, args, l=l, t=t):
                        h = args[0].clone()
                        h[:, t] = base[l]
                        return (h,) + tuple(args[1:])

                    with hooks(self._boundary_module(l).register_forward_pre_hook(erase)):
                        probs = torch.softmax(self._logits(ids).logits[0].float(), -1)[predicting]
                    effects[l, t] = (probs - clean).norm(dim=-1).max().item()
            results.append(effects)
        return results

    # ------------------------------------------------------------------ attribution patching
    def attribution_patching(self, token_lists, answer_starts: Sequence[int], baseline: np.ndarray) -> dict:
        """Per prompt: `patching [L+1, T]` = grad_l[t] . (b_l - h_l[t]) and `grad_x_act [L+1, T]`
        = grad_l[t] . h_l[t] of F (the IG objective), and `f_input` = F(x): one forward
        recording every boundary h_0..h_L, one backward to all of them."""
        base = torch.as_tensor(np.asarray(baseline, np.float32), device=self.device)
        modules = list(self.layers) + [self.final_norm]
        out = {"patching": [], "grad_x_act": [], "f_input": []}
        for tokens, start in zip(token_lists, answer_starts):
            ids = self._ids(tokens)
            T = len(tokens)
            predicting, targets = self._arange(start - 1, T - 1), ids[0, start:T]
            boundaries = [None] * (self.L + 1)

            def keep(index):
                def pre_hook(module, args):
                    h = args[0]
                    if index == 0:  # the first boundary becomes the leaf the gradient flows back to
                        h = h.detach().requires_grad_(True)
                    boundaries[index] = h
                    return (h,) + tuple(args[1:])

                return pre_hook

            with torch.enable_grad(), hooks(*[m.register_forward_pre_hook(keep(i)) for i, m in enumerate(modules)]):
                f = torch.softmax(self._logits(ids).logits[0].float(), -1)[predicting, targets].sum()
                grads = torch.autograd.grad(f, boundaries)
            self.backwards += 1
            g = torch.stack([x[0] for x in grads]).float()  # [L+1, T, D]
            h = torch.stack([x[0] for x in boundaries]).detach().float()
            out["patching"].append(_host(((base[:, None] - h) * g).sum(-1)))
            out["grad_x_act"].append(_host((h * g).sum(-1)))
            out["f_input"].append(f.item())
        return out

    # ------------------------------------------------------------------ §5
    def _run_from(self, h: torch.Tensor, start: int) -> torch.Tensor:
        """Logits `[B, T, V]` of running layers start..L-1, the final norm and the LM head on the
        boundary-`start` residuals `h [B, T, D]` (the layers before `start` are not run)."""
        # No mask is passed: sdpa then attends causally by itself (eager attention would not).
        if self.model.config._attn_implementation != "sdpa":
            raise ValueError("the reference's suffix runs need sdpa attention (causal without a mask)")
        T = h.shape[1]
        positions = self._arange(T)[None]
        rotary = self.model.model.rotary_emb(h, positions)
        for layer in self.layers[start:]:
            out = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out  # causal: sdpa with no mask
        self.forwards += 1
        return self.model.lm_head(self.final_norm(h))

    def integrated_gradients(
        self, token_lists, answer_starts: Sequence[int], steps: int, block: int = IG_BLOCK, layers=None
    ) -> dict:
        """Left-Riemann IG with the per-channel mean baseline, batched as the published code:
        one forward and one backward per block of `block` steps, starting after layer l. Per
        prompt: `attributions [L, T]`, `f_input` = F(x), `f_baseline [L]` = F(b), completeness
        `gap [L]`; `layers` (default all) the layers attributed (the others' rows stay zero)."""
        alphas = self._arange(steps, dtype=torch.float32) / steps
        out = {"attributions": [], "f_input": [], "f_baseline": [], "gap": []}
        for tokens, start in zip(token_lists, answer_starts):
            ids = self._ids(tokens)
            T = len(tokens)
            predicting, targets = self._arange(start - 1, T - 1), ids[0, start:T]

            def objective(logits):  # [B, T, V] -> F per batch member [B]
                return torch.softmax(logits.float(), -1)[:, predicting, targets].sum(-1)

            hs: list = []
            with torch.no_grad(), hooks(*self._boundary_recorders(hs)):
                f_input = objective(self._logits(ids).logits).item()
            attributions = np.zeros((self.L, T), np.float32)
            f_baseline = np.zeros(self.L, np.float32)
            for l in range(self.L) if layers is None else layers:
                x = hs[l + 1]  # [T, D], the output of layer l (the layers up to l ran once, above)
                b = x.mean(dim=0, keepdim=True)
                with torch.no_grad():
                    f_baseline[l] = objective(self._run_from(b.expand_as(x)[None], l + 1)).item()
                total = torch.zeros_like(x)
                for first in range(0, steps, block):
                    a = alphas[first : first + block][:, None, None]
                    z = (b + a * (x - b)).requires_grad_(True)  # [block, T, D]
                    (g,) = torch.autograd.grad(objective(self._run_from(z, l + 1)).sum(), z)
                    self.backwards += 1
                    total += g.sum(0)
                attributions[l] = _host(((x - b) * total / steps).sum(-1))
            _add_ig_prompt(out, attributions, f_input, f_baseline)
        return out

    def integrated_gradients_batch1(self, token_lists, answer_starts: Sequence[int], steps: int) -> dict:
        """The same IG at batch 1: one full forward and one backward per (layer, step), layer
        l's output replaced by a hook (slower than the published code; for comparison only)."""
        L = self.L
        alphas = [k / steps for k in range(steps)]
        out = {"attributions": [], "f_input": [], "f_baseline": [], "gap": []}
        for tokens, start in zip(token_lists, answer_starts):
            ids = self._ids(tokens)
            T = len(tokens)
            predicting = self._arange(start - 1, T - 1)
            targets = ids[0, start:T]

            def objective(logits):
                probs = torch.softmax(logits[0].float(), -1)
                return probs[predicting, targets].sum()

            hs: list = []
            with torch.no_grad(), hooks(*self._boundary_recorders(hs)):
                f_input = objective(self._logits(ids).logits).item()
            attributions = np.zeros((L, T), np.float32)
            f_baseline = np.zeros(L, np.float32)
            for l in range(L):
                x = hs[l + 1]  # [T, D], the output of layer l
                b = x.mean(dim=0, keepdim=True)  # per-channel mean over positions
                replacement = {}

                def replace(module, args, output):
                    return replacement["z"][None]

                with hooks(self.layers[l].register_forward_hook(replace)):
                    replacement["z"] = b.expand_as(x)
                    with torch.no_grad():
                        f_baseline[l] = objective(self._logits(ids).logits).item()
                    total = torch.zeros_like(x)
                    for alpha in alphas:
                        z = (b + alpha * (x - b)).requires_grad_(True)
                        replacement["z"] = z
                        f = objective(self._logits(ids).logits)
                        (g,) = torch.autograd.grad(f, z)
                        self.backwards += 1
                        total += g
                attributions[l] = _host(((x - b) * total / steps).sum(-1))
            _add_ig_prompt(out, attributions, f_input, f_baseline)
        return out


# ---------------------------------------------------------------------- effective depth (§6)
# The reference rules, written out independently of jaxdepth.analyses.effective_depth; -1 = no layer
# qualifies (the published code's convention for KL and overlap; it raises for cosine).


def _add_ig_prompt(out: dict, attributions, f_input, f_baseline):
    """Append one prompt's IG to `out`, with its completeness gap per layer."""
    out["attributions"].append(attributions)
    out["f_input"].append(f_input)
    out["f_baseline"].append(f_baseline)
    out["gap"].append(attributions.sum(-1) - (f_input - f_baseline))


def ed_cosine(mean_cos) -> int:
    c = np.asarray(mean_cos)
    hits = [l for l in range(len(c) - 1) if c[l] < 0 <= c[l + 1]]
    return hits[-1] if hits else -1


def ed_kl(kl, fraction=0.5) -> int:
    c = np.asarray(kl)
    return next((l for l in range(len(c) - 1) if c[l] < fraction * c.max()), -1)


def ed_overlap(overlap, threshold=0.3) -> int:
    c = np.asarray(overlap)
    return next((l for l in range(len(c) - 1) if c[l] > threshold), -1)


def depth_score(later) -> float:
    D = np.asarray(later, np.float64)
    L = D.shape[0]
    e = np.array([D[s].sum() / max(L - 1 - s, 1) for s in range(L)])
    return float((np.arange(L) * e).sum() / e.sum())
