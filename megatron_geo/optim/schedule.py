"""Learning-rate schedule: linear warmup, then cosine (or linear/constant) decay to a minimum."""

from __future__ import annotations

import math


def lr_at(
    step: int, *, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int, style: str = "cosine"
) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Warmup: ``max_lr * (step + 1) / warmup_steps`` for ``step < warmup_steps`` (never 0, so the first
    step already moves). Decay over the remaining steps so that the last step (``total_steps - 1``)
    uses exactly ``min_lr``; steps beyond ``total_steps`` stay at ``min_lr``. Cosine:
    ``min + (max - min) * (1 + cos(pi * t)) / 2`` with ``t`` in [0, 1] (Loshchilov & Hutter 2017).
    """
    if warmup_steps > 0 and step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if style == "constant":
        return max_lr
    span = total_steps - 1 - warmup_steps
    t = 1.0 if span <= 0 else min(max((step - warmup_steps) / span, 0.0), 1.0)
    if style == "linear":
        return max_lr + (min_lr - max_lr) * t
    if style == "cosine":
        return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
    raise ValueError(f"unknown lr decay style {style!r}; choose cosine, linear or constant")
