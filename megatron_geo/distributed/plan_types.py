"""The shard planner's types and the per-parameter cost they carry, shared by :mod:`.split_plan` (owners of atomic
parameters, row splits of Muon matrices) and :mod:`.shard_plan` (bucket layouts). Imports run one way:
``plan_types`` <- ``split_plan`` <- ``shard_plan`` (the import-linter contract of pyproject.toml keeps it so).

- :class:`ParamSpec`: what the planner knows of one parameter (elements, atomic or cut at a granule, optimizer
  FLOPs per step of owning it: :func:`newton_schulz_flops` for Muon matrices, :data:`ADAMW_FLOPS_PER_ELEMENT` per
  element otherwise);
- :class:`ShardPlan`: one bucket's layout over the DP ranks, made of :class:`Piece` ranges and :class:`Split` row
  groups;
- :func:`ceil_to`: the alignment rounding every layout uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..optim.muon import NS_CHOICES, gram_restarts


@dataclass
class Piece:
    """Part ``[param_start, param_end)`` of parameter ``index`` (flattened), at ``buffer_start`` in the bucket."""

    index: int
    param_start: int
    param_end: int
    buffer_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class Split:
    """A Muon matrix ``[rows, cols]`` of a bucket owned by rows by the consecutive DP ranks ``first, first + 1,
    ...`` (its *group*, ``size`` members): member k owns rows ``[row_cuts[k], row_cuts[k + 1])``, one contiguous
    range of the flat parameter and of the bucket (see :mod:`.split_plan`)."""

    first: int
    row_cuts: tuple[int, ...]
    cols: int

    @property
    def size(self) -> int:
        return len(self.row_cuts) - 1

    @property
    def rows(self) -> int:
        return self.row_cuts[-1]

    def member(self, rank: int) -> int:
        """The member index of DP rank ``rank`` (``0 .. size - 1``).

        Raises:
            ValueError: ``rank`` is not in the group.
        """
        if not self.first <= rank < self.first + self.size:
            raise ValueError(f"DP rank {rank} is not in the group of ranks {self.first}..{self.first + self.size - 1}")
        return rank - self.first


@dataclass
class ShardPlan:
    """Layout of one bucket: ``offsets[i]`` is where parameter i starts; ``pieces[r]`` what rank r owns;
    rank r owns buffer elements ``[bounds[r], bounds[r + 1])`` (``len(bounds) == dp_size + 1``);
    ``splits[i]``: how parameter i (a Muon matrix) is split by rows over a group of ranks (empty: every atomic
    parameter is owned whole)."""

    bounds: list[int]
    offsets: list[int]
    pieces: list[list[Piece]] = field(default_factory=list)
    splits: dict[int, Split] = field(default_factory=dict)

    @property
    def dp_size(self) -> int:
        return len(self.bounds) - 1

    @property
    def buffer_numel(self) -> int:
        return self.bounds[-1]

    @property
    def even(self) -> bool:
        """True when every rank's range has the same length (the classic reduce-scatter layout)."""
        sizes = self.sizes
        return all(n == sizes[0] for n in sizes)

    @property
    def sizes(self) -> list[int]:
        return [self.bounds[r + 1] - self.bounds[r] for r in range(self.dp_size)]

    @property
    def chunk(self) -> int:
        """The per-rank range length of an even plan.

        Raises:
            ValueError: the plan is uneven (whole-parameter ownership); use ``bounds``.
        """
        if not self.even:
            raise ValueError("this bucket's ranges are uneven (whole-parameter ownership); use plan.bounds")
        return self.bounds[1] - self.bounds[0]

    def padding(self, numels: list[int]) -> int:
        """Elements of the buffer that hold no parameter."""
        return self.buffer_numel - sum(numels)


def ceil_to(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (both >= 0, ``m`` >= 1)."""
    return (x + m - 1) // m * m


ADAMW_FLOPS_PER_ELEMENT = 12.0
"""Approximate FLOPs of one AdamW update per element (moments, bias correction, sqrt, divide, decay)."""


def _gram_cube_products(steps: int) -> int:
    """``[m, m] x [m, m]`` products of :func:`~megatron_geo.optim.muon.gram_newton_schulz` for ``steps`` steps
    (counted along its loop: ``Z``, ``P Q`` unless ``Q`` is the identity, and ``S``, ``P R P`` unless the next
    step restarts or there is none)."""
    restart_at, count, identity = set(gram_restarts(steps)), 0, True
    for t in range(steps):
        if t > 0 and t in restart_at:
            identity = True
        count += 1 if identity else 2
        identity = False
        if t + 1 < steps and (t + 1) not in restart_at:
            count += 2
    return count


def newton_schulz_flops(shape: tuple[int, ...], steps: int = 5, ns: str = "quintic", share: float = 1.0) -> float:
    """FLOPs of Muon's Newton-Schulz orthogonalisation of an ``m x n`` matrix, or of one member's part of it.

    With ``k = min(m, n)``, ``K = max(m, n)`` (the wide orientation ``X`` ``[k, K]``):

    - ``ns=quintic`` (or a square matrix): one iteration forms ``A = X X^T`` (``2 k^2 K``), ``B = b A + c A^2``
      (``2 k^3``) and ``B X`` (``2 k^2 K``): ``steps (4 k^2 K + 2 k^3)``, i.e. ~ ``m n min(m, n)`` (Jordan et al.
      2024);
    - ``ns=gram`` (rectangular): :func:`~megatron_geo.optim.muon.gram_newton_schulz` touches ``X`` in
      ``2 + 2 restarts`` ``[k, k] x [k, K]``-sized products and does the rest on ``[k, k]`` matrices: for 5 steps
      with one restart ``2 (4 k^2 K + 14 k^3)`` FLOPs (Zhang, Amsel, Chen, Dao 2026).

    ``share``: the fraction of the columns of ``X`` one member of a split group holds (:mod:`.split_plan`): the
    ``k^2 K`` terms scale with it, the ``[k, k]`` polynomial is computed by every member alike (``share=0``: that
    replicated part alone).

    Raises:
        ValueError: ``ns`` is not ``quintic`` or ``gram``, or ``share`` outside ``[0, 1]``.
    """
    if ns not in NS_CHOICES:
        raise ValueError(f"ns={ns!r} is not one of {NS_CHOICES}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share={share} must be in [0, 1]")
    m, n = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
    k, big = min(m, n), max(m, n)
    if ns == "gram" and m != n:
        wide_products = 2 + 2 * len(gram_restarts(steps))
        return 2.0 * (wide_products * k * k * big * share + _gram_cube_products(steps) * k**3)
    return float(steps) * (4.0 * k * k * big * share + 2.0 * k**3)


@dataclass
class ParamSpec:
    """What the planner needs of one parameter: elements, whether one rank must own it whole, the optimizer
    FLOPs per step of owning it (``newton_schulz_flops`` for Muon, ~12 per element for AdamW), and the
    granule a splittable parameter may be cut at.

    A Muon matrix that may instead be split by rows over a group of DP ranks (:mod:`.split_plan`) also gives its
    ``rows`` and ``cols``, its Newton-Schulz form ``ns`` (for the members' FLOPs), the split rule ``split``
    (``optimizer.muon_split``: ``off``, ``auto`` or a group size such as ``"2"``) and ``ns_bytes``, the bytes per
    element of the iteration on a GPU (``optimizer.muon_ns_dtype``: 2 for BF16, 4 for FP32), which sets the
    bytes of a split's Gram all-reduces."""

    numel: int
    atomic: bool
    flops: float
    granule: int = 1  # splittable only at multiples of this many elements from the start (e.g. a row)
    rows: int = 0
    cols: int = 0
    ns: str = "quintic"
    split: str = "off"
    ns_bytes: int = 2  # bytes per element of the Newton-Schulz iteration on a GPU (BF16 unless muon_ns_dtype=fp32)
