"""Distributed optimizer: FP32 main params and optimizer state for this DP rank's shard only.

For each piece of a bucket this rank owns (see :mod:`.shard_plan`), a main param is created:
the whole parameter (its own shape) for atomic pieces, its row block ``[rows, cols]`` for a Muon matrix split
over a group of DP ranks (:mod:`.split_plan`; updated by :class:`~.muon_groups.SplitMuon` over the group's
:class:`~.muon_groups.MuonGroups`, created here once when the plan splits anything), or a flat FP32 slice for
split pieces of element-wise (AdamW) parameters. ``main.grad`` is a persistent view into the bucket's FP32 gradient
buffer, so the reduction writes straight into it. After the step the main params are copied into
the bucket's parameter buffer and gathered over DP (Megatron's ZeRO-1 style distributed optimizer): one
all-gather per bucket for even plans, one broadcast per owner range for whole-parameter plans. With
``param_gather=fp8`` or ``nvfp4`` the owners send the quantised difference between the new parameters and what
every replica holds instead (:mod:`.param_gather`).

With ``sharded=False`` every rank owns every parameter whole (the all-reduce path, no all-gather).

Optimizers are torch's own: ``torch.optim.AdamW`` (fused on CUDA) and ``torch.optim.Muon`` for 2-D
hidden matrices (Jordan et al. 2024; lr adjusted with ``match_rms_adamw`` so one lr serves both). On CPU
Muon's Newton-Schulz runs in FP32 (see :mod:`megatron_geo.optim.muon`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.hooks import RemovableHandle

from ..comm.param_codec import gather_codec
from ..config.schema import OptimizerConfig
from ..optim import build_muon, newton_schulz_dtype
from ..parallel import ParallelContext
from ..parallel import collectives as C
from ..parallel.trace import trace_range
from .buckets import Bucket
from .muon_groups import MuonGroups, SplitMuon
from .param_gather import QuantizedParamGather
from .plan_types import Split


class _Work(Protocol):
    """An in-flight collective (a ``torch.distributed`` work handle or a group of them)."""

    def wait(self) -> object: ...


@dataclass
class MainParam:
    """FP32 master copy of (part of) a parameter: ``param_start..param_end`` of ``param`` (flattened)."""

    main: torch.Tensor
    param: torch.nn.Parameter
    name: str
    bucket: Bucket
    buffer_start: int
    whole: bool
    count_in_norm: bool
    param_start: int = 0
    split: Split | None = None  # the row split of a Muon matrix this main param is one member's block of


def _make_main(bucket: Bucket, idx: int, start: int, end: int, buffer_start: int, tp_rank: int) -> MainParam:
    p = bucket.params[idx]
    whole = start == 0 and end == p.numel()
    split = None if whole else bucket.plan.splits.get(idx)
    flat = p.detach().reshape(-1)[start:end]
    main = flat.float().clone().view_as(p) if whole else flat.float().clone()
    if split is not None:  # a row block [rows, cols] of the matrix
        main = main.view(-1, split.cols)
    g = bucket.grad_data[buffer_start : buffer_start + (end - start)]
    main.grad = g.view_as(main)
    # TP-replicated parameters (norm weights) hold identical grads on all TP ranks: count once.
    count = bool(getattr(p, "tensor_model_parallel", False)) or tp_rank == 0
    return MainParam(main, p, bucket.names[idx], bucket, buffer_start, whole, count, start, split)


class DistributedOptimizer:
    """Owns main params, the torch optimizers, global-norm clipping and the param all-gather.

    ``param_gather``: ``comm.param_gather``; ``fp8`` / ``nvfp4`` gather the quantised difference of the parameters
    (:class:`~.param_gather.QuantizedParamGather`, then :attr:`quantized_gather`) where anything is gathered
    (``sharded`` and more than one DP rank); ``auto`` / ``bf16`` (or nothing to gather) the parameters themselves.
    ``gather_bytes_sent``: bytes this rank sent in parameter gathers since the last :meth:`reset_gather_bytes`.

    Raises:
        ValueError: an unknown ``param_gather``, or buckets not aligned for the quantised gather.
    """

    def __init__(
        self,
        buckets: list[Bucket],
        cfg: OptimizerConfig,
        pctx: ParallelContext,
        sharded: bool,
        overlap_param_gather: bool = False,
        param_gather: str = "auto",
    ):
        self.buckets, self.cfg, self.pctx, self.sharded = buckets, cfg, pctx, sharded
        self.overlap_param_gather = overlap_param_gather and sharded and pctx.dp_size > 1
        self._gathers: dict[int, _Work] = {}  # bucket index -> in-flight parameter gather
        codec = gather_codec(param_gather)
        gathers = sharded and pctx.dp_size > 1
        self.quantized_gather = QuantizedParamGather(codec, buckets, pctx) if codec and gathers else None
        self.gather_bytes_sent = 0
        self._hooks: list[RemovableHandle] = []
        self.mains: list[MainParam] = []
        for b in buckets:
            if sharded:
                for pc in b.plan.pieces[pctx.dp_rank]:
                    self.mains.append(
                        _make_main(b, pc.index, pc.param_start, pc.param_end, pc.buffer_start, pctx.tp_rank)
                    )
            else:
                for i, p in enumerate(b.params):
                    self.mains.append(_make_main(b, i, 0, p.numel(), b.plan.offsets[i], pctx.tp_rank))
        sizes = {sp.size for b in buckets for sp in b.plan.splits.values()} if sharded else set()
        if len(sizes) > 1:
            raise ValueError(f"the shard plan splits Muon matrices over groups of different sizes {sorted(sizes)}")
        # every rank holds every bucket's plan, so all create the groups (or none), in the same order
        self.muon_groups = MuonGroups.create(pctx, sizes.pop()) if sizes else None
        self.optimizers = self._build_optimizers()
        self._owned = {b.index: [(m.buffer_start, m.main) for m in self.mains if m.bucket is b] for b in buckets}

    def _build_optimizers(self) -> list[torch.optim.Optimizer]:
        c = self.cfg
        muon, decay, no_decay, split = [], [], [], []
        for m in self.mains:
            if c.name == "muon" and getattr(m.param, "use_muon", False):
                if m.split is not None:
                    split.append(m)
                    continue
                if not m.whole:
                    raise RuntimeError(
                        f"Muon parameter {m.name} is cut across DP ranks outside a row split of the plan; it must "
                        f"be atomic or split by rows (optimizer.muon_split)"
                    )
                muon.append(m.main)
            elif m.param.ndim >= 2:
                decay.append(m.main)
            else:
                no_decay.append(m.main)
        opts: list[torch.optim.Optimizer] = []
        adam_lr = c.lr if c.adamw_lr < 0 else c.adamw_lr
        groups = [
            g
            for g in (
                {"params": decay, "weight_decay": c.weight_decay, "base_lr": adam_lr},
                {"params": no_decay, "weight_decay": 0.0, "base_lr": adam_lr},
            )
            if g["params"]
        ]
        if groups:
            fused = all(m.main.is_cuda for m in self.mains)
            opts.append(torch.optim.AdamW(groups, lr=adam_lr, betas=(c.beta1, c.beta2), eps=c.eps, fused=fused or None))
        ns_dtype = newton_schulz_dtype(c, self.pctx.device)
        if muon:
            opts.append(
                build_muon(
                    [{"params": muon, "base_lr": c.lr}],
                    ns_dtype=ns_dtype,
                    ns=c.muon_ns,
                    early=c.muon_overlap,
                    lr=c.lr,
                    weight_decay=c.weight_decay,
                    momentum=c.muon_momentum,
                    adjust_lr_fn=c.muon_adjust_lr_fn,
                )
            )
        if split:
            assert self.muon_groups is not None  # created in __init__ whenever a plan splits a matrix
            opts.append(
                SplitMuon(
                    [{"params": [m.main for m in split], "base_lr": c.lr}],
                    self.muon_groups,
                    {id(m.main): (m.split, tuple(m.param.shape)) for m in split},
                    ns=c.muon_ns,
                    ns_dtype=ns_dtype,
                    lr=c.lr,
                    weight_decay=c.weight_decay,
                    momentum=c.muon_momentum,
                    adjust_lr_fn=c.muon_adjust_lr_fn,
                )
            )
        return opts

    # ---------------------------------------------------------------------------------------------
    def grad_norm(self, extra: list[float] | None = None):
        """Global L2 norm of the averaged gradient over TP x DP, each element counted once (FP64 sum of
        squares; NaN when non-finite). One collective and one host read.

        ``extra``: host numbers (e.g. per-rank stop-request counts) summed over all ranks of the world group in
        the same collective; then ``(norm, summed extra)`` is returned. Without the distributed optimizer
        every DP rank holds the whole gradient, so only DP rank 0 contributes its sum of squares there.
        """
        pctx = self.pctx
        n_extra = len(extra or [])
        buf = torch.zeros(1 + n_extra, dtype=torch.float64, device=pctx.device)
        sq = buf[0]
        for m in self.mains:
            if m.count_in_norm:
                grad = m.main.grad
                assert grad is not None  # set by _make_main: a view of the bucket's gradient buffer
                sq += grad.double().pow(2).sum()
        for i, v in enumerate(extra or []):
            if v:
                buf[1 + i].fill_(float(v))  # a scalar kernel argument, no host-to-device copy
        if self.sharded or (extra is not None and pctx.dp_size > 1):
            if not self.sharded and pctx.dp_rank != 0:
                sq.zero_()  # the world sum counts the (replicated) gradient of one DP rank only
            C.all_reduce(buf, pctx.world_group)
        elif pctx.tp_size > 1:
            C.all_reduce(buf, pctx.tp_group)
        host = buf.tolist()  # the one host read of the step
        norm = math.sqrt(host[0]) if math.isfinite(host[0]) else float("nan")
        return norm if extra is None else (norm, host[1:])

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale gradients by ``max_norm / norm`` when the norm exceeds ``max_norm`` (> 0)."""
        if max_norm > 0 and norm > max_norm:
            coef = max_norm / (norm + 1e-6)
            for m in self.mains:
                grad = m.main.grad
                assert grad is not None  # set by _make_main: a view of the bucket's gradient buffer
                grad.mul_(coef)

    def step(self, lr_scale: float) -> None:
        """One optimizer step at ``lr = base_lr * lr_scale``, then publish the new params to every rank."""
        with trace_range("optimizer"):
            for opt in self.optimizers:
                for g in opt.param_groups:
                    g["lr"] = g["base_lr"] * lr_scale
                opt.step()
        self.publish()

    def publish(self) -> None:
        """Copy every main param into the model's parameter buffer (model dtype) and gather it over DP; with the
        quantised gather (:attr:`quantized_gather`) send the quantised difference to what the replicas hold instead.

        With ``overlap_param_gather`` the gathers are only started, in forward order (last bucket first: the
        buckets follow backward order); each is waited by :meth:`wait_param_gather` -- from the forward
        pre-hooks of :meth:`register_forward_hooks` just before its parameters are used, or for all before
        anything else reads the parameters (evaluation, checkpoints, the end of training).
        """
        if self.quantized_gather is None:
            self._publish_plain(None)
            return
        self.wait_param_gather()
        q = self.quantized_gather
        with torch.no_grad(), trace_range("collective"):
            for b in reversed(self.buckets):
                self._gathers[b.index] = q.start(b, self._owned[b.index])
        if not self.overlap_param_gather:
            self.wait_param_gather()

    def load_params(self, held: dict[int, torch.Tensor] | None = None) -> None:
        """Set the model's parameters on every DP rank to exactly ``held`` (FP32 values of the parameter pieces this
        rank owns, by ``id(main param)``: the replicas' parameters a checkpoint saved with the quantised gather), or
        to the main params rounded to the model's dtype (None), with a plain gather whatever ``param_gather`` is;
        waited on return. For checkpoint loads, where the replicas' parameters must be restored, not updated.

        Raises:
            KeyError: ``held`` lacks a main param of this rank.
        """
        counted = self.gather_bytes_sent
        self._publish_plain(held)
        self.wait_param_gather()
        self.gather_bytes_sent = counted  # a load is no training step's traffic

    def _publish_plain(self, values: dict[int, torch.Tensor] | None) -> None:
        """Write ``values[id(m.main)]`` (default: ``m.main``) of every main param into the parameter buffers and
        start (or, without ``overlap_param_gather``, finish) the plain gather of every bucket."""
        self.wait_param_gather()
        with torch.no_grad():
            for m in self.mains:
                n = m.main.numel()
                src = m.main if values is None else values[id(m.main)]
                m.bucket.param_data[m.buffer_start : m.buffer_start + n].copy_(src.reshape(-1))
            if self.sharded and self.pctx.dp_size > 1:
                with trace_range("collective"):
                    for b in reversed(self.buckets):
                        self._gathers[b.index] = C.all_gather_ranges(
                            b.param_data, b.plan.bounds, self.pctx.dp_group, async_op=True
                        )
                        own = b.plan.sizes[self.pctx.dp_rank]
                        self.gather_bytes_sent += (b.plan.buffer_numel - own) * b.param_data.element_size()
                if not self.overlap_param_gather:
                    self.wait_param_gather()

    def reset_gather_bytes(self) -> int:
        """Bytes this rank sent in parameter gathers (plain or quantised) since the last call."""
        sent = self.gather_bytes_sent + (self.quantized_gather.reset_bytes() if self.quantized_gather else 0)
        self.gather_bytes_sent = 0
        return sent

    def gather_report(self) -> dict:
        """The quantised gather's log-step figures (``param_gather/max_ulps``; empty with the plain gather), after
        waiting for the gathers in flight. Collective (DP and world group) with the quantised gather.

        Raises:
            ReplicaMismatchError: the DP replicas' parameters differ
                (:meth:`.param_gather.QuantizedParamGather.report`).
        """
        if self.quantized_gather is None:
            return {}
        self.wait_param_gather()
        return self.quantized_gather.report(self.buckets)

    def wait_param_gather(self, bucket_indices=None) -> None:
        """Finish the in-flight parameter gathers of ``bucket_indices`` (all when None)."""
        for i in list(self._gathers) if bucket_indices is None else bucket_indices:
            w = self._gathers.pop(i, None)
            if w is not None:
                with trace_range("collective"):
                    w.wait()

    def register_forward_hooks(self, model: torch.nn.Module) -> None:
        """Wait for each parameter's gather just before its first use in forward (only with
        ``overlap_param_gather``; idempotent).

        For a model with blocks (``model.layers`` and ``model.register_block_pre_forward``, a megatron_geo Llama):
        one wait per block, for every bucket holding any of the block's parameters, run by the model's forward
        loop outside the block's call, so that none runs inside a block compiled with ``train.compile=true``
        (a ``Work.wait()`` there breaks the graph and a module hook is not guarded, see
        :mod:`megatron_geo.model.compile`). Every other module owning parameters (embedding, final norm, output)
        gets a forward pre-hook waiting for the buckets holding its own parameters. Either way a bucket is
        waited before any of its parameters is read, in eager and in compiled mode alike.
        """
        if not self.overlap_param_gather or self._hooks:
            return
        where = {id(p): b.index for b in self.buckets for p in b.params}
        blocks = getattr(model, "layers", None)
        register_block = getattr(model, "register_block_pre_forward", None)
        in_blocks: set[int] = set()
        if isinstance(blocks, torch.nn.ModuleList) and callable(register_block):
            per_block = [sorted({where[id(p)] for p in block.parameters() if id(p) in where}) for block in blocks]
            in_blocks = {id(m) for block in blocks for m in block.modules()}
            self._hooks.append(register_block(lambda i, _block: self.wait_param_gather(per_block[i])))
        for mod in model.modules():
            if id(mod) in in_blocks:
                continue
            idx = sorted({where[id(p)] for p in mod.parameters(recurse=False) if id(p) in where})
            if idx:
                self._hooks.append(mod.register_forward_pre_hook(lambda _m, _a, idx=idx: self.wait_param_gather(idx)))

    def optimizer_of(self, m: MainParam) -> torch.optim.Optimizer:
        """The torch optimizer that updates ``m.main``."""
        for opt in self.optimizers:
            for g in opt.param_groups:
                if any(p is m.main for p in g["params"]):
                    return opt
        raise KeyError(m.name)
