"""The DP groups that split Muon matrices, and the Muon update of a split matrix's row block.

:class:`MuonGroups`: the fixed partition of every DP group into blocks of ``size`` consecutive DP ranks
(:mod:`.split_plan`), created once, by every rank in the same order (``torch.distributed.new_group`` for every
TP rank's DP group, block by block); this rank's block is ``group``. Passed explicitly, never module-level.

:class:`SplitMuon`: ``torch.optim.Muon``'s update (same constructor, defaults and state name
``momentum_buffer``) for row blocks ``W[r0:r1]`` of matrices split over a group: momentum, Nesterov and weight
decay are element-wise on the block; the orthogonalisation is :func:`~megatron_geo.optim.split_ns.split_orthogonalize`
with the group's all-reduce (and its all-to-all for a wide matrix); the learning rate is adjusted for the full
matrix's shape (:func:`~megatron_geo.optim.muon.adjusted_lr`). Every member of a group steps its blocks in the
same order (bucket order; a group holds one split per bucket), so the collectives match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..optim.muon import NS_CHOICES, MuonNS, NSSettings
from ..optim.split_ns import split_orthogonalize
from ..parallel import ParallelContext
from ..parallel import collectives as C
from .plan_types import Split
from .split_plan import col_cuts


@dataclass
class MuonGroups:
    """This rank's Muon split group: ``size`` members, this rank is ``member`` of block ``block``; ``group`` is
    its process group (None when this rank is past the last full block: it holds no split)."""

    size: int
    block: int
    member: int
    group: dist.ProcessGroup | None

    @classmethod
    def create(cls, pctx: ParallelContext, size: int) -> MuonGroups:
        """Create the groups of ``size`` consecutive DP ranks for every TP rank (collective: every rank of the world
        calls it with the same ``size``, in the same place of the program).

        Raises:
            ValueError: ``size`` below 2 or above the DP size.
        """
        if not 2 <= size <= pctx.dp_size:
            raise ValueError(f"a Muon split group of {size} ranks needs 2 <= size <= DP size {pctx.dp_size}")
        mine = None
        for t in range(pctx.tp_size):
            for k in range(pctx.dp_size // size):
                ranks = [(k * size + j) * pctx.tp_size + t for j in range(size)]
                g = dist.new_group(ranks)
                if pctx.rank in ranks:
                    mine = g
        block, member = divmod(pctx.dp_rank, size)
        return cls(size, block, member, mine)

    def all_reduce(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The group's sum of this member's partial Gram (``parts``: one ``[m, m]`` tensor)."""
        if self.group is None or len(parts) != 1:
            raise RuntimeError("this rank holds no Muon split (or got more than its own part)")
        t = parts[0].contiguous()
        C.all_reduce(t, self.group)
        return t

    def exchange_for(self, split: Split):
        """The block exchange of a wide ``split`` (rows -> column blocks and back) as ``split_orthogonalize`` wants
        it: one ``all_to_all_single`` per call, split sizes from the row and column cuts."""
        rows, cols = split.row_cuts, col_cuts(split)
        me = self.member

        calls = [0]  # split_orthogonalize exchanges twice: rows -> column blocks, then back

        def exchange(send: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
            (parts,) = send
            there = calls[0] == 0
            calls[0] += 1
            if there:  # from member j: its rows of my columns
                shapes = [(rows[j + 1] - rows[j], cols[me + 1] - cols[me]) for j in range(split.size)]
            else:  # from member j: my rows of its columns
                shapes = [(rows[me + 1] - rows[me], cols[j + 1] - cols[j]) for j in range(split.size)]
            flat = torch.cat([q.reshape(-1) for q in parts])
            out = torch.empty(sum(a * b for a, b in shapes), dtype=flat.dtype, device=flat.device)
            C.all_to_all_single(
                out, flat, self.group, [a * b for a, b in shapes], [q.numel() for q in parts], async_op=False
            )
            got, pos = [], 0
            for a, b in shapes:
                got.append(out[pos : pos + a * b].view(a, b))
                pos += a * b
            return [got]

        return exchange


class SplitMuon(MuonNS):
    """:class:`~megatron_geo.optim.muon.MuonNS` for row blocks of matrices split over :class:`MuonGroups` (see the
    module docstring): momentum, Nesterov, weight decay and lr are MuonNS's own step; only the orthogonalisation
    (across the group) and the lr's matrix shape (the whole matrix) differ.

    Args:
        params: param groups of the row blocks (FP32 main params ``[r, cols]``).
        groups: this rank's :class:`MuonGroups`.
        splits: ``id(param) -> (Split, full shape)`` of every block.
        ns: ``quintic`` or ``gram`` (:func:`~megatron_geo.optim.muon.orthogonalize`'s choice).
        ns_dtype: the precision of the iteration (FP32 on CPU, BF16 where torch's Muon would run).
        kwargs: torch.optim.Muon's constructor arguments.

    Raises:
        ValueError: ``ns`` is not one of :data:`~megatron_geo.optim.muon.NS_CHOICES`.
    """

    def __init__(self, params, groups: MuonGroups, splits: dict, ns: str = "quintic", ns_dtype=torch.float32, **kw):
        if ns not in NS_CHOICES:
            raise ValueError(
                f"optimizer.muon_ns={ns!r} is not one of {NS_CHOICES}; set optimizer.muon_ns=quintic or gram"
            )
        super().__init__(params, ns_dtype=ns_dtype, ns=ns, **kw)
        self.groups, self.splits = groups, splits

    def _orthogonalize(self, upd: torch.Tensor, group: dict, p: torch.Tensor) -> torch.Tensor:
        split, _shape = self.splits[id(p)]
        (ortho,) = split_orthogonalize(
            [upd],
            [self.groups.member],
            split.row_cuts,
            NSSettings(self.ns, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype),
            self.groups.all_reduce,
            self.groups.exchange_for(split),
            col_cuts(split) if split.rows < split.cols else None,
        )
        return ortho

    def _lr_shape(self, p: torch.Tensor) -> torch.Size:
        return torch.Size(self.splits[id(p)][1])

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if any(p.grad is None for p in group["params"]):
                raise RuntimeError("a split Muon block has no gradient; every member must step it")
        return super().step(closure)
