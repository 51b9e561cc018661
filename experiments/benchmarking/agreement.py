"""The rows that compare jaxdepth's results with the reference's."""

from __future__ import annotations

import numpy as np


def diff_row(analysis, quantity, ours, theirs, tol_rel=1e-3, exact=False):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if ours.shape != theirs.shape:
        return dict(
            analysis=analysis,
            quantity=quantity,
            max_abs_diff=None,
            scale=None,
            ok=False,
            note=f"shape mismatch {ours.shape} vs {theirs.shape}",
        )
    diff = float(np.max(np.abs(ours - theirs))) if ours.size else 0.0
    scale = float(np.max(np.abs(theirs))) if theirs.size else 0.0
    ok = diff == 0 if exact else diff <= tol_rel * max(scale, 1e-12) + 1e-7
    return dict(
        analysis=analysis,
        quantity=quantity,
        max_abs_diff=diff,
        scale=scale,
        ok=bool(ok),
        note="must be equal" if exact else f"tol {tol_rel:g} x scale",
    )


def value_row(analysis, quantity, ours, theirs, ok=None, note=""):
    ok = bool(ours == theirs) if ok is None else bool(ok)
    return dict(analysis=analysis, quantity=quantity, jaxdepth=ours, reference=theirs, ok=ok, note=note)


def ed_row(analysis, quantity, ours, theirs, our_curve, their_curve):
    """Effective depth read by jaxdepth's rule on its curve and by the reference rule on the
    reference curve (-1 = no layer qualifies); on a mismatch, the curves at the layers involved."""
    ours = -1 if ours is None else int(ours)
    note = ""
    if ours != theirs:
        at = sorted({l for l in (ours, theirs) if l >= 0})
        note = "curves there: " + ", ".join(
            f"l={l}: jax {float(np.asarray(our_curve)[l]):.9g} ({np.asarray(our_curve).dtype}), "
            f"ref {float(np.asarray(their_curve)[l]):.9g} ({np.asarray(their_curve).dtype})"
            for l in at
        )
    return value_row(analysis, quantity, ours, theirs, note=note)


def cut_to_lengths(x, lengths):
    """[P, ..., T] padded per-position values, each prompt cut to its length and the prompts
    concatenated along the last axis (the reference's lists, made one array)."""
    return np.concatenate([np.asarray(x)[i, :, :n] for i, n in enumerate(lengths)], axis=1)
