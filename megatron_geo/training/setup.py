"""The run's wiring, built once before the loop: the model on its device, the GeoFP8 state (:mod:`.geo_setup`), the
bucketed gradient buffers (laid out by the ownership rule of :mod:`megatron_geo.distributed.ownership`), the
reducer, the gradient sync and the distributed optimizer. The datasets are built in :mod:`.data_setup`."""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

from ..comm.factory import build_reducer
from ..comm.param_codec import param_gather_alignment
from ..config import Config
from ..distributed import Bucket, DistributedOptimizer, GradSync, build_buckets, register_buckets
from ..distributed.early_muon import EarlyMuonUpdates
from ..distributed.ownership import param_infos, param_specs
from ..model import Llama, param_dtype
from ..parallel import ParallelContext
from .geo_setup import attach_geo, build_geo


def build_grad_buckets(
    cfg: Config, model: torch.nn.Module, dp_size: int, alignment: int, geo_layers: Collection[str] = ()
) -> list[Bucket]:
    """``model``'s parameters in buckets of ``parallel.bucket_size`` elements over ``dp_size`` DP ranks, laid out by
    :func:`~megatron_geo.distributed.ownership.param_specs` (atomic Muon matrices, whole GeoFP8 rows, FLOP
    balance) with every range a multiple of ``alignment`` elements; ``param.data`` and ``param.main_grad``
    become views into the buckets' buffers. No collective: the layout depends on shapes only."""
    infos = param_infos(model)
    spec = dict(zip((n for n, _, _ in infos), param_specs(cfg, infos, alignment, geo_layers)))
    of = {id(p): spec[n] for n, p in model.named_parameters() if p.requires_grad}
    return build_buckets(
        list(model.named_parameters()),
        cfg.parallel.bucket_size,
        dp_size,
        atomic_fn=lambda p: of[id(p)].atomic,
        align=alignment,
        flops_fn=lambda p: of[id(p)].flops,
        granule_fn=lambda p: of[id(p)].granule,
        spec_fn=lambda p: of[id(p)],
    )


def build_model_and_optimizer(cfg: Config, pctx: ParallelContext):
    """Model on ``pctx.device``, its bucketed gradient path, reducer and distributed optimizer.

    Returns:
        ``(model, buckets, reducer, grad_sync, optimizer)``; the GeoFP8 state, if any, is ``reducer.geo``.

    Raises:
        ConfigError: a ``geo.layers`` pattern matches no linear weight.
    """
    model = Llama(cfg.model, pctx.tp_group, cfg.train.seed, dtype=param_dtype(cfg.train), device=pctx.device)
    geo = build_geo(cfg, model, pctx) if cfg.comm.transform == "geo" else None
    reducer = build_reducer(cfg.comm, pctx, seed=cfg.train.seed, device=pctx.device)
    sharded = cfg.parallel.distributed_optimizer
    # the reducer's blocks and the quantised parameter gather's (comm.param_gather) never straddle two parameters
    align = math.lcm(reducer.alignment(), param_gather_alignment(cfg.comm))
    buckets = build_grad_buckets(cfg, model, pctx.dp_size, align, set(geo.params) if geo else ())
    register_buckets(reducer, buckets, pctx.device)  # each bucket's reducer state: bucket.reduction
    if geo is not None:
        attach_geo(reducer, geo, buckets)
    grad_sync = GradSync(buckets, reducer, sharded=sharded, overlap=cfg.parallel.overlap_grad_reduce)
    overlap_setting = cfg.parallel.overlap_param_gather
    overlap = pctx.device.type == "cuda" if overlap_setting == "auto" else overlap_setting == "true"
    optimizer = DistributedOptimizer(
        buckets, cfg.optimizer, pctx, sharded=sharded, overlap_param_gather=overlap, param_gather=cfg.comm.param_gather
    )
    optimizer.register_forward_hooks(model)
    if cfg.optimizer.name == "muon" and cfg.optimizer.muon_overlap:
        early = EarlyMuonUpdates(optimizer)
        grad_sync.early_updates = early if early.active else None
    return model, buckets, reducer, grad_sync, optimizer


def compile_model(cfg: Config, model: torch.nn.Module, pctx: ParallelContext) -> None:
    """``train.compile``: compile the transformer blocks in place (inductor on CUDA, eager elsewhere)."""
    if cfg.train.compile:
        from ..model.compile import compile_blocks

        compile_blocks(model, backend="inductor" if pctx.device.type == "cuda" else "eager")


def startup_text(cfg: Config, pctx: ParallelContext, buckets: list[Bucket], optimizer, n_params: int) -> str:
    """What rank 0 prints about the run before the first step (lines): parameters, the parallel layout and
    buckets, and a note when DP = 1 makes the comm mode irrelevant."""
    pad = sum(b.plan.padding([p.numel() for p in b.params]) for b in buckets)
    uneven = sum(1 for b in buckets if not b.plan.even)
    lines = [
        f"parameters: {n_params:,}",
        f"parallel: world={pctx.world_size} TP={pctx.tp_size} DP={pctx.dp_size} backend={pctx.backend} "
        f"device={pctx.device} | {len(buckets)} buckets ({uneven} with uneven owner ranges), shard padding {pad} "
        f"elements | comm={cfg.comm.label} (comm.dtype={cfg.comm.dtype}) "
        f"distributed_optimizer={cfg.parallel.distributed_optimizer} "
        f"overlap_param_gather={optimizer.overlap_param_gather}"
        + (
            f" param_gather={cfg.comm.param_gather} (quantised difference)"
            if getattr(optimizer, "quantized_gather", None) is not None
            else ""
        ),
    ]
    if pctx.dp_size == 1 and (cfg.comm.dtype != "fp32" or cfg.comm.transform != "none"):
        lines.append(
            f"note: DP=1: no gradient is sent between data-parallel ranks, so comm={cfg.comm.label} "
            f"(comm.dtype={cfg.comm.dtype}, comm.transform={cfg.comm.transform}) changes nothing in this "
            f"run; launch several data-parallel ranks to compare communication modes"
        )
    return "\n".join(lines)
