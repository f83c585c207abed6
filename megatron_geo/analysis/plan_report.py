"""The shard plan of a config at any DP size, and what it costs per rank, computed without GPUs.

:func:`plan_layout` lays the model's parameters out exactly as the trainer does: the ownership rule of
:func:`megatron_geo.distributed.ownership.param_specs` (the one the trainer's buckets use), the GeoFP8 layers of
:func:`megatron_geo.geometry.select_parameters`, the bucket size and the reducer's alignment
(:func:`megatron_geo.comm.formats.comm_alignment`). :func:`plan_figures` reports, per DP rank:

- buffer elements (the FP32 gradient buffer and the model-dtype parameter buffer have this many; every rank
  holds whole buckets) and ``padding_ratio = buffer_elements_per_rank / parameters``;
- owned elements (main parameters), optimizer state, error-feedback residual, GeoFP8 state, bytes;
- wire bytes per step of the gradient reduction: a rank sends every range of a bucket but its own
  (``S - own``) and receives ``S - own`` on the FP32 reduce path (chain/ring reduce onto each owner) or
  ``(dp - 1) * own`` through an all-to-all (BF16 and the low-precision codecs); ``wire_bytes_per_rank`` is
  the worst rank's larger direction. ``even_reduce_scatter_bytes = (dp - 1) / dp * parameters * b``, the
  ring reduce-scatter of an unpadded, evenly split buffer. Wire elements cost b bytes, the format's
  :attr:`~megatron_geo.comm.formats.WireFormat.bytes_per_element` (FP32 4, BF16 2, FP8 1 (+ 4 / block_size
  with block scaling), NVFP4 0.5625; per-tensor scales, a few bytes per parameter, are left out);
- the parameter gather after the step (``S - own`` elements per bucket, in the parameter dtype, or with
  ``comm.param_gather=fp8`` / ``nvfp4`` the quantised difference: 1.031 / 0.594 bytes per element, scales included,
  :mod:`megatron_geo.comm.param_codec`); ``dp_bytes_per_rank``: the worst rank's reduce bytes (the larger direction)
  plus its gather bytes per step, and ``dp_bytes_vs_bf16`` that over the same figure with BF16 gradients and BF16
  parameters gathered as they are (``bf16_dp_bytes_per_rank``);
- optimizer FLOPs per rank (Newton-Schulz ``~4 k^2 K + 2 k^3`` per iteration for Muon matrices, or the Gram
  form's count with ``optimizer.muon_ns=gram``; 12 per element for AdamW) and ``optimizer_flops_max_over_mean``;
  a member of a Muon matrix split over a group of DP ranks (:mod:`megatron_geo.distributed.split_plan`) counts its
  share of the ``k^2 K`` products plus the whole replicated ``[k, k]`` polynomial;
- ``muon_split``: the split matrices (how many, the group size, FLOPs per member) and the group traffic per rank
  per step: the Gram all-reduces (ring: ``2 (g - 1) / g`` of ``k^2`` elements each, the first in FP32, the others
  in the Newton-Schulz dtype: BF16 unless ``optimizer.muon_ns_dtype=fp32``, as on GPUs) and, for wide matrices,
  the two block exchanges (the rows of the other members' columns, FP32 there and the Newton-Schulz dtype back);
- ``muon_split_auto`` (``optimizer.muon_split=auto`` only, where a Muon matrix costs more than the mean share;
  else None): what the rule weighed (:func:`megatron_geo.distributed.split_plan.auto_split`): the estimated
  optimizer time per step of the whole-matrix plan and of the fastest split plan (slowest rank, its compute and
  group-collective seconds, bytes and collectives, busiest rank's FLOPs), the compute the split saves against
  the collective time it adds, the choice, and the assumed machine
  (:data:`~megatron_geo.distributed.split_plan.SPLIT_COST`: FLOP/s, link bytes/s, seconds per collective);
- the codec scratch of the largest bucket (transient, not persistent): the send codes, the receive buffer of
  ``dp x own`` codes and its FP32 decode; ``param_gather_scratch_bytes``: the quantised parameter gather's records of
  every bucket (transient: from the update to the bucket's first use in the next forward; its FP32 decode, one
  bucket at a time, comes on top).

The model is built on the ``meta`` device (shapes only); TP > 1 uses a fake process group for TP rank 0.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field

import torch

from ..comm.formats import comm_alignment, get_format
from ..comm.param_codec import gather_bytes_per_element, gather_codec, param_gather_alignment
from ..config import Config, ConfigError
from ..distributed.ownership import ParamInfo, param_infos, param_specs
from ..distributed.plan_types import ADAMW_FLOPS_PER_ELEMENT, ShardPlan
from ..distributed.shard_plan import muon_split_decision, plan_model
from ..distributed.split_plan import member_group_traffic, split_member_flops
from ..model.llama import param_dtype
from ..optim.muon import newton_schulz_dtype


@dataclass(frozen=True)
class ModelParams:
    """What the plan needs of a model: ``infos`` (``(name, local shape, use_muon)`` of every parameter that needs
    a gradient, registration order) and ``geo_layers`` (the GeoFP8 layers ``geo.layers`` selects; empty unless
    ``comm.transform=geo``)."""

    infos: list[ParamInfo]
    geo_layers: frozenset[str] = field(default_factory=frozenset)


def resolve_tensor_parallel(cfg: Config, tp: int | None, overrides: list[str]) -> int:
    """The tensor-parallel size a tool (``tools/plan_report.py``, ``tools/dry_run.py``) plans for, written into
    ``cfg.parallel.tensor``: its ``--tp`` when given, else ``parallel.tensor`` of the config files and overrides.

    Args:
        tp: the tool's ``--tp`` (None: not given).
        overrides: the ``key=value`` overrides ``cfg`` was loaded with (a ``parallel.tensor=`` among them and a
            ``--tp`` of another value contradict each other).

    Raises:
        ConfigError: ``--tp`` and a ``parallel.tensor=`` override that differ, or a size below 1.
    """
    named = any(o.strip().startswith("parallel.tensor=") for o in overrides)
    if tp is not None and named and cfg.parallel.tensor != tp:
        raise ConfigError(f"--tp {tp} and parallel.tensor={cfg.parallel.tensor} disagree; give one of them")
    size = cfg.parallel.tensor if tp is None else tp
    if size < 1:
        what = f"--tp {size}" if tp is not None else f"parallel.tensor={size}"
        raise ConfigError(f"{what}: the tensor-parallel size must be >= 1")
    cfg.parallel.tensor = size
    return size


def meta_model_params(cfg: Config, tp_size: int = 1) -> ModelParams:
    """The parameters of TP rank 0 (meta device) and its GeoFP8 layers.

    Needs a TP group for the model's constructor: when ``torch.distributed`` is not initialised, a fake process
    group of ``tp_size`` ranks is created for the call and destroyed afterwards (nothing is left behind).

    Raises:
        RuntimeError: ``tp_size > 1`` while a process group of another size is already initialised.
        ConfigError: a ``geo.layers`` pattern matches no linear weight.
    """
    import torch.distributed as dist

    from ..geometry import select_parameters
    from ..model import Llama

    created = False
    if not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp_size)
        created = True
    try:
        if dist.get_world_size() != tp_size and tp_size > 1:
            raise RuntimeError(
                f"meta_model_params(tp_size={tp_size}) needs its own process group; call it where "
                f"torch.distributed is not initialised (a fresh process)"
            )
        group = dist.group.WORLD if dist.get_world_size() == tp_size else dist.new_group([dist.get_rank()])
        model = Llama(cfg.model, group, cfg.train.seed, dtype=param_dtype(cfg.train), device=torch.device("meta"))
        try:
            geo = frozenset(select_parameters(model, cfg.geo.layers)) if cfg.comm.transform == "geo" else frozenset()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return ModelParams(param_infos(model), geo)
    finally:
        if created:
            dist.destroy_process_group()


def plan_alignment(cfg: Config) -> int:
    """Elements every parameter start and rank range is a multiple of, as the trainer plans them: the reducer's
    alignment and the quantised parameter gather's (``comm.param_gather``)."""
    return math.lcm(comm_alignment(cfg.comm), param_gather_alignment(cfg.comm))


def _planned(cfg: Config, dp_size: int, params: ModelParams):
    back = list(reversed(params.infos))  # backward order, as build_buckets
    align = plan_alignment(cfg)
    specs = param_specs(cfg, back, align, params.geo_layers)
    return back, specs, plan_model(specs, cfg.parallel.bucket_size, dp_size, align)


def plan_layout(cfg: Config, dp_size: int, params: ModelParams) -> list[tuple[list[str], ShardPlan]]:
    """The buckets the trainer builds for ``cfg`` at ``dp_size``: ``[(parameter names, plan), ...]`` in launch
    order (``plan.offsets`` follow the names; ``plan.bounds`` are the DP ranks' ranges, elements)."""
    back, _, plans = _planned(cfg, dp_size, params)
    return [([back[i][0] for i in idx], pl) for idx, pl in plans]


def plan_figures(cfg: Config, dp_size: int, params=None, tp_size: int = 1, bf16_reference: bool = True) -> dict:
    """Every figure of the module docstring for ``cfg`` at ``dp_size`` (JSON-ready dict).

    ``params``: the output of :func:`meta_model_params` (built when None). ``bf16_reference``: also plan the same
    model with BF16 both ways (:func:`bf16_both_ways`) for ``bf16_dp_bytes_per_rank`` and ``dp_bytes_vs_bf16``.

    Raises:
        ConfigError: as :func:`meta_model_params` (when ``params`` is None).
    """
    params = params if params is not None else meta_model_params(cfg, tp_size)
    muon = cfg.optimizer.name == "muon"
    sharded = cfg.parallel.distributed_optimizer
    geo = params.geo_layers
    back, specs, plans = _planned(cfg, dp_size, params)
    P = sum(s.numel for s in specs)
    buffer = sum(pl.buffer_numel for _, pl in plans)
    wire_b = get_format(cfg.comm.dtype).bytes_per_element(cfg.comm)
    all_to_all = not (cfg.comm.dtype == "fp32" and cfg.comm.transform == "none")
    param_b = param_dtype(cfg.train).itemsize
    gather_b = gather_bytes_per_element(cfg.comm, param_dtype(cfg.train))  # what a gathered element costs on the wire
    own = [0] * dp_size
    sent = [0.0] * dp_size
    recv = [0.0] * dp_size
    flops = [0.0] * dp_size
    muon_own = [0] * dp_size
    scratch = 0.0
    ns = cfg.optimizer.muon_ns
    ns_b = newton_schulz_dtype(cfg.optimizer, "cuda").itemsize  # the figures are for GPUs
    group_bytes = [0.0] * dp_size  # Gram all-reduces + block exchanges of split matrices, sent per step
    n_split, sizes_split, member_fl = 0, set(), []
    for _, pl in plans:
        for sp in pl.splits.values():
            n_split += 1
            sizes_split.add(sp.size)
            for mem in range(sp.size):
                member_fl.append(split_member_flops(sp, mem, ns))
                group_bytes[sp.first + mem] += member_group_traffic(sp, mem, ns, ns_b)[0]
    for idx, pl in plans:
        S = pl.buffer_numel
        sizes = pl.sizes
        for r in range(dp_size):
            own[r] += sizes[r]
            sent[r] += (S - sizes[r]) * wire_b
            recv[r] += ((dp_size - 1) * sizes[r] if all_to_all else S - sizes[r]) * wire_b
            if not sharded:  # the all-reduce's second half: the averaged ranges gathered in the wire format
                sent[r] += (S - sizes[r]) * wire_b
                recv[r] += (S - sizes[r]) * wire_b
            for pc in pl.pieces[r]:
                s = specs[idx[pc.index]]
                if pc.index in pl.splits:
                    sp = pl.splits[pc.index]
                    flops[r] += split_member_flops(sp, sp.member(r), ns)
                else:
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
    # the quantised gather's records (every rank's, of every bucket: all in flight with the overlapped gather)
    quantised = sharded and dp_size > 1 and gather_codec(cfg.comm.param_gather) is not None
    geo_bytes = 0
    for n, shape, _ in params.infos:
        if n in geo:
            d_in = shape[1]
            sketched = cfg.geo.statistics == "sketch" or (
                cfg.geo.statistics == "auto" and d_in > 4 * cfg.geo.sketch_size
            )
            k = min(cfg.geo.sketch_size, d_in) if sketched else d_in
            r = min(cfg.geo.rank, k, d_in)
            geo_bytes += 4 * (d_in * r + r)  # transform U, d
            geo_bytes += 4 * (d_in * k) + (4 * d_in * k if sketched else 0)  # statistics (+ the sketch matrix)

    from ..comm.codec_tables import codec_table_bytes

    tables = codec_table_bytes(
        cfg.comm, [(pl.offsets, [specs[i].numel for i in idx], pl.bounds) for idx, pl in plans], dp_size
    )

    def rank_bytes(r: int) -> dict:
        adam_own = own[r] - muon_own[r]
        opt_state = 4 * (2 * adam_own + muon_own[r])
        parts = {
            "grad_buffer": buffer * 4,
            "param_buffer": buffer * param_b,
            "main_params": own[r] * 4,
            "optimizer_state": opt_state,
            "error_feedback": ef,
            "geo_state": geo_bytes,
        }
        return {
            "elements_owned": own[r],
            "bytes": parts,
            "persistent_bytes": sum(parts.values()),
            "codec_table_bytes": tables,  # the reducer's scale-layout tables (same on every rank)
            "reduce_sent_bytes": sent[r],
            "reduce_received_bytes": recv[r],
            "gather_sent_bytes": (buffer - own[r]) * gather_b if sharded else 0,
            "optimizer_flops": flops[r],
        }

    worst = max(range(dp_size), key=lambda r: (max(sent[r], recv[r]), own[r]))
    most_mem = max(range(dp_size), key=lambda r: (rank_bytes(r)["persistent_bytes"], -r))
    mean_flops = sum(flops) / dp_size
    even_rs = (dp_size - 1) / dp_size * P * wire_b
    out = {
        "config": {
            "model_hidden": cfg.model.hidden_size,
            "layers": cfg.model.num_layers,
            "optimizer": cfg.optimizer.name,
            "comm.dtype": cfg.comm.dtype,
            "comm.transform": cfg.comm.transform,
            "comm.param_gather": cfg.comm.param_gather,
            "param_dtype": cfg.train.param_dtype,
            "bucket_size": cfg.parallel.bucket_size,
            "distributed_optimizer": sharded,
        },
        "dp": dp_size,
        "tp": tp_size,
        "parameters": P,
        "buckets": len(plans),
        "uneven_buckets": sum(1 for _, pl in plans if not pl.even),
        "alignment": plan_alignment(cfg),
        "buffer_elements_per_rank": buffer,
        "padding_ratio": buffer / max(P, 1),
        "wire_bytes_per_element": wire_b,
        "wire_bytes_per_rank": max(max(sent[r], recv[r]) for r in range(dp_size)),
        "even_reduce_scatter_bytes": even_rs,
        "gather_bytes_per_element": gather_b,
        "gather_bytes_per_rank": max((buffer - own[r]) * gather_b for r in range(dp_size)) if sharded else 0,
        "even_all_gather_bytes": (dp_size - 1) / dp_size * P * gather_b if sharded else 0,
        # both directions: the worst rank's reduce (larger of sent / received) plus its gather, per step
        "dp_bytes_per_rank": max(
            max(sent[r], recv[r]) + (buffer - own[r]) * gather_b * sharded for r in range(dp_size)
        ),
        "optimizer_flops_max": max(flops),
        "optimizer_flops_mean": mean_flops,
        "optimizer_flops_max_over_mean": max(flops) / mean_flops if mean_flops else 1.0,
        "elements_owned_max_over_mean": max(own) / (sum(own) / dp_size) if sum(own) else 1.0,
        "persistent_bytes_per_rank": max(rank_bytes(r)["persistent_bytes"] for r in range(dp_size)),
        "codec_scratch_bytes": scratch,
        "param_gather_scratch_bytes": buffer * gather_b if quantised else 0,
        "muon_split_auto": _auto_split_figures(cfg, specs, dp_size) if muon and sharded else None,
        "muon_split": {
            "matrices": n_split,
            "group_size": max(sizes_split, default=1),
            "member_flops_max": max(member_fl, default=0.0),
            "member_flops_min": min(member_fl, default=0.0),
            "group_bytes_per_rank": max(group_bytes),
        },
        "rank0": rank_bytes(0),
        "worst_rank": {"rank": worst, **rank_bytes(worst)},  # the most wire bytes
        "most_memory_rank": {"rank": most_mem, **rank_bytes(most_mem)},
    }
    if bf16_reference:
        ref = plan_figures(bf16_both_ways(cfg), dp_size, params, tp_size, bf16_reference=False)
        out["bf16_dp_bytes_per_rank"] = ref["dp_bytes_per_rank"]
        out["dp_bytes_vs_bf16"] = out["dp_bytes_per_rank"] / max(ref["dp_bytes_per_rank"], 1)
    return out


def _auto_split_figures(cfg: Config, specs, dp_size: int) -> dict | None:
    """``muon_split_auto`` of :func:`plan_figures` (JSON-ready; None where ``auto`` weighs nothing)."""
    d = muon_split_decision(specs, cfg.parallel.bucket_size, dp_size, plan_alignment(cfg))
    if d is None:
        return None
    return {
        "chosen": "split" if d.chosen_split else "whole",
        "compute_saved_s": d.saved_s,
        "collectives_added_s": d.added_s,
        "whole": asdict(d.whole),
        "split": None if d.split is None else asdict(d.split),
        "assumed": asdict(d.cost),
    }


def bf16_both_ways(cfg: Config) -> Config:
    """A copy of ``cfg`` whose DP traffic is BF16 both ways: BF16 gradients (``comm.dtype=bf16``, no transform)
    and BF16 parameters gathered as they are (``train.param_dtype=bf16``, ``comm.param_gather=auto``): the
    reference of ``dp_bytes_vs_bf16``."""
    ref = copy.deepcopy(cfg)
    ref.comm = type(cfg.comm)(dtype="bf16")
    ref.train.param_dtype = "bf16"
    return ref
