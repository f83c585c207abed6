"""The shard plan of a config at any DP size, and what it costs per rank, computed without GPUs.

:func:`plan_figures` lays the model's parameters out exactly as the trainer does (:func:`plan_model` with the
trainer's atomic rule, FLOP model, bucket size and the reducer's alignment) and reports, per DP rank:

- buffer elements (the FP32 gradient buffer and the model-dtype parameter buffer have this many; every rank
  holds whole buckets) and ``padding_ratio = buffer_elements_per_rank / parameters``;
- owned elements (main parameters), optimizer state, error-feedback residual, GeoFP8 state, bytes;
- wire bytes per step of the gradient reduction: a rank sends every range of a bucket but its own
  (``S - own``) and receives ``S - own`` on the FP32 reduce path (chain/ring reduce onto each owner) or
  ``(dp - 1) * own`` through an all-to-all (BF16 and the low-precision codecs); ``wire_bytes_per_rank`` is
  the worst rank's larger direction. ``even_reduce_scatter_bytes = (dp - 1) / dp * parameters * b``, the
  ring reduce-scatter of an unpadded, evenly split buffer. Wire elements cost b bytes: FP32 4, BF16 2,
  FP8 1 (+ 4 / block_size with block scaling), NVFP4 0.5625; per-tensor scales (a few bytes per parameter)
  are left out;
- the parameter gather after the step (``S - own`` per bucket, in the parameter dtype);
- optimizer FLOPs per rank (Newton-Schulz ``~4 k^2 K + 2 k^3`` per iteration for Muon matrices, 12 per
  element for AdamW) and ``optimizer_flops_max_over_mean``;
- the codec scratch of the largest bucket (transient, not persistent): the send codes, the receive buffer of
  ``dp x own`` codes and its FP32 decode.

The model is built on the ``meta`` device (shapes only); TP > 1 uses a fake process group for TP rank 0.
"""

from __future__ import annotations

import fnmatch

import torch

from ..config import Config
from .shard_plan import ADAMW_FLOPS_PER_ELEMENT, ParamSpec, newton_schulz_flops, plan_model

WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "nvfp4": 0.5625}


def meta_model_params(cfg: Config, tp_size: int = 1) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(name, local shape, use_muon)`` of every parameter of TP rank 0, in registration order (meta device).

    Needs a TP group for the model's constructor: when ``torch.distributed`` is not initialised, a fake process
    group of ``tp_size`` ranks is created for the call and destroyed afterwards (nothing is left behind).

    Raises:
        RuntimeError: ``tp_size > 1`` while a process group of another size is already initialised.
    """
    import torch.distributed as dist

    from ..model import Llama

    created = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp_size)
        created = True
    try:
        if dist.get_world_size() != tp_size and tp_size > 1:
            raise RuntimeError(f"meta_model_params(tp_size={tp_size}) needs its own process group; call it where "
                               f"torch.distributed is not initialised (a fresh process)")
        group = dist.group.WORLD if dist.get_world_size() == tp_size else dist.new_group([dist.get_rank()])
        dtype = torch.bfloat16 if cfg.train.param_dtype == "bf16" else torch.float32
        model = Llama(cfg.model, group, cfg.train.seed, dtype=dtype, device=torch.device("meta"))
        return [(n, tuple(p.shape), bool(getattr(p, "use_muon", False))) for n, p in model.named_parameters()
                if p.requires_grad]
    finally:
        if created:
            dist.destroy_process_group()


def reducer_alignment(cfg: Config) -> int:
    """The low-precision reducer's range alignment for ``cfg.comm`` (see ``LowPrecisionReducer.alignment``)."""
    c = cfg.comm
    a = 1
    if c.dtype == "nvfp4":
        a = 16
    elif c.scaling == "block" and c.dtype.startswith("fp8"):
        a = c.block_size
    if c.transform == "hadamard":
        a = max(a, c.hadamard_block)
    return a


def geo_candidates(cfg: Config, names_shapes) -> set[str]:
    """Names of the parameters ``geo.layers`` selects (every candidate is owned whole)."""
    if cfg.comm.transform != "geo":
        return set()
    pats = [p.strip() for p in cfg.geo.layers.split(",") if p.strip()]
    return {n for n, shape, _ in names_shapes if len(shape) == 2 and n.endswith(".weight")
            and any(fnmatch.fnmatchcase(n, p) for p in pats)}


def plan_figures(cfg: Config, dp_size: int, params=None, tp_size: int = 1) -> dict:
    """Every figure of the module docstring for ``cfg`` at ``dp_size`` (JSON-ready dict).

    ``params``: the output of :func:`meta_model_params` (built when None).
    """
    params = params if params is not None else meta_model_params(cfg, tp_size)
    muon = cfg.optimizer.name == "muon"
    sharded = cfg.parallel.distributed_optimizer
    geo = geo_candidates(cfg, params)
    back = list(reversed(params))  # backward order, as build_buckets
    specs = []
    for n, shape, use_muon in back:
        numel = 1
        for d in shape:
            numel *= d
        atomic = sharded and muon and use_muon
        flops = newton_schulz_flops(shape) if (muon and use_muon) else ADAMW_FLOPS_PER_ELEMENT * numel
        specs.append(ParamSpec(numel, atomic, flops, shape[1] if sharded and n in geo else 1))
    plans = plan_model(specs, cfg.parallel.bucket_size, dp_size, reducer_alignment(cfg))
    P = sum(s.numel for s in specs)
    buffer = sum(pl.buffer_numel for _, pl in plans)
    wire_b = WIRE_BYTES[cfg.comm.dtype] + (4.0 / cfg.comm.block_size if cfg.comm.scaling == "block"
                                           and cfg.comm.dtype.startswith("fp8") else 0.0)
    all_to_all = not (cfg.comm.dtype == "fp32" and cfg.comm.transform == "none")
    param_b = 2 if cfg.train.param_dtype == "bf16" else 4
    own = [0] * dp_size
    sent = [0.0] * dp_size
    recv = [0.0] * dp_size
    flops = [0.0] * dp_size
    muon_own = [0] * dp_size
    scratch = 0.0
    for idx, pl in plans:
        S = pl.buffer_numel
        sizes = pl.sizes
        for r in range(dp_size):
            own[r] += sizes[r]
            sent[r] += (S - sizes[r]) * wire_b
            recv[r] += ((dp_size - 1) * sizes[r] if all_to_all else S - sizes[r]) * wire_b
            for pc in pl.pieces[r]:
                s = specs[idx[pc.index]]
                flops[r] += s.flops if pc.numel == s.numel else ADAMW_FLOPS_PER_ELEMENT * pc.numel
                if muon and back[idx[pc.index]][2]:
                    muon_own[r] += pc.numel
        if all_to_all:  # send codes + receive dp x own codes + their FP32 decode
            scratch = max(scratch, S * wire_b + max(dp_size * n * (wire_b + 4) for n in sizes))
        else:
            scratch = max(scratch, 0 if not pl.even else S / dp_size * 4)
    if not sharded:  # every rank owns (and updates) everything; the reduction is an all-reduce
        own = [P] * dp_size
        muon_own = [sum(s.numel for s, (_, _, um) in zip(specs, back) if muon and um)] * dp_size
        flops = [sum(s.flops for s in specs)] * dp_size
    ef = buffer * 4 if cfg.comm.error_feedback else 0
    geo_bytes = 0
    for n, shape, _ in params:
        if n in geo:
            d_in = shape[1]
            sketched = cfg.geo.statistics == "sketch" or (cfg.geo.statistics == "auto" and d_in > 4 * cfg.geo.sketch_size)
            k = min(cfg.geo.sketch_size, d_in) if sketched else d_in
            r = min(cfg.geo.rank, k, d_in)
            geo_bytes += 4 * (d_in * r + r)                                  # transform U, d
            geo_bytes += 4 * (d_in * k) + (4 * d_in * k if sketched else 0)  # statistics (+ the sketch matrix)

    def rank_bytes(r: int) -> dict:
        adam_own = own[r] - muon_own[r]
        opt_state = 4 * (2 * adam_own + muon_own[r])
        parts = {"grad_buffer": buffer * 4, "param_buffer": buffer * param_b, "main_params": own[r] * 4,
                 "optimizer_state": opt_state, "error_feedback": ef, "geo_state": geo_bytes}
        return {"elements_owned": own[r], "bytes": parts, "persistent_bytes": sum(parts.values()),
                "reduce_sent_bytes": sent[r], "reduce_received_bytes": recv[r],
                "gather_sent_bytes": (buffer - own[r]) * param_b if sharded else 0, "optimizer_flops": flops[r]}

    worst = max(range(dp_size), key=lambda r: (max(sent[r], recv[r]), own[r]))
    most_mem = max(range(dp_size), key=lambda r: (rank_bytes(r)["persistent_bytes"], -r))
    mean_flops = sum(flops) / dp_size
    even_rs = (dp_size - 1) / dp_size * P * wire_b
    out = {
        "config": {"model_hidden": cfg.model.hidden_size, "layers": cfg.model.num_layers,
                   "optimizer": cfg.optimizer.name, "comm.dtype": cfg.comm.dtype, "comm.transform": cfg.comm.transform,
                   "bucket_size": cfg.parallel.bucket_size, "distributed_optimizer": sharded},
        "dp": dp_size, "tp": tp_size,
        "parameters": P,
        "buckets": len(plans),
        "uneven_buckets": sum(1 for _, pl in plans if not pl.even),
        "buffer_elements_per_rank": buffer,
        "padding_ratio": buffer / max(P, 1),
        "wire_bytes_per_element": wire_b,
        "wire_bytes_per_rank": max(max(sent[r], recv[r]) for r in range(dp_size)),
        "even_reduce_scatter_bytes": even_rs,
        "gather_bytes_per_rank": max((buffer - own[r]) * param_b for r in range(dp_size)) if sharded else 0,
        "even_all_gather_bytes": (dp_size - 1) / dp_size * P * param_b if sharded else 0,
        "optimizer_flops_max": max(flops),
        "optimizer_flops_mean": mean_flops,
        "optimizer_flops_max_over_mean": max(flops) / mean_flops if mean_flops else 1.0,
        "elements_owned_max_over_mean": max(own) / (sum(own) / dp_size) if sum(own) else 1.0,
        "persistent_bytes_per_rank": max(rank_bytes(r)["persistent_bytes"] for r in range(dp_size)),
        "codec_scratch_bytes": scratch,
        "rank0": rank_bytes(0),
        "worst_rank": {"rank": worst, **rank_bytes(worst)},      # the most wire bytes
        "most_memory_rank": {"rank": most_mem, **rank_bytes(most_mem)},
    }
    return out
