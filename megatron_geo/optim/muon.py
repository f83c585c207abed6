"""Muon with a selectable Newton-Schulz precision.

``torch.optim.Muon`` runs its Newton-Schulz orthogonalisation in BF16. That is right on GPUs, but CPU
BF16 matmuls are pathologically slow (measured on the 2-core CI machine: three 1536x4096 products take
76 s in BF16 and 0.56 s in FP32; one Llama-600M Muon step would take over an hour). ``build_muon``
therefore returns torch's own ``Muon`` on CUDA (or with ``ns_dtype=bf16``) and :class:`MuonNS`, a
subclass that only changes the precision of the orthogonalisation, on CPU.

The update is Muon's (Jordan et al. 2024, "Muon: An optimizer for hidden layers"; torch.optim.Muon):
momentum ``B <- m B + (1 - m) G``, Nesterov ``U = (1 - m) G + m B``, ``O = NS5(U)`` (quintic
Newton-Schulz, coefficients (3.4445, -4.7750, 2.0315), 5 steps, after scaling U to unit Frobenius
norm), decoupled weight decay ``W <- W (1 - lr wd)``, ``W <- W - lr' O`` with lr' from ``adjust_lr_fn``
(``match_rms_adamw``: ``0.2 sqrt(max(A, B)) lr``, Liu et al. 2025, "Muon is scalable for LLM training").
"""

from __future__ import annotations

import math

import torch


def newton_schulz5(
    u: torch.Tensor, coeffs: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Approximate orthogonalisation ``U (U^T U)^{-1/2}`` of a 2-D ``u`` (any float dtype) computed in ``dtype``.

    Returns a tensor of ``u``'s shape in ``dtype``. Iterates ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T`` on the wide orientation of the matrix.
    """
    a, b, c = coeffs
    x = u.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.T if tall else x


def adjusted_lr(lr: float, fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate for a ``[A, B]`` weight (``original`` / ``match_rms_adamw``)."""
    rows, cols = shape[0], shape[1]
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr


class MuonNS(torch.optim.Muon):
    """``torch.optim.Muon`` (same constructor, defaults, state names) with Newton-Schulz in ``ns_dtype``."""

    def __init__(self, params, ns_dtype: torch.dtype = torch.float32, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, m = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.ndim != 2:
                    raise ValueError(f"Muon needs 2-D parameters, got shape {tuple(p.grad.shape)}")
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - m)
                upd = p.grad.lerp(buf, m) if group["nesterov"] else buf
                ortho = newton_schulz5(upd, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                p.mul_(1 - lr * wd)
                p.add_(ortho.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def build_muon(params, on_cuda: bool, ns_dtype: str = "auto", **kwargs) -> torch.optim.Optimizer:
    """torch's Muon on CUDA (or ``ns_dtype=bf16``); :class:`MuonNS` with FP32 Newton-Schulz otherwise."""
    if ns_dtype == "bf16" or (ns_dtype == "auto" and on_cuda):
        return torch.optim.Muon(params, **kwargs)
    return MuonNS(params, ns_dtype=torch.float32, **kwargs)
