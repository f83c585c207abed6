"""Where each parameter lives in a bucket's flat buffer and which DP rank owns which part.

A bucket's buffer holds its parameters back to back; DP rank r owns the contiguous range
``[bounds[r], bounds[r + 1])`` of it (what the reduction leaves on rank r and what the parameter gather
sends from it). Every parameter occupies one contiguous range of the buffer, so its gradient is a plain view.

Two kinds of parameter:
- *atomic* parameters must be owned whole by one rank (Muon orthogonalises whole matrices; GeoFP8's
  inverse transform needs whole rows).
- *splittable* parameters (element-wise optimizers such as AdamW) may be cut at any element, as in
  Megatron's distributed optimizer, or only at multiples of a *granule* (GeoFP8 layers under AdamW: whole
  rows, since ``G T`` mixes columns only and each row is inverted on its own).

Two plans, chosen per model by :func:`plan_model`:

*Even* (no atomic parameter, or DP = 1): each bucket is ``dp_size`` equal chunks (``bounds[r] = r * chunk``)
padded only to ``align`` -- the classic reduce-scatter / all-gather layout (:func:`plan_shards`).

*Whole-parameter* (some atomic parameters, DP > 1): padding every chunk up to the largest matrix would make
the buffers ``dp_size x largest / mean`` times too big (7.9x for Llama-600M at DP = 64). Instead atomic and
splittable parameters go to separate buckets and owners get *uneven* ranges:

1. atomic parameters are assigned to ranks over the whole model, largest optimizer cost first (Muon's
   Newton-Schulz costs ~ ``m n min(m, n)`` FLOPs per step, an element-wise update ~ its element count),
   each to the rank where the larger of its normalised FLOP and byte load stays smallest;
2. splittable elements fill each rank up to a common water level, so every rank owns about
   ``total / dp_size`` elements (their owners are consecutive ranks along the splittable buckets);
3. in an atomic bucket the parameters are laid out in owner order, so each rank's range is contiguous;
   every range is padded to a multiple of ``align`` (quantisation and rotation blocks never straddle ranks).

Cost: the reduction of an uneven bucket is one reduce per owner range (FP32) or an all-to-all with split
sizes (low-precision codecs, FP32 sum on the owner); the parameter gather is one broadcast per owner range
(NCCL coalesces them). A rank sends ``S - own`` elements of a bucket of S in either direction, the same as
a ring reduce-scatter / all-gather of an unpadded buffer, and the per-step totals stay balanced because
every rank owns about the same number of elements. Padding is at most ``dp_size x (align - 1)`` elements per
bucket. The price is more (smaller) collectives per bucket, i.e. latency, not bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..optim.muon import gram_restarts


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


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _try_pack(numels: list[int], atomic: list[bool], dp: int, chunk: int, align: int = 1) -> ShardPlan | None:
    atoms = sorted((i for i, a in enumerate(atomic) if a), key=lambda i: (-numels[i], i))
    splits = [i for i, a in enumerate(atomic) if not a]
    offsets = [0] * len(numels)
    pieces: list[list[Piece]] = [[] for _ in range(dp)]
    carry_idx, carry_done = None, 0  # splittable param in progress and how much of it is placed
    si = 0
    for r in range(dp):
        pos, end = r * chunk, (r + 1) * chunk
        if carry_idx is not None:
            n = min(numels[carry_idx] - carry_done, end - pos)
            pieces[r].append(Piece(carry_idx, carry_done, carry_done + n, pos))
            pos += n
            carry_done += n
            if carry_done == numels[carry_idx]:
                carry_idx = None
        if carry_idx is None:
            remaining = []
            for i in atoms:
                start = _ceil_to(pos, align)  # every parameter starts aligned: no codec block spans two
                if numels[i] <= end - start:
                    offsets[i] = start
                    pieces[r].append(Piece(i, 0, numels[i], start))
                    pos = start + numels[i]
                else:
                    remaining.append(i)
            atoms = remaining
            while si < len(splits) and _ceil_to(pos, align) < end:
                pos = _ceil_to(pos, align)
                i = splits[si]
                si += 1
                offsets[i] = pos
                n = min(numels[i], end - pos)
                if n:
                    pieces[r].append(Piece(i, 0, n, pos))
                pos += n
                if n < numels[i]:
                    carry_idx, carry_done = i, n
            # zero-size splittables at the very end still need an offset
    while si < len(splits) and numels[splits[si]] == 0:
        offsets[splits[si]] = dp * chunk
        si += 1
    if atoms or carry_idx is not None or si < len(splits):
        return None
    return ShardPlan([r * chunk for r in range(dp + 1)], offsets, pieces)


def plan_shards(numels: list[int], atomic: list[bool], dp_size: int, align: int = 1) -> ShardPlan:
    """Pack parameters of one bucket into ``dp_size`` equal chunks (the even plan).

    With atomic parameters every chunk is at least the largest of them, so use :func:`plan_model` for
    models with atomic parameters at DP > 1.

    Args:
        numels: element count of each parameter (in bucket order).
        atomic: True where the parameter must be owned whole by one rank.
        dp_size: number of data-parallel ranks (>= 1).
        align: chunk size is a multiple of this, and so is every parameter's offset (e.g. a quantisation block
            size: blocks never straddle two ranks' shards nor two parameters).

    Returns:
        A :class:`ShardPlan`; every element of every parameter is owned by exactly one rank.
    """
    if dp_size < 1 or align < 1:
        raise ValueError(f"dp_size={dp_size} and align={align} must be >= 1")
    total = sum(numels)
    biggest = max((n for n, a in zip(numels, atomic) if a), default=0)
    chunk = _ceil_to(max(math.ceil(total / dp_size), biggest, 1), align)
    while True:
        plan = _try_pack(numels, atomic, dp_size, chunk, align)
        if plan is not None:
            return plan
        chunk = _ceil_to(chunk + max(1, chunk // 32), align)


# -- whole-model planning ---------------------------------------------------------------------------------------------

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
    if ns not in ("quintic", "gram"):
        raise ValueError(f"ns={ns!r} is not one of ('quintic', 'gram')")
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
    ``rows`` and ``cols``, its Newton-Schulz form ``ns`` (for the members' FLOPs) and the split rule
    ``split`` (``optimizer.muon_split``: ``off``, ``auto`` or a group size such as ``"2"``)."""

    numel: int
    atomic: bool
    flops: float
    granule: int = 1  # splittable only at multiples of this many elements from the start (e.g. a row)
    rows: int = 0
    cols: int = 0
    ns: str = "quintic"
    split: str = "off"


def group_in_buckets(indices: list[int], numels: list[int], bucket_size: int) -> list[list[int]]:
    """Consecutive groups of ``indices`` with at least ``bucket_size`` elements each (the last may be smaller)."""
    groups: list[list[int]] = [[]]
    count = 0
    for i in indices:
        groups[-1].append(i)
        count += numels[i]
        if count >= bucket_size:
            groups.append([])
            count = 0
    return [g for g in groups if g]


def assign_owners(specs: list[ParamSpec], dp_size: int) -> list[int]:
    """Owner rank of every atomic parameter (-1 for splittable ones), balancing FLOPs and bytes.

    Largest FLOPs first, each parameter goes to the rank where ``max(flops / mean_flops, elements /
    mean_elements)`` after adding it is smallest (ties: fewer FLOPs, fewer elements, lower rank); the means
    are over the whole model, splittable parameters included (they fill the byte gaps later).
    """
    total_el = max(sum(s.numel for s in specs), 1)
    total_fl = max(sum(s.flops for s in specs), 1.0)
    mean_el, mean_fl = total_el / dp_size, total_fl / dp_size
    F, B = [0.0] * dp_size, [0] * dp_size
    owner = [-1] * len(specs)
    for i in sorted((i for i, s in enumerate(specs) if s.atomic), key=lambda i: (-specs[i].flops, -specs[i].numel, i)):
        s = specs[i]
        r = min(
            range(dp_size),
            key=lambda r: (
                max((F[r] + s.flops) / mean_fl, (B[r] + s.numel) / mean_el),
                F[r] + s.flops,
                B[r] + s.numel,
                r,
            ),
        )
        owner[i] = r
        F[r] += s.flops
        B[r] += s.numel
    return owner


def splittable_quotas(atomic_elements: list[int], splittable_total: int) -> list[int]:
    """Elements of splittable parameters per rank: water-filling up to a common level ``L`` so that
    ``max_r(atomic_r + quota_r)`` is as small as it can be; the quotas sum to ``splittable_total``."""
    if splittable_total <= 0:
        return [0] * len(atomic_elements)
    lo, hi = 0, max(atomic_elements) + splittable_total
    while lo < hi:  # smallest integer level that holds everything
        mid = (lo + hi) // 2
        if sum(max(0, mid - b) for b in atomic_elements) >= splittable_total:
            hi = mid
        else:
            lo = mid + 1
    q = [max(0, lo - b) for b in atomic_elements]
    excess = sum(q) - splittable_total
    for r in range(len(q)):
        if excess == 0:
            break
        if q[r] > 0:
            q[r] -= 1
            excess -= 1
    return q


def _atomic_bucket(idx: list[int], specs: list[ParamSpec], owner: list[int], dp: int, align: int) -> ShardPlan:
    offsets = [0] * len(idx)
    pieces: list[list[Piece]] = [[] for _ in range(dp)]
    bounds, pos = [0], 0
    for r in range(dp):
        start = pos
        for j, i in enumerate(idx):
            if owner[i] == r:
                pos = _ceil_to(pos, align)  # every parameter starts aligned: no codec block spans two
                offsets[j] = pos
                pieces[r].append(Piece(j, 0, specs[i].numel, pos))
                pos += specs[i].numel
        if pos > start:
            pos = _ceil_to(pos, align)
        bounds.append(pos)
    return ShardPlan(bounds, offsets, pieces)


def _splittable_bucket(
    idx: list[int], specs: list[ParamSpec], stream_start: int, cuts: list[int], align: int
) -> ShardPlan:
    # granular parameters start and end aligned (padding around them), so a cut between two of their
    # granules is also a cut at the alignment, and rounding a cut elsewhere down to the alignment never
    # lands inside them
    offsets, pos = [], 0
    for i in idx:  # with align > 1 every parameter starts aligned (no codec block spans two parameters)
        g = specs[i].granule > 1 or align > 1
        pos = _ceil_to(pos, align) if g else pos
        offsets.append(pos)
        pos = _ceil_to(pos + specs[i].numel, align) if g else pos + specs[i].numel
    padded = _ceil_to(pos, align)
    dp = len(cuts) - 1
    starts, seen = [], 0  # where each parameter starts in the splittable stream (no padding there)
    for i in idx:
        starts.append(seen)
        seen += specs[i].numel

    def to_buffer(c: int) -> int:
        c = c - stream_start
        if c <= 0:
            return 0
        for j, i in enumerate(idx):
            n = specs[i].numel
            if c < starts[j] + n or j == len(idx) - 1:
                within = min(c - starts[j], n)
                g = specs[i].granule
                if g > 1 and 0 < within < n:
                    unit = g * align // math.gcd(g, align)
                    within = within // unit * unit
                b = offsets[j] + within
                if g <= 1:
                    return b // align * align
                return _ceil_to(b, align) if within == n else b  # the end: into the padding after it
        return padded

    bounds = [0] + [min(to_buffer(cuts[r]), padded) for r in range(1, dp)] + [padded]
    for r in range(1, dp + 1):  # monotone after rounding
        bounds[r] = max(bounds[r], bounds[r - 1])
    pieces: list[list[Piece]] = [[] for _ in range(dp)]
    for r in range(dp):
        lo_r, hi_r = bounds[r], bounds[r + 1]
        for j, i in enumerate(idx):
            lo, hi = max(offsets[j], lo_r), min(offsets[j] + specs[i].numel, hi_r)
            if lo < hi:
                pieces[r].append(Piece(j, lo - offsets[j], hi - offsets[j], lo))
    return ShardPlan(bounds, offsets, pieces)


def plan_model(
    specs: list[ParamSpec], bucket_size: int, dp_size: int, align: int = 1
) -> list[tuple[list[int], ShardPlan]]:
    """Group the model's parameters into buckets and lay each bucket out over the DP ranks.

    Args:
        specs: every parameter that needs a gradient, in the order backward produces them (reverse
            registration order).
        bucket_size: minimum elements per bucket (the last bucket of each kind may be smaller).
        dp_size: data-parallel size (>= 1).
        align: every rank's range is a multiple of this many elements.

    Returns:
        ``[(indices into specs, plan), ...]`` in launch order (by each bucket's last parameter in backward
        order, i.e. when it is ready); plan offsets and pieces index into that bucket's ``indices``. Even plans when no
        parameter is
        atomic or ``dp_size == 1`` (see the module docstring), whole-parameter plans otherwise.

    Raises:
        ValueError: ``dp_size`` or ``align`` below 1, or ``bucket_size`` below 1.
    """
    if dp_size < 1 or align < 1 or bucket_size < 1:
        raise ValueError(f"dp_size={dp_size}, align={align} and bucket_size={bucket_size} must be >= 1")
    numels = [s.numel for s in specs]
    order = list(range(len(specs)))
    if dp_size == 1 or not any(s.atomic or s.granule > 1 for s in specs):
        return [
            (g, plan_shards([numels[i] for i in g], [False] * len(g), dp_size, align))
            for g in group_in_buckets(order, numels, bucket_size)
        ]
    a_groups = group_in_buckets([i for i in order if specs[i].atomic], numels, bucket_size)
    from .split_plan import plan_owners, split_bucket

    owner, splits = plan_owners(specs, dp_size, align, {i: b for b, grp in enumerate(a_groups) for i in grp})
    atomic_el = [0] * dp_size
    for i, r in enumerate(owner):
        if i in splits:
            for k, rank in enumerate(range(splits[i].first, splits[i].first + splits[i].size)):
                atomic_el[rank] += (splits[i].row_cuts[k + 1] - splits[i].row_cuts[k]) * splits[i].cols
        elif r >= 0:
            atomic_el[r] += specs[i].numel
    s_groups = group_in_buckets([i for i in order if not specs[i].atomic], numels, bucket_size)
    # launch order = when a bucket's last gradient arrives in backward (the norms + embedding bucket goes last)
    groups = sorted([(g, True) for g in a_groups] + [(g, False) for g in s_groups], key=lambda t: max(t[0]))
    quotas = splittable_quotas(atomic_el, sum(numels[i] for g in s_groups for i in g))
    cuts = [0]
    for q in quotas:
        cuts.append(cuts[-1] + q)
    out, stream = [], 0
    for grp, is_atomic in groups:
        if is_atomic and any(i in splits for i in grp):
            out.append((grp, split_bucket(grp, specs, owner, splits, dp_size, align)))
        elif is_atomic:
            out.append((grp, _atomic_bucket(grp, specs, owner, dp_size, align)))
        else:
            out.append((grp, _splittable_bucket(grp, specs, stream, cuts, align)))
            stream += sum(numels[i] for i in grp)
    return out
