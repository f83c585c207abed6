"""Synthetic gradient scenarios for the fidelity tool (``tools/grad_fidelity.py --scenario NAME``).

Each scenario builds, for R simulated DP ranks and one linear layer, the input activations ``X_r``
(``[T, d_in]``, T tokens per rank) and output gradients ``dY_r`` (``[T, d_out]``), and from them exactly
what the trainer sees:

    G_r = dY_r^T X_r / T                       (float32 [d_out, d_in], rank r's weight gradient)
    A   = sum_r X_r^T X_r / (R T)              (float32 [d_in, d_in], the DP-averaged K-FAC input factor)
    S   = sum_r dY_r^T dY_r / (R T)            (float32 [d_out, d_out], the K-FAC output factor E[g g^T])

Notation: ``Z`` i.i.d. N(0, 1) entries; ``t3`` i.i.d. Student-t with 3 degrees of freedom divided by
sqrt(3) (unit variance, heavy tails); ``C`` = k distinct input channels drawn at random; ``V`` = k dense
orthonormal directions (``[d_in, k]``, QR of a Gaussian matrix); ``spike`` = the spike size (standard
deviation or value of the outlier part, in units of the base activations' standard deviation).

- ``iid``: ``X = Z``, ``dY = t3``. ``E[A] = I``; no direction is special.
- ``channel-spikes`` (massive activations, each in one channel): ``X = Z``, then ``X[:, c] *= spike`` for
  c in C; ``dY = t3``. ``E[A] = I + (spike^2 - 1) sum_c e_c e_c^T``: the outliers lie along coordinate axes
  (IPR of the top eigenvectors = 1).
- ``token-spikes`` (sink-token-like): ``X = Z``, then on ``n_s = max(1, round(spike_tokens T))`` tokens per
  rank (drawn at random) ``X[t, c] += spike`` for every c in C (the same value in all k channels); ``dY = t3``.
  ``E[A] = I + f spike^2 1_C 1_C^T`` with ``f = n_s / T``: one outlier direction ``1_C / sqrt(k)`` spread
  over k channels (IPR 1/k), eigenvalue ``1 + f k spike^2``.
- ``dense-spikes``: ``X = Z + spike W V^T`` with ``W`` ``[T, k]`` i.i.d. N(0, 1); ``dY = t3``.
  ``E[A] = I + spike^2 V V^T``: k outlier directions spread over all channels (IPR ~ 3 / d_in), eigenvalue
  ``1 + spike^2``. The gradients are noise across ranks (energy along ``u_i`` grows like ``lambda_i``).
- ``coherent``: ``X`` as in dense-spikes; ``dY = X B^T + noise t3`` with one ``B`` (``[d_out, d_in]``,
  ``Z / sqrt(d_in)``) shared by all ranks, so ``G_r = B A_r + noise t3^T X_r / T`` and every rank's gradient
  is close to the mean ``B A`` (energy along ``u_i`` grows like ``lambda_i^2``).

``V``, ``C`` and ``B`` depend on the seed only (the same on every rank and step, as a layer's structure is);
``Z``, ``W``, ``t3`` and the spiking tokens are drawn per rank and step from ``crc32("seed/step/rank")``
(``step`` > 0: the next training steps of the same layer, for the windowed metric). Everything is
computed in FP64 and stored as float32. The ``model`` scenario (real gradients of the tiny model) lives in
:mod:`.model_capture`.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import asdict, dataclass

import torch

from .capture import Capture

SCENARIOS = ("iid", "channel-spikes", "token-spikes", "dense-spikes", "coherent")
LAYER = "layer.weight"  # the one layer's name in a scenario's capture


@dataclass
class ScenarioParams:
    """A scenario's parameters (module docstring), all JSON-ready.

    Attributes:
        name: one of :data:`SCENARIOS`.
        d_in, d_out: the layer's input / output size; tokens: T per rank; ranks: R.
        spike: outlier size (see the module docstring for each scenario's use). Default 1000: massive
            activations in LLMs are about 10^3-10^4 times the median activation (Sun et al. 2024, "Massive
            activations in large language models"); every gain grows with it (docs/geofp8_fidelity.md sweeps it).
        k: outlier channels (channel-/token-spikes) or directions (dense-spikes, coherent).
        spike_tokens: fraction of a rank's tokens that spike (token-spikes).
        noise: output-gradient noise relative to the coherent part (coherent).
        seed: the draw; step: the step within a window (new tokens, same structure).
    """

    name: str = "dense-spikes"
    d_in: int = 256
    d_out: int = 256
    tokens: int = 512
    ranks: int = 8
    spike: float = 1000.0
    k: int = 4
    spike_tokens: float = 1 / 64
    noise: float = 1.0
    seed: int = 0
    step: int = 0

    def check(self) -> None:
        """Raise ValueError naming the bad parameter."""
        if self.name not in SCENARIOS:
            raise ValueError(f"scenario {self.name!r} is not known; choose one of {', '.join(SCENARIOS)} or model")
        for key in ("d_in", "d_out", "tokens", "ranks", "k"):
            if getattr(self, key) < 1:
                raise ValueError(f"scenario parameter {key}={getattr(self, key)} must be >= 1")
        if self.k > self.d_in:
            raise ValueError(f"scenario parameter k={self.k} must be <= d_in={self.d_in}")
        if not (math.isfinite(self.spike) and self.spike >= 0):
            raise ValueError(f"scenario parameter spike={self.spike} must be a finite number >= 0")
        if not 0 < self.spike_tokens <= 1:
            raise ValueError(f"scenario parameter spike_tokens={self.spike_tokens} must be in (0, 1]")
        if not self.noise >= 0:
            raise ValueError(f"scenario parameter noise={self.noise} must be >= 0")


def _t3(shape, gen) -> torch.Tensor:
    """Student-t (3 degrees of freedom) / sqrt(3): unit variance, FP64."""
    z = torch.randn(shape, generator=gen, dtype=torch.float64)
    chi2 = torch.randn((3, *shape), generator=gen, dtype=torch.float64).pow(2).sum(0)
    return z / (chi2 / 3.0).sqrt() / math.sqrt(3.0)


def structure(p: ScenarioParams) -> dict:
    """The seed-only parts shared by all ranks: ``channels`` (int64 ``[k]``), ``V`` (FP64 ``[d_in, k]``
    orthonormal), ``B`` (FP64 ``[d_out, d_in]``)."""
    gen = torch.Generator().manual_seed(p.seed * 1000)
    channels = torch.randperm(p.d_in, generator=gen)[: p.k]
    V, _ = torch.linalg.qr(torch.randn(p.d_in, p.k, generator=gen, dtype=torch.float64))
    B = torch.randn(p.d_out, p.d_in, generator=gen, dtype=torch.float64) / math.sqrt(p.d_in)
    return {"channels": channels, "V": V, "B": B}


def rank_tensors(p: ScenarioParams, rank: int, st: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X_r, dY_r)`` of one rank (FP64 ``[T, d_in]``, ``[T, d_out]``) by the module docstring's formulas."""
    st = st or structure(p)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{p.seed}/{p.step}/{rank}".encode()))
    T = p.tokens
    X = torch.randn(T, p.d_in, generator=gen, dtype=torch.float64)
    if p.name == "channel-spikes":
        X[:, st["channels"]] *= p.spike
    elif p.name == "token-spikes":
        n_s = max(1, round(p.spike_tokens * T))
        rows = torch.randperm(T, generator=gen)[:n_s]
        X[rows.view(-1, 1), st["channels"].view(1, -1)] += p.spike
    elif p.name in ("dense-spikes", "coherent"):
        X += p.spike * torch.randn(T, p.k, generator=gen, dtype=torch.float64) @ st["V"].T
    dY = _t3((T, p.d_out), gen)
    if p.name == "coherent":
        dY = X @ st["B"].T + p.noise * dY
    return X, dY


def generate(p: ScenarioParams) -> Capture:
    """One capture of scenario ``p``: ``grads[LAYER]`` = the R gradients ``G_r``, ``A[LAYER]`` = the input factor,
    ``S_hooks[LAYER]`` = the output factor (the tool's ``--output-factor hooks``, its default for scenarios).

    Raises:
        ValueError: a bad parameter (:meth:`ScenarioParams.check`).
    """
    p.check()
    t0 = time.perf_counter()
    st = structure(p)
    grads, A = [], torch.zeros(p.d_in, p.d_in, dtype=torch.float64)
    S = torch.zeros(p.d_out, p.d_out, dtype=torch.float64)
    for r in range(p.ranks):
        X, dY = rank_tensors(p, r, st)
        grads.append((dY.T @ X / p.tokens).float())
        A += X.T @ X
        S += dY.T @ dY
    A /= p.ranks * p.tokens
    S /= p.ranks * p.tokens
    return Capture(
        0,
        [LAYER],
        {LAYER: grads},
        None,
        {LAYER: A.float()},
        {LAYER: S.float()},
        time.perf_counter() - t0,
        params=asdict(p),
    )
