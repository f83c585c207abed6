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

- ``auto``: with ``mean`` the model's optimizer FLOPs over ``dp`` (every matrix whole), the Muon matrices
  costing more than ``mean`` are split, over the smallest group size ``g`` (divisors of ``dp`` first, at most 8)
  whose members' cost is at most ``mean``. Nothing costs more than ``mean`` -> nothing is split and the plan is
  the whole-matrix plan, bit for bit (Llama-600M and -300M at DP <= 64).
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

from ..config.errors import ConfigError
from ..optim.muon import gram_restarts
from .plan_types import ParamSpec, Piece, ShardPlan, Split, ceil_to, newton_schulz_flops

MAX_AUTO_GROUP = 8
"""The largest group size ``auto`` chooses."""


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
    specs: list[ParamSpec], dp_size: int, align: int, bucket_of: dict[int, int]
) -> tuple[list[int], dict[int, Split]]:
    """Owners of the atomic parameters and the splits, under the rule of the module docstring.

    ``auto`` tries the whole-matrix plan (:func:`assign_owners`) and, when some Muon matrix costs
    more than the mean share, each group size (:func:`assign_with_splits`); it keeps the plan with the smallest
    ``max(max_flops / mean_flops, max_elements / mean_elements)`` (both means of the whole-matrix plan: a fixed
    yardstick, so a split that adds more replicated work than it removes from the busiest rank loses), the
    whole-matrix plan on a tie.

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
    mean_fl = sum(s.flops for s in specs) / dp_size
    big = [i for i in cand if specs[i].flops > mean_fl]
    if not big:
        return whole, {}
    mean_el = max(sum(s.numel for s in specs), 1) / dp_size

    def score(owner: list[int], splits: dict[int, Split]) -> float:
        F, B = plan_loads(specs, dp_size, owner, splits)
        return max(max(F) / mean_fl, max(max(B), mean_el) / mean_el)

    best: tuple[list[int], dict[int, Split]] = (whole, {})
    best_score = score(whole, {})
    for g in _auto_sizes(dp_size):
        idx = _splittable(specs, big, g, align)
        if not idx:
            continue
        trial = assign_with_splits(specs, dp_size, g, idx, bucket_of, align)
        sc = score(*trial)
        if sc < best_score:
            best, best_score = trial, sc
    return best


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
