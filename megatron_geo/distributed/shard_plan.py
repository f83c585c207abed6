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

The types and the per-parameter cost model are in :mod:`.plan_types`; the owners of atomic parameters (whole or
split by rows) come from :mod:`.split_plan`.
"""

from __future__ import annotations

import math

from .plan_types import (
    ADAMW_FLOPS_PER_ELEMENT,
    ParamSpec,
    Piece,
    ShardPlan,
    Split,
    ceil_to,
    newton_schulz_flops,
)
from .split_plan import (
    SPLIT_COST,
    AutoSplit,
    SplitCost,
    assign_owners,
    auto_split,
    parse_muon_split,
    plan_owners,
    split_bucket,
)

__all__ = [  # with the planner's types and cost model (defined in plan_types) and assign_owners (split_plan)
    "ADAMW_FLOPS_PER_ELEMENT",
    "ParamSpec",
    "Piece",
    "ShardPlan",
    "Split",
    "assign_owners",
    "group_in_buckets",
    "newton_schulz_flops",
    "plan_model",
    "plan_shards",
    "splittable_quotas",
]


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
                start = ceil_to(pos, align)  # every parameter starts aligned: no codec block spans two
                if numels[i] <= end - start:
                    offsets[i] = start
                    pieces[r].append(Piece(i, 0, numels[i], start))
                    pos = start + numels[i]
                else:
                    remaining.append(i)
            atoms = remaining
            while si < len(splits) and ceil_to(pos, align) < end:
                pos = ceil_to(pos, align)
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
    chunk = ceil_to(max(math.ceil(total / dp_size), biggest, 1), align)
    while True:
        plan = _try_pack(numels, atomic, dp_size, chunk, align)
        if plan is not None:
            return plan
        chunk = ceil_to(chunk + max(1, chunk // 32), align)


# -- whole-model planning ---------------------------------------------------------------------------------------------


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
                pos = ceil_to(pos, align)  # every parameter starts aligned: no codec block spans two
                offsets[j] = pos
                pieces[r].append(Piece(j, 0, specs[i].numel, pos))
                pos += specs[i].numel
        if pos > start:
            pos = ceil_to(pos, align)
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
        pos = ceil_to(pos, align) if g else pos
        offsets.append(pos)
        pos = ceil_to(pos + specs[i].numel, align) if g else pos + specs[i].numel
    padded = ceil_to(pos, align)
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
                return ceil_to(b, align) if within == n else b  # the end: into the padding after it
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


def _bucket_of(a_groups: list[list[int]]) -> dict[int, int]:
    return {i: b for b, grp in enumerate(a_groups) for i in grp}


def muon_split_decision(
    specs: list[ParamSpec], bucket_size: int, dp_size: int, align: int = 1, cost: SplitCost = SPLIT_COST
) -> AutoSplit | None:
    """What ``optimizer.muon_split=auto`` weighs for :func:`plan_model` of the same arguments (the same buckets
    and candidates): :func:`.split_plan.auto_split`'s decision, or None where nothing is weighed (no atomic
    parameter, ``dp_size < 2``, no Muon matrix above the mean share, or ``optimizer.muon_split`` is not
    ``auto``).

    Raises:
        ConfigError: a spec's ``split`` is not a valid ``optimizer.muon_split``.
    """
    atomic = [i for i in range(len(specs)) if specs[i].atomic]
    cand = [i for i in atomic if specs[i].rows > 0 and specs[i].cols > 0]
    if dp_size < 2 or not cand or parse_muon_split(specs[cand[0]].split) != 0:
        return None
    a_groups = group_in_buckets(atomic, [s.numel for s in specs], bucket_size)
    return auto_split(specs, dp_size, align, _bucket_of(a_groups), cost)[0]


def plan_model(
    specs: list[ParamSpec], bucket_size: int, dp_size: int, align: int = 1, cost: SplitCost = SPLIT_COST
) -> list[tuple[list[int], ShardPlan]]:
    """Group the model's parameters into buckets and lay each bucket out over the DP ranks.

    Args:
        specs: every parameter that needs a gradient, in the order backward produces them (reverse
            registration order).
        bucket_size: minimum elements per bucket (the last bucket of each kind may be smaller).
        dp_size: data-parallel size (>= 1).
        align: every rank's range is a multiple of this many elements.
        cost: the machine ``optimizer.muon_split=auto`` assumes (:class:`~.split_plan.SplitCost`).

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
    owner, splits = plan_owners(specs, dp_size, align, _bucket_of(a_groups), cost)
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
