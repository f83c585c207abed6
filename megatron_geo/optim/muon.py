"""Muon with a selectable Newton-Schulz precision.

``torch.optim.Muon`` runs its Newton-Schulz orthogonalisation in BF16. That is right on GPUs, but CPU
BF16 matmuls are pathologically slow (measured on the 2-core CI machine: three 1536x4096 products take
76 s in BF16 and 0.56 s in FP32; one Llama-600M Muon step would take over an hour). ``build_muon``
therefore returns torch's own ``Muon`` on CUDA (or with ``optimizer.muon_ns_dtype=bf16``) and :class:`MuonNS`, a
subclass that only changes the precision of the orthogonalisation, on CPU (:func:`newton_schulz_dtype`).

The update is Muon's (Jordan et al. 2024, "Muon: An optimizer for hidden layers"; torch.optim.Muon):
momentum ``B <- m B + (1 - m) G``, Nesterov ``U = (1 - m) G + m B``, ``O = NS5(U)`` (quintic
Newton-Schulz, coefficients (3.4445, -4.7750, 2.0315), 5 steps, after scaling U to unit Frobenius
norm), decoupled weight decay ``W <- W (1 - lr wd)``, ``W <- W - lr' O`` with lr' from ``adjust_lr_fn``
(``match_rms_adamw``: ``0.2 sqrt(max(A, B)) lr``, Liu et al. 2025, "Muon is scalable for LLM training").

``NS5`` is computed one of two ways, chosen by ``optimizer.muon_ns``: ``quintic`` (:func:`newton_schulz5`,
torch's own iteration, the default) or ``gram`` (:func:`gram_newton_schulz`, the same polynomial carried on
the small Gram matrix; Zhang, Amsel, Chen, Dao 2026, "Gram Newton-Schulz"). With ``gram``, :class:`MuonNS`
is used on CUDA too (BF16 there, unless ``optimizer.muon_ns_dtype`` says otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config.checks import choices_of
from ..config.errors import ConfigError
from ..config.schema import OptimizerConfig

if TYPE_CHECKING:
    from ..config.schema import OptimizerConfig


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


#: the Newton-Schulz forms (``optimizer.muon_ns``), as the schema lists them
NS_CHOICES = choices_of(OptimizerConfig, "muon_ns")


@dataclass(frozen=True)
class NSSettings:
    """How to run one Newton-Schulz orthogonalisation: the arguments :func:`orthogonalize` takes besides the matrix,
    kept together for the functions that pass them on (:func:`~megatron_geo.optim.split_ns.split_orthogonalize`).

    Attributes:
        ns: ``quintic`` or ``gram`` (:data:`NS_CHOICES`; checked by the function that runs it).
        coeffs: the quintic's ``(a, b, c)`` (torch.optim.Muon: ``(3.4445, -4.7750, 2.0315)``).
        steps: number of polynomial applications (torch.optim.Muon: 5).
        eps: lower bound of the Frobenius norm the matrix is divided by.
        dtype: the precision of the iteration (FP32, BF16, FP16 or FP64).
    """

    ns: str
    coeffs: tuple[float, float, float]
    steps: int
    eps: float
    dtype: torch.dtype


def gram_restarts(steps: int) -> tuple[int, ...]:
    """The iterations (0-based) before which :func:`gram_newton_schulz` rebuilds its Gram matrix from ``X``.

    ``2, 5, 8, ...`` below ``steps``: for Muon's 5 steps one restart, before the third iteration, as the
    published method recommends (Zhang, Amsel, Chen, Dao 2026, "Gram Newton-Schulz",
    dao-ailab.github.io/blog/2026/gram-newton-schulz; its code restarts after the 2nd of 5 iterations); longer
    runs get one more every 3 iterations, so the Gram matrix is never carried through more than 3 polynomials.
    """
    return tuple(range(2, steps, 3))


def gram_newton_schulz(
    u: torch.Tensor,
    coeffs: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
    restarts: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """:func:`newton_schulz5`'s result, computed by iterating on the small Gram matrix ("Gram Newton-Schulz").

    Args:
        u: a 2-D float tensor ``[A, B]`` (any float dtype, any device).
        coeffs: the quintic's ``(a, b, c)`` (torch.optim.Muon: ``(3.4445, -4.7750, 2.0315)``).
        steps: number of polynomial applications (torch.optim.Muon: 5).
        eps: lower bound of the Frobenius norm ``u`` is divided by.
        dtype: the precision of the iteration (FP32, BF16, FP16 or FP64).
        restarts: iterations (0-based) before which the Gram matrix is rebuilt; default :func:`gram_restarts`.

    Returns:
        A tensor of ``u``'s shape in ``dtype``.

    Derivation (Zhang, Amsel, Chen, Dao 2026, "Gram Newton-Schulz: a fast, hardware-aware Newton-Schulz
    algorithm for Muon", dao-ailab.github.io/blog/2026/gram-newton-schulz; github.com/Dao-AILab/gram-newton-schulz).
    Work on the wide orientation ``X_0`` ``[m, n]``, ``m <= n`` (``u`` transposed when tall), scaled to unit
    Frobenius norm. One quintic step is ``X_{t+1} = P_t X_t`` with ``P_t = a I + b R_t + c R_t^2`` and
    ``R_t = X_t X_t^T`` ``[m, m]``. Every ``P_t`` is a polynomial in ``R_t``, so it is symmetric and commutes
    with ``R_t``. Hence

    - ``X_t = Q_t X_0`` with ``Q_0 = I`` and ``Q_{t+1} = P_t Q_t`` (all ``Q_t`` are polynomials in ``R_0``);
    - ``R_{t+1} = P_t X_t X_t^T P_t^T = P_t R_t P_t``; with ``Z_t = b R_t + c R_t^2`` and
      ``S = a R_t + R_t Z_t``: ``R_{t+1} = a S + Z_t S``.

    So in exact arithmetic ``Q_T X_0`` equals the quintic's ``X_T``, while ``X`` (the large ``[m, n]`` matrix)
    is touched only by ``R_0 = X_0 X_0^T`` and the final ``Q_T X_0`` (``2 m^2 n`` multiply-adds in all, plus
    ``2 m^2 n`` per restart) instead of ``2 m^2 n`` per step; the ``[m, m]`` products cost at most ``4 m^3`` per
    step (quintic: ``m^3``). For 5 steps with one restart: ``4 m^2 n + 14 m^3`` against ``10 m^2 n + 5 m^3``,
    fewer when ``n > 1.5 m``.

    Precautions of the published method, done here too: (1) the Frobenius normalisation is computed in FP32 (or
    FP64 when ``dtype`` is FP64) before the cast to ``dtype``, so a large finite gradient cannot overflow a half
    type; (2) restarts: rounding makes the carried ``R_t`` drift from the true ``X_t X_t^T`` (spurious negative
    eigenvalues, which the polynomial amplifies, and eigenvector drift between ``R`` and ``Q``), so before the
    iterations in ``restarts`` ``X <- Q X``, ``R <- X X^T``, ``Q <- I`` are recomputed (one restart for 5 steps:
    two more ``m^2 n`` products). The published code iterates in FP16 on GPUs; here the precision is
    ``dtype`` (BF16 on CUDA by default, as torch.optim.Muon). The published code uses the Gram form only for
    rectangular matrices (:class:`MuonNS` does the same); this function applies it to any shape.
    """
    a, b, c = coeffs
    wide_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = u.to(wide_dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = (x / x.norm().clamp(min=eps)).to(dtype).contiguous()  # row-major: X X^T and Q X read it as rows
    restart_at = set(gram_restarts(steps) if restarts is None else restarts)
    eye = torch.eye(x.shape[0], dtype=dtype, device=x.device)
    gram = x @ x.T
    q: torch.Tensor | None = None  # None: the identity (after the start or a restart)
    for t in range(steps):
        if t > 0 and t in restart_at:
            assert q is not None
            x = q @ x
            gram = x @ x.T
            q = None
        z = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b R + c R^2
        q = z + a * eye if q is None else torch.addmm(q, z, q, beta=a)  # P Q = a Q + Z Q
        if t + 1 < steps and (t + 1) not in restart_at:
            s = torch.addmm(gram, gram, z, beta=a)  # a R + R Z
            gram = torch.addmm(s, z, s, beta=a)  # a S + Z S = P R P
    out = x if q is None else q @ x
    return out.T if tall else out


def orthogonalize(
    u: torch.Tensor, ns: str, coeffs: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """``NS5(u)`` by ``ns``: ``quintic`` (:func:`newton_schulz5`) or ``gram`` (:func:`gram_newton_schulz` for a
    rectangular ``u``, the quintic for a square one, where the Gram form saves nothing, as the published method
    does). Returns ``u``'s shape in ``dtype``.

    Raises:
        ValueError: ``ns`` is not one of :data:`NS_CHOICES`.
    """
    if ns == "gram" and u.shape[0] != u.shape[1]:
        return gram_newton_schulz(u, coeffs, steps, eps, dtype)
    if ns not in NS_CHOICES:
        raise ValueError(f"optimizer.muon_ns={ns!r} is not one of {NS_CHOICES}; set optimizer.muon_ns=quintic or gram")
    return newton_schulz5(u, coeffs, steps, eps, dtype)


def adjusted_lr(lr: float, fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate for a ``[A, B]`` weight (``original`` / ``match_rms_adamw``)."""
    rows, cols = shape[0], shape[1]
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr


class MuonNS(torch.optim.Muon):
    """``torch.optim.Muon`` (same constructor, defaults, state names: ``momentum_buffer`` only) with
    Newton-Schulz in ``ns_dtype``, computed by ``ns`` (``quintic`` or ``gram``, see :func:`orthogonalize`), and
    with updates that can be started early (:meth:`precompute`).

    ``ns="torch"`` uses torch.optim.Muon's own iteration (``torch.optim._muon._zeropower_via_newtonschulz``,
    BF16; the quintic in ``ns_dtype`` if a torch build lacks it): the optimizer an early-update run uses on CUDA
    where torch's ``Muon`` would run.

    Early updates. :meth:`precompute` orthogonalises the Nesterov update of some parameters as soon as their
    gradients are final (e.g. when their bucket's DP reduction has finished, while later buckets are still in
    flight), without touching any state; :meth:`step` then uses that result instead of computing it again, and
    applies momentum, weight decay and the update exactly as without it. A precomputed result is used only if
    neither the gradient nor the momentum buffer changed since (same storage, same version counter: gradient
    clipping's in-place scale, a new step's zeroing or a loaded checkpoint invalidate it), so the step's values are
    bitwise those of a step without early updates. ``precompute_hits`` / ``precompute_misses`` count the
    parameters whose update was / was not taken from a precomputed result (a miss: precomputed, then invalidated).

    Raises:
        ValueError: ``ns`` is not one of :data:`NS_CHOICES` or ``"torch"``.
    """

    def __init__(self, params, ns_dtype: torch.dtype = torch.float32, ns: str = "quintic", **kwargs):
        if ns not in NS_CHOICES and ns != "torch":
            raise ValueError(
                f"optimizer.muon_ns={ns!r} is not one of {NS_CHOICES}; set optimizer.muon_ns=quintic or gram"
            )
        super().__init__(params, **kwargs)
        self.ns_dtype = ns_dtype
        self.ns = ns
        self._early: dict[int, tuple[torch.Tensor, tuple]] = {}  # id(param) -> (orthogonalised update, guard)
        self.precompute_hits = 0
        self.precompute_misses = 0

    def _orthogonalize(self, upd: torch.Tensor, group: dict, p: torch.Tensor) -> torch.Tensor:
        """``NS5(upd)`` for parameter ``p`` (a subclass may orthogonalise across ranks, see ``SplitMuon``)."""
        if self.ns == "torch":
            fn = getattr(torch.optim._muon, "_zeropower_via_newtonschulz", None)  # type: ignore[attr-defined]
            if fn is not None:
                return fn(upd, group["ns_coefficients"], group["ns_steps"], group["eps"])
            return newton_schulz5(upd, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
        return orthogonalize(upd, self.ns, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)

    def _lr_shape(self, p: torch.Tensor) -> torch.Size:
        """The matrix shape ``adjusted_lr`` sees for ``p`` (its own; a row block's whole matrix in ``SplitMuon``)."""
        return p.shape

    def _guard(self, p: torch.Tensor, group: dict) -> tuple:
        """What a precomputed update of ``p`` depends on: the gradient's and momentum buffer's storage and version
        (in-place writes bump a tensor's version counter, shared by all views), and the group's settings."""
        g = p.grad
        assert g is not None
        buf = self.state[p].get("momentum_buffer") if p in self.state else None
        b = (-1, -1) if buf is None else (buf.data_ptr(), buf._version)
        settings = (group["momentum"], group["nesterov"], group["ns_coefficients"], group["ns_steps"], group["eps"])
        return (g.data_ptr(), g._version, *b, settings)

    @torch.no_grad()
    def precompute(self, params) -> int:
        """Orthogonalise the update of each of ``params`` (tensors of this optimizer's groups with a ``grad``;
        others are ignored) from its current gradient and momentum buffer, changing no state. Returns how many
        were precomputed. Same operations and dtypes as :meth:`step`, so a result used there is bitwise the one
        it would compute."""
        where = {id(p): g for g in self.param_groups for p in g["params"]}
        done = 0
        for p in params:
            group = where.get(id(p))
            if group is None or p.grad is None or p.grad.ndim != 2:
                continue
            m = group["momentum"]
            old = self.state[p].get("momentum_buffer") if p in self.state else None
            buf = (torch.zeros_like(p.grad) if old is None else old).lerp(p.grad, 1 - m)
            upd = p.grad.lerp(buf, m) if group["nesterov"] else buf
            self._early[id(p)] = (self._orthogonalize(upd, group, p), self._guard(p, group))
            done += 1
        return done

    def discard_precomputed(self) -> None:
        """Drop every precomputed update (e.g. when the gradient is about to be clipped)."""
        self.precompute_misses += len(self._early)
        self._early.clear()

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
                early = self._early.pop(id(p), None)
                ortho = early[0] if early is not None and early[1] == self._guard(p, group) else None
                if early is not None:
                    if ortho is None:
                        self.precompute_misses += 1
                    else:
                        self.precompute_hits += 1
                        if ortho.is_cuda:  # made on the early Newton-Schulz stream, read and freed on this one
                            ortho.record_stream(torch.cuda.current_stream(ortho.device))
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - m)
                if ortho is None:
                    upd = p.grad.lerp(buf, m) if group["nesterov"] else buf
                    ortho = self._orthogonalize(upd, group, p)
                p.mul_(1 - lr * wd)
                if self.ns == "torch" and hasattr(torch.optim._muon, "_adjust_lr"):  # type: ignore[attr-defined]
                    # torch.optim.Muon's own update, operation for operation
                    p.add_(ortho, alpha=-torch.optim._muon._adjust_lr(lr, group["adjust_lr_fn"], p.shape))  # type: ignore[attr-defined]
                else:
                    p.add_(ortho.to(p.dtype), alpha=-adjusted_lr(lr, group["adjust_lr_fn"], self._lr_shape(p)))
        self._early.clear()
        return loss


NS_DTYPES = ("auto", "bf16", "fp32")
"""The values of ``optimizer.muon_ns_dtype``."""


def newton_schulz_dtype(optimizer: OptimizerConfig, device: torch.device | str) -> torch.dtype:
    """``optimizer.muon_ns_dtype`` as the dtype of the Newton-Schulz iteration on ``device``: ``bf16`` ->
    ``torch.bfloat16``, ``fp32`` -> ``torch.float32``, ``auto`` -> BF16 on CUDA (torch.optim.Muon's) and FP32
    elsewhere (CPU BF16 matmuls are slow: see the module docstring). The one reader of the setting: validation, the
    distributed optimizer and the plan report call it.

    Args:
        optimizer: the ``optimizer`` section (:class:`~megatron_geo.config.schema.OptimizerConfig`).
        device: where the iteration runs (a ``torch.device`` or its name, e.g. ``"cuda"``, ``"cpu"``).

    Raises:
        ConfigError: ``optimizer.muon_ns_dtype`` is not one of :data:`NS_DTYPES`.
    """
    spec = optimizer.muon_ns_dtype
    if spec not in NS_DTYPES:
        raise ConfigError(f"optimizer.muon_ns_dtype={spec!r} is not supported; choose one of {', '.join(NS_DTYPES)}")
    if spec == "bf16" or (spec == "auto" and torch.device(device).type == "cuda"):
        return torch.bfloat16
    return torch.float32


def build_muon(
    params, ns_dtype: torch.dtype = torch.float32, ns: str = "quintic", early: bool = False, **kwargs
) -> torch.optim.Optimizer:
    """The Muon optimizer for the Newton-Schulz dtype ``ns_dtype`` (:func:`newton_schulz_dtype`: ``torch.bfloat16``
    or ``torch.float32``) and ``optimizer.muon_ns`` ``ns``.

    ``ns=quintic``: torch's ``Muon`` in BF16 (CUDA, or ``muon_ns_dtype=bf16``), :class:`MuonNS` with FP32
    Newton-Schulz otherwise. ``ns=gram``: :class:`MuonNS` with Gram Newton-Schulz in ``ns_dtype``. ``early=True``
    (updates started per bucket, ``optimizer.muon_overlap``): where torch's ``Muon`` would be returned,
    :class:`MuonNS` with ``ns="torch"`` instead (torch's iteration and update, plus :meth:`MuonNS.precompute`).
    ``kwargs`` go to torch.optim.Muon's constructor.

    Raises:
        ValueError: ``ns`` is not a known choice, or ``ns_dtype`` is neither BF16 nor FP32.
    """
    if ns_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"ns_dtype={ns_dtype} is neither torch.bfloat16 nor torch.float32 (newton_schulz_dtype)")
    bf16 = ns_dtype == torch.bfloat16
    if ns == "gram":
        return MuonNS(params, ns_dtype=ns_dtype, ns="gram", **kwargs)
    if ns != "quintic":
        raise ValueError(f"optimizer.muon_ns={ns!r} is not one of {NS_CHOICES}; set optimizer.muon_ns=quintic or gram")
    if bf16:
        return (
            MuonNS(params, ns_dtype=torch.bfloat16, ns="torch", **kwargs)
            if early
            else torch.optim.Muon(params, **kwargs)
        )
    return MuonNS(params, ns_dtype=torch.float32, **kwargs)
