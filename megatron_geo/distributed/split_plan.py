"""Muon matrices split by rows over a small group of DP ranks, where whole-matrix ownership cannot balance.

Owning a Muon matrix whole costs its owner the whole Newton-Schulz (``~ 4 k^2 K + 2 k^3`` FLOPs per quintic
step for ``k = min``, ``K = max`` of its shape). When that exceeds the mean per-rank share of the model's
optimizer FLOPs (Llama-600M at DP = 128: a 4096 x 1536 MLP matrix costs 229 GFLOP, a rank's share is 148), no
assignment of whole matrices balances: the rank that gets one is above the mean by the matrix's excess. Then
those matrices are split by rows over a *group* of ``g`` DP ranks (:mod:`megatron_geo.optim.split_ns`: each
member forms its partial Gram matrix, one all-reduce of ``k^2`` elements per quintic step sums them, every
member applies the small ``[k, k]`` polynomial to its own block), so each member does ``4 k^2 K / g + 2 k^3``
per step.

The rule (``optimizer.muon_split``):

- ``auto``: with ``mean`` the model's optimizer FLOPs over ``dp`` (every matrix whole), only the Muon matrices
  costing more than ``mean`` are candidates (nothing costs more -> the whole-matrix plan, bit for bit: Llama-600M
  and -300M at DP <= 64). For each group size ``g`` (divisors of ``dp`` first, at most 8) the planner lays out the
  split plan and estimates the optimizer step's time on it (:class:`PlanTime` under the assumed machine of
  :data:`SPLIT_COST`): the compute its busiest rank saves (FLOPs at ``flops_per_s``) against what the split's
  synchronous group collectives add (bytes at ``link_bytes_per_s`` plus ``collective_latency_s`` each). The
  fastest split plan is kept only if it is faster than the whole-matrix plan (:class:`AutoSplit`). Llama-600M at
  DP = 128 (quintic, BF16): 229.5 -> 187.2 GFLOP on the busiest rank saves 0.11 ms, the 5 Gram all-reduces
  of 37.7 MB add 0.85 ms: whole matrices.
- ``off``: never split.
- ``G`` (an integer >= 2): every Muon matrix is split over groups of ``G`` (at DP < G nothing is split).

Groups are fixed and aligned: DP ranks ``[k g, (k + 1) g)`` for ``k < dp // g`` (ranks past the last full group
own whole matrices only), so a rank is in one group, created once for all split matrices. A matrix can be split
only where its row blocks are contiguous ranges of the bucket: the group's first member's range ends with block 0,
the last member's range starts with its block, a middle member's range (``g >= 3``) in that bucket is its block
alone. So a group holds at most one split matrix per bucket (a matrix that finds no free group stays whole) and
row cuts fall on multiples of the reducer's alignment (``align / gcd(cols, align)`` rows), so every rank's range
stays aligned. Member k gets rows ``even_cuts`` of those units (the last member also the remainder).

Assignment: split matrices first (largest FLOPs first), each to the free group whose worst member has the
smallest ``max(flops / mean_flops, elements / mean_elements)`` after adding its share; then the whole
matrices as :func:`assign_owners` does (never onto a middle member of a split in their bucket).
The means count what each member really does: ``g`` times a member's cost for a split matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config.errors import ConfigError
from ..optim.muon import gram_restarts
from .plan_types import ParamSpec, Piece, ShardPlan, Split, ceil_to, newton_schulz_flops

MAX_AUTO_GROUP = 8
"""The largest group size ``auto`` chooses."""


@dataclass(frozen=True)
class SplitCost:
    """The machine ``optimizer.muon_split=auto`` assumes when it weighs a split against whole matrices
    (:class:`PlanTime`): the one place these figures live. None is measured by the planner (the plan must be the
    same on every rank and on a CPU); they are orders of magnitude for H100/H200-class GPUs.

    Attributes:
        flops_per_s: FLOP/s one GPU sustains on the optimizer's work (the Newton-Schulz products, BF16). 400e12:
            about 40% of the dense BF16 tensor-core peak of an H100/H200 SXM (989 TFLOP/s, NVIDIA's H100
            datasheet), a typical fraction for ``[k, k] x [k, K]`` products at k = 1536 (an assumption).
        link_bytes_per_s: bytes/s one GPU sends to the other members of its split group. 50e9: one 400 Gb/s NDR
            InfiniBand NIC per GPU (DGX H100/H200: eight ConnectX-7 at 400 Gb/s), i.e. the members on different
            nodes, as consecutive DP ranks are when tensor (or pipeline) ranks fill a node: the conservative case.
        collective_latency_s: seconds one small synchronous group collective (a Gram all-reduce, a re-layout
            all-to-all) costs beyond its bytes between nodes. 20e-6: the order of NCCL's inter-node latency for
            small messages over InfiniBand (nccl-tests all_reduce_perf, 10-30 us for 2 nodes).
    """

    flops_per_s: float = 400e12
    link_bytes_per_s: float = 50e9
    collective_latency_s: float = 20e-6


SPLIT_COST = SplitCost()
"""The assumed machine of ``optimizer.muon_split=auto`` (:class:`SplitCost`)."""


@dataclass(frozen=True)
class PlanTime:
    """The estimated optimizer time per step of one ownership plan under a :class:`SplitCost`.

    Rank r takes ``flops_r / flops_per_s`` (its optimizer FLOPs, :func:`plan_loads`) plus, for every split it is
    a member of, ``bytes / link_bytes_per_s + collectives * collective_latency_s`` (:func:`member_group_traffic`:
    the Gram all-reduces and wide re-layouts are synchronous, so each one waits for the whole group); the plan
    takes its slowest rank's time.

    Attributes:
        group_size: the groups' size (1: the whole-matrix plan).
        matrices: Muon matrices split.
        time_s: the slowest rank's estimate, seconds.
        rank: that rank.
        compute_s: that rank's FLOPs at ``flops_per_s``, seconds.
        comm_s: that rank's group collectives, seconds.
        group_bytes: bytes that rank sends in its groups per step.
        collectives: synchronous group collectives that rank waits on per step.
        max_flops: the busiest rank's optimizer FLOPs per step (whichever rank it is).
    """

    group_size: int
    matrices: int
    time_s: float
    rank: int
    compute_s: float
    comm_s: float
    group_bytes: float
    collectives: int
    max_flops: float


@dataclass(frozen=True)
class AutoSplit:
    """What ``optimizer.muon_split=auto`` weighed and chose (:func:`auto_split`; the plan report prints it).

    Attributes:
        whole: the whole-matrix plan's time (no group collectives).
        split: the fastest split plan over the group sizes tried (None: no candidate matrix could be split).
        chosen_split: whether the split plan was kept (``split.time_s < whole.time_s``).
        cost: the assumed machine.
        split_plan: ``(owner, splits)`` of the fastest split plan, as :func:`assign_with_splits` returns them
            (None with ``split``).
    """

    whole: PlanTime
    split: PlanTime | None
    chosen_split: bool
    cost: SplitCost
    split_plan: tuple[list[int], dict[int, Split]] | None = field(default=None, repr=False, compare=False)

    @property
    def saved_s(self) -> float:
        """Compute the split takes off the busiest rank: ``(whole.max_flops - split.max_flops) / flops_per_s``,
        seconds per step (0 without a split)."""
        if self.split is None:
            return 0.0
        return (self.whole.max_flops - self.split.max_flops) / self.cost.flops_per_s

    @property
    def added_s(self) -> float:
        """What the group collectives add to the split plan beyond its busiest rank's compute: ``split.time_s -
        split.max_flops / flops_per_s``, seconds per step (0 without a split). The split wins where ``saved_s >
        added_s``."""
        if self.split is None:
            return 0.0
        return self.split.time_s - self.split.max_flops / self.cost.flops_per_s


def parse_muon_split(value: str) -> int:
    """``optimizer.muon_split`` (the setting's text, e.g. ``"auto"``, ``"off"``, ``"2"``) as a group size: 0 for
    ``auto``, 1 for ``off``, else the size (>= 2). The one reader of the setting: validation, the ownership rule
    and the planner all call it.

    Raises:
        ConfigError: anything else (a ``ValueError``), naming the value and the valid ones.
    """
    text = str(value).strip().lower()
    if text == "auto":
        return 0
    if text == "off":
        return 1
    if text.isdigit() and int(text) >= 2:
        return int(text)
    raise ConfigError(
        f"optimizer.muon_split={value!r} is not auto, off or a group size >= 2; set optimizer.muon_split=auto "
        f"(split only the matrices whole ownership cannot balance), off, or e.g. 2"
    )


def _wide_share(rows: int, cols: int, g: int) -> float:
    """The largest fraction of the wide orientation's columns one of ``g`` members holds."""
    n = max(rows, cols)
    return math.ceil(n / g) / n


def member_flops(spec: ParamSpec, g: int) -> float:
    """Optimizer FLOPs per step of the busiest member of a ``g``-way split of ``spec``'s matrix."""
    return newton_schulz_flops((spec.rows, spec.cols), ns=spec.ns, share=_wide_share(spec.rows, spec.cols, g))


def row_unit(cols: int, align: int) -> int:
    """Rows per cut unit: a row cut at a multiple of this keeps the cut at a multiple of ``align`` elements."""
    return align // math.gcd(cols, align)


def row_cuts(rows: int, cols: int, g: int, align: int) -> tuple[int, ...] | None:
    """The ``g + 1`` row offsets of the members' blocks (near-even in :func:`row_unit` units; the last member also
    gets the rows past the last whole unit), or None when fewer than ``g`` units exist."""
    unit = row_unit(cols, align)
    units = rows // unit
    if units < g:
        return None
    base, extra = divmod(units, g)
    cuts = [0]
    for k in range(g):
        cuts.append(cuts[-1] + (base + (1 if k < extra else 0)) * unit)
    cuts[-1] = rows
    return tuple(cuts)


def _auto_sizes(dp_size: int) -> list[int]:
    sizes = [d for d in range(2, MAX_AUTO_GROUP + 1) if d <= dp_size and dp_size % d == 0]
    return sizes + [d for d in range(2, min(MAX_AUTO_GROUP, dp_size) + 1) if d not in sizes]


def _splittable(specs: list[ParamSpec], idx: list[int], g: int, align: int) -> list[int]:
    return [i for i in idx if row_cuts(specs[i].rows, specs[i].cols, g, align) is not None]


def plan_loads(
    specs: list[ParamSpec], dp_size: int, owner: list[int], splits: dict[int, Split]
) -> tuple[list[float], list[int]]:
    """Optimizer FLOPs and atomic elements per rank of an ownership (whole parameters by ``owner``, split ones by
    their members' rows, :func:`split_member_flops`)."""
    F, B = [0.0] * dp_size, [0] * dp_size
    for i, r in enumerate(owner):
        if i in splits:
            sp = splits[i]
            for k in range(sp.size):
                F[sp.first + k] += split_member_flops(sp, k, specs[i].ns)
                B[sp.first + k] += (sp.row_cuts[k + 1] - sp.row_cuts[k]) * sp.cols
        elif r >= 0:
            F[r] += specs[i].flops
            B[r] += specs[i].numel
    return F, B


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


def plan_owners(
    specs: list[ParamSpec], dp_size: int, align: int, bucket_of: dict[int, int], cost: SplitCost = SPLIT_COST
) -> tuple[list[int], dict[int, Split]]:
    """Owners of the atomic parameters and the splits, under the rule of the module docstring (``auto``:
    :func:`auto_split` under ``cost``).

    Returns:
        ``(owner, splits)`` as :func:`assign_with_splits` (``splits`` empty: the whole-matrix plan).

    Raises:
        ConfigError: a spec's ``split`` is not a valid ``optimizer.muon_split`` (:func:`parse_muon_split`).
    """
    whole = assign_owners(specs, dp_size)
    cand = [i for i, s in enumerate(specs) if s.atomic and s.rows > 0 and s.cols > 0]
    if not cand or dp_size < 2:
        return whole, {}
    policy = parse_muon_split(specs[cand[0]].split)
    if policy == 1:
        return whole, {}
    if policy >= 2:
        idx = _splittable(specs, cand, policy, align) if policy <= dp_size else []
        return assign_with_splits(specs, dp_size, policy, idx, bucket_of, align) if idx else (whole, {})
    _, owner, splits = auto_split(specs, dp_size, align, bucket_of, cost, whole)
    return owner, splits


def member_group_traffic(split: Split, member: int, ns: str, ns_bytes: int, steps: int = 5) -> tuple[float, int]:
    """What member ``member`` of ``split`` exchanges with its group per optimizer step.

    The Gram all-reduces (:func:`gram_reductions`, ring: ``2 (g - 1) / g`` of the ``k^2`` elements sent, the
    first in FP32, the others in the Newton-Schulz dtype) and, for a wide matrix, the two re-layouts
    (:func:`relayout_elements`, FP32 there and the Newton-Schulz dtype back).

    Args:
        ns: ``quintic`` or ``gram``.
        ns_bytes: bytes per element of the Newton-Schulz dtype (2: BF16).

    Returns:
        ``(bytes sent, synchronous collectives)``.
    """
    k = min(split.rows, split.cols)
    n = gram_reductions(split, ns, steps)
    ring = 2 * (split.size - 1) / split.size * k * k
    wide = split.rows < split.cols
    sent = ring * (4 + (n - 1) * ns_bytes) + relayout_elements(split, member) * (4 + ns_bytes)
    return sent, n + (2 if wide else 0)


def plan_time(
    specs: list[ParamSpec], dp_size: int, owner: list[int], splits: dict[int, Split], cost: SplitCost = SPLIT_COST
) -> PlanTime:
    """The estimated optimizer time per step of an ownership (:class:`PlanTime`: ``owner`` and ``splits`` as
    :func:`assign_with_splits` returns them)."""
    F, _ = plan_loads(specs, dp_size, owner, splits)
    sent, colls = [0.0] * dp_size, [0] * dp_size
    for i, sp in splits.items():
        for k in range(sp.size):
            b, c = member_group_traffic(sp, k, specs[i].ns, specs[i].ns_bytes)
            sent[sp.first + k] += b
            colls[sp.first + k] += c

    def comm(r: int) -> float:
        return sent[r] / cost.link_bytes_per_s + colls[r] * cost.collective_latency_s

    r = max(range(dp_size), key=lambda r: (F[r] / cost.flops_per_s + comm(r), -r))
    sizes = {sp.size for sp in splits.values()}
    return PlanTime(
        group_size=max(sizes, default=1),
        matrices=len(splits),
        time_s=F[r] / cost.flops_per_s + comm(r),
        rank=r,
        compute_s=F[r] / cost.flops_per_s,
        comm_s=comm(r),
        group_bytes=sent[r],
        collectives=colls[r],
        max_flops=max(F),
    )


def auto_split(
    specs: list[ParamSpec],
    dp_size: int,
    align: int,
    bucket_of: dict[int, int],
    cost: SplitCost = SPLIT_COST,
    whole: list[int] | None = None,
) -> tuple[AutoSplit | None, list[int], dict[int, Split]]:
    """``optimizer.muon_split=auto``: the whole-matrix plan or a split one, whichever :func:`plan_time` estimates
    faster under ``cost`` (the whole-matrix plan on a tie).

    Candidates are the Muon matrices costing more than the mean per-rank share of the model's optimizer FLOPs;
    each group size of :func:`_auto_sizes` that can split one of them gives a plan (:func:`assign_with_splits`),
    and the fastest of those (the first on a tie) is weighed against the whole-matrix plan.

    Args:
        specs, dp_size, align, bucket_of: as :func:`assign_with_splits`.
        cost: the assumed machine.
        whole: :func:`assign_owners` of ``specs`` when already computed.

    Returns:
        ``(decision, owner, splits)``: ``decision`` None where nothing was weighed (no candidate matrix, or
        ``dp_size < 2``); ``owner, splits`` the chosen plan as :func:`assign_with_splits` returns it.
    """
    whole = assign_owners(specs, dp_size) if whole is None else whole
    cand = [i for i, s in enumerate(specs) if s.atomic and s.rows > 0 and s.cols > 0]
    mean_fl = sum(s.flops for s in specs) / max(dp_size, 1)
    big = [i for i in cand if specs[i].flops > mean_fl]
    if not big or dp_size < 2:
        return None, whole, {}
    whole_time = plan_time(specs, dp_size, whole, {}, cost)
    best: tuple[list[int], dict[int, Split]] | None = None
    best_time: PlanTime | None = None
    for g in _auto_sizes(dp_size):
        idx = _splittable(specs, big, g, align)
        if not idx:
            continue
        trial = assign_with_splits(specs, dp_size, g, idx, bucket_of, align)
        if not trial[1]:
            continue
        t = plan_time(specs, dp_size, *trial, cost)
        if best_time is None or t.time_s < best_time.time_s:
            best, best_time = trial, t
    chosen = best is not None and best_time is not None and best_time.time_s < whole_time.time_s
    decision = AutoSplit(whole_time, best_time, chosen, cost, best)
    if chosen:
        assert best is not None
        return decision, best[0], best[1]
    return decision, whole, {}


def water_level(pre: list[float], rep: float, work: float) -> tuple[float, list[float]]:
    """Balance a group's members: member j already does ``pre[j] + rep`` FLOPs (its whole parameters and the
    replicated ``[k, k]`` polynomials of the group's splits) and takes the share ``s_j`` (``sum s_j = 1``,
    ``s_j >= 0``) of the splits' ``work`` FLOPs that scale with the rows it holds. Returns the level ``T`` (the
    busiest member's FLOPs) and the shares that reach it: ``s_j = max(0, T - pre[j] - rep) / work``."""
    if work <= 0:
        return max(pre) + rep, [1.0 / len(pre)] * len(pre)
    order = sorted(pre)
    level = 0.0
    for n in range(1, len(order) + 1):  # the n least loaded members take all the work
        level = (sum(order[:n]) + n * rep + work) / n
        if n == len(order) or level <= order[n] + rep:
            break
    shares = [max(0.0, level - p - rep) / work for p in pre]
    total = sum(shares)
    return level, [x / total for x in shares]


def cuts_from_shares(rows: int, cols: int, shares: list[float], align: int) -> tuple[int, ...]:
    """Row cuts giving member j about ``shares[j]`` of the rows, at least one :func:`row_unit` each, every cut but
    the last a multiple of the unit (largest remainders get the rounding)."""
    unit = row_unit(cols, align)
    units, g = rows // unit, len(shares)
    want = [max(1.0, s * units) for s in shares]
    scale = (units - g) / max(sum(w - 1.0 for w in want), 1e-12)
    extra = [(w - 1.0) * scale for w in want]
    got = [1 + int(math.floor(e)) for e in extra]
    for j in sorted(range(g), key=lambda j: (-(extra[j] - math.floor(extra[j])), j))[: units - sum(got)]:
        got[j] += 1
    cuts = [0]
    for n in got:
        cuts.append(cuts[-1] + n * unit)
    cuts[-1] = rows
    return tuple(cuts)


def assign_with_splits(
    specs: list[ParamSpec],
    dp_size: int,
    g: int,
    to_split: list[int],
    bucket_of: dict[int, int],
    align: int,
) -> tuple[list[int], dict[int, Split]]:
    """Owners of the atomic parameters with the matrices of ``to_split`` split over groups of ``g`` ranks.

    Split matrices first (largest first, each to the free group of its bucket with the lowest balanced level),
    then the whole ones, largest first, each to the rank where ``max(flops / mean_flops, elements /
    mean_elements)`` is smallest, a group member's FLOPs being its group's balanced level (:func:`water_level`:
    the group's split rows are moved towards the members with less other work). Finally every group's row cuts
    are set from its balanced shares.

    Args:
        specs: every parameter (backward order).
        dp_size: DP ranks (>= ``g``).
        g: group size (>= 2).
        to_split: the parameters to split where a group is free in their bucket.
        bucket_of: the atomic bucket of every atomic parameter.
        align: the reducer's alignment (row cuts keep every range a multiple of it).

    Returns:
        ``(owner, splits)``: ``owner[i]`` the rank owning atomic parameter i whole (the group's first rank for a
        split one, -1 for splittable parameters); ``splits[i]`` the :class:`~.plan_types.Split` of each split one.
    """
    blocks = dp_size // g
    rep = {i: newton_schulz_flops((specs[i].rows, specs[i].cols), ns=specs[i].ns, share=0.0) for i in to_split}
    work = {i: newton_schulz_flops((specs[i].rows, specs[i].cols), ns=specs[i].ns) - rep[i] for i in to_split}
    total_el = max(sum(s.numel for s in specs), 1)
    mean_el = total_el / dp_size
    whole_fl = sum(s.flops for i, s in enumerate(specs) if s.atomic and i not in rep)
    mean_fl = max(whole_fl + sum(g * rep[i] + work[i] for i in to_split), 1.0) / dp_size
    F, B = [0.0] * dp_size, [0] * dp_size  # whole parameters' FLOPs and elements per rank
    rep_b, work_b, el_b = [0.0] * blocks, [0.0] * blocks, [0] * blocks  # per group: its splits
    hosted: list[list[int]] = [[] for _ in range(blocks)]
    used: set[tuple[int, int]] = set()  # (bucket, block) holding a split
    middle: set[tuple[int, int]] = set()  # (bucket, rank): a middle member's range there is its block alone

    def level(k: int, r: int = -1, fl: float = 0.0, w: float = 0.0, rp: float = 0.0) -> float:
        pre = [F[k * g + j] + (fl if k * g + j == r else 0.0) for j in range(g)]
        return water_level(pre, rep_b[k] + rp, work_b[k] + w)[0]

    for i in sorted(to_split, key=lambda i: (-specs[i].flops, -specs[i].numel, i)):
        bk = bucket_of[i]
        free = [k for k in range(blocks) if (bk, k) not in used]
        if not free:
            continue
        k = min(free, key=lambda k: (level(k, w=work[i], rp=rep[i]), el_b[k], k))
        used.add((bk, k))
        hosted[k].append(i)
        rep_b[k] += rep[i]
        work_b[k] += work[i]
        el_b[k] += specs[i].numel
        middle.update((bk, k * g + j) for j in range(1, g - 1))
    owner = [-1] * len(specs)
    in_block = {k * g + j: k for k in range(blocks) for j in range(g)}

    def key(r: int, s: ParamSpec) -> tuple:
        k = in_block.get(r, -1)
        if k >= 0 and hosted[k]:
            fl = level(k, r, s.flops)
            el = B[r] + s.numel + el_b[k] / g
        else:
            fl, el = F[r] + s.flops, B[r] + s.numel
        return max(fl / mean_fl, el / mean_el), fl, el, r

    split_set = {i for k in range(blocks) for i in hosted[k]}
    for i in sorted(
        (i for i, s in enumerate(specs) if s.atomic and i not in split_set),
        key=lambda i: (-specs[i].flops, -specs[i].numel, i),
    ):
        s = specs[i]
        r = min((r for r in range(dp_size) if (bucket_of[i], r) not in middle), key=lambda r: key(r, s))
        owner[i] = r
        F[r] += s.flops
        B[r] += s.numel
    splits: dict[int, Split] = {}
    for k in range(blocks):
        if not hosted[k]:
            continue
        _, shares = water_level([F[k * g + j] for j in range(g)], rep_b[k], work_b[k])
        for i in hosted[k]:
            owner[i] = k * g
            splits[i] = Split(k * g, cuts_from_shares(specs[i].rows, specs[i].cols, shares, align), specs[i].cols)
    return owner, splits


def split_bucket(
    idx: list[int], specs: list[ParamSpec], owner: list[int], splits: dict[int, Split], dp: int, align: int
) -> ShardPlan:
    """The layout of an atomic bucket (``idx``: its parameters) holding split matrices.

    Ranks in order; each rank's whole parameters in bucket order, every one starting aligned. A group's first
    member ends its range with block 0 of the group's split (starting aligned), the next members start theirs
    with their blocks (contiguous: the matrix is one range of the buffer), the last member then adds its whole
    parameters. Every range ends at a multiple of ``align`` (the row cuts are multiples of it)."""
    local = {j: splits[i] for j, i in enumerate(idx) if i in splits}
    role: dict[int, tuple[int, int]] = {}  # rank -> (bucket index of its split, member)
    for j, sp in local.items():
        for k in range(sp.size):
            role[sp.first + k] = (j, k)
    offsets = [0] * len(idx)
    pieces: list[list[Piece]] = [[] for _ in range(dp)]
    bounds, pos = [0], 0
    for r in range(dp):
        start = pos
        j, k = role.get(r, (-1, -1))
        sp = local.get(j)  # type: ignore[assignment]
        if sp is not None and k > 0:  # continues the matrix the previous member began
            lo, hi = sp.row_cuts[k] * sp.cols, sp.row_cuts[k + 1] * sp.cols
            assert pos == offsets[j] + lo, (pos, offsets[j], lo)
            pieces[r].append(Piece(j, lo, hi, pos))
            pos += hi - lo
        if sp is None or k == 0 or k == sp.size - 1:
            for jj, i in enumerate(idx):
                if owner[i] == r and i not in splits:
                    pos = ceil_to(pos, align)
                    offsets[jj] = pos
                    pieces[r].append(Piece(jj, 0, specs[i].numel, pos))
                    pos += specs[i].numel
        if sp is not None and k == 0:
            pos = ceil_to(pos, align)
            offsets[j] = pos
            hi = sp.row_cuts[1] * sp.cols
            pieces[r].append(Piece(j, 0, hi, pos))
            pos += hi
        elif pos > start:
            pos = ceil_to(pos, align)
        bounds.append(pos)
    return ShardPlan(bounds, offsets, pieces, dict(local))


def col_cuts(split: Split) -> tuple[int, ...]:
    """Column cuts of a wide matrix's re-layout: proportional to the row cuts, so every member works on the same
    share of ``X`` as it owns of ``W``."""
    return tuple(c * split.cols // split.rows for c in split.row_cuts)


def member_share(split: Split, member: int) -> float:
    """The fraction of the wide orientation's columns member ``member`` of ``split`` works on: its rows of a tall
    or square matrix (``X = W^T``), its columns of a wide one after the re-layout (:func:`col_cuts`)."""
    if split.rows >= split.cols:
        return (split.row_cuts[member + 1] - split.row_cuts[member]) / split.rows
    cuts = col_cuts(split)
    return (cuts[member + 1] - cuts[member]) / split.cols


def split_member_flops(split: Split, member: int, ns: str, steps: int = 5) -> float:
    """Newton-Schulz FLOPs per step of member ``member`` of ``split`` (its share of the ``k^2 K`` products plus the
    replicated ``[k, k]`` polynomial, :func:`~.plan_types.newton_schulz_flops`)."""
    return newton_schulz_flops((split.rows, split.cols), steps, ns, member_share(split, member))


def gram_reductions(split: Split, ns: str, steps: int = 5) -> int:
    """All-reduces of the ``[k, k]`` partial Gram per step: one per quintic step, one per Gram build (start and
    each restart) for the Gram form of a rectangular matrix."""
    if ns == "gram" and split.rows != split.cols:
        return 1 + len(gram_restarts(steps))
    return steps


def relayout_elements(split: Split, member: int) -> int:
    """Elements member ``member`` sends in each of the two exchanges of a wide matrix (rows -> column blocks and
    back): its rows of every other member's columns; 0 for a tall or square matrix."""
    if split.rows >= split.cols:
        return 0
    cuts = col_cuts(split)
    mine = split.row_cuts[member + 1] - split.row_cuts[member]
    return mine * (split.cols - (cuts[member + 1] - cuts[member]))
