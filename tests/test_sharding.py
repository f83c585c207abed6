"""Whole-parameter sharding without padding: plan invariants, balance at the users' shape, exact averages of
every reducer over uneven owner ranges against an FP64 reference (DP 2, 3, 4), training equivalence at DP = 3,
checkpoints made before the change, and the DP = 64 dry run on the fake process group."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_helpers import assemble, local_state
from dist_harness import run_distributed
from helpers import global_batch, load_tool, pctx_for, rank_micro_batches, tiny_cfg
from megatron_geo.distributed.shard_plan import ParamSpec, newton_schulz_flops, plan_model

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "ckpt_before_uneven"


# -- the plan ---------------------------------------------------------------------------------------------------------


def test_plan_model_covers_each_element_once_and_keeps_atomic_parameters_whole():
    for trial in range(300):
        rnd = random.Random(trial)
        k, dp, align = rnd.randint(1, 14), rnd.randint(1, 6), rnd.choice([1, 4, 16])
        specs = []
        for _ in range(k):
            n = rnd.choice([0, 1, 3, 7, 64, 100, 1000, 4096])
            atomic = rnd.random() < 0.4
            granule = rnd.choice([1, 1, 8, 10, 64]) if not atomic and rnd.random() < 0.4 and n else 1
            specs.append(ParamSpec(n, atomic, float(n**1.5 if atomic else 12 * n), granule))
        buckets = plan_model(specs, rnd.choice([1, 50, 500, 5000]), dp, align)
        owned = [0] * k
        assert sorted(i for idx, _ in buckets for i in idx) == list(range(k))
        for idx, plan in buckets:
            b = plan.bounds
            assert len(b) == dp + 1 and b[0] == 0 and all(x <= y for x, y in zip(b, b[1:]))
            assert all(n % align == 0 for n in plan.sizes), (trial, plan.sizes)
            # every parameter starts aligned (no codec block spans two parameters): at most align per parameter
            assert plan.padding([specs[i].numel for i in idx]) < (dp + 1 + 2 * len(idx)) * align
            assert all(off % align == 0 for off in plan.offsets), (trial, plan.offsets)
            cover = [0] * plan.buffer_numel
            for r, pieces in enumerate(plan.pieces):
                for pc in pieces:
                    assert b[r] <= pc.buffer_start and pc.buffer_start + pc.numel <= b[r + 1]
                    assert pc.buffer_start == plan.offsets[pc.index] + pc.param_start  # contiguous parameter
                    s = specs[idx[pc.index]]
                    if s.atomic and dp > 1:
                        assert (pc.param_start, pc.param_end) == (0, s.numel)
                    if s.granule > 1 and dp > 1:  # cut only between granules (GeoFP8 rows)
                        assert pc.param_start % s.granule == 0 and (
                            pc.param_end % s.granule == 0 or pc.param_end == s.numel
                        ), (trial, pc)
                    for j in range(pc.buffer_start, pc.buffer_start + pc.numel):
                        cover[j] += 1
                    owned[idx[pc.index]] += pc.numel
            assert max(cover, default=0) <= 1
        assert owned == [s.numel for s in specs]


def test_uneven_plan_balances_flops_and_bytes_where_padding_would_not():
    # 8 "MLP" matrices of 6 units and 8 "attention" matrices of 2 units, plus a big splittable embedding, DP = 8
    specs = (
        [ParamSpec(600, True, newton_schulz_flops((20, 30))) for _ in range(8)]
        + [ParamSpec(200, True, newton_schulz_flops((10, 20))) for _ in range(8)]
        + [ParamSpec(4000, False, 12 * 4000)]
    )
    buckets = plan_model(specs, 1000, 8, 1)
    total = sum(s.numel for s in specs)
    assert sum(p.buffer_numel for _, p in buckets) == total  # no padding at all
    own = [sum(p.sizes[r] for _, p in buckets) for r in range(8)]
    assert max(own) - min(own) <= 1  # bytes balanced to the element
    flops = [0.0] * 8
    for idx, p in buckets:
        for r, pieces in enumerate(p.pieces):
            for pc in pieces:
                s = specs[idx[pc.index]]
                flops[r] += s.flops if s.atomic else 12 * pc.numel
    assert max(flops) / (sum(flops) / 8) < 1.1


# -- the plan at the users' shape ------------------------------------------------------------------------------------


def _plan_json(tmp_path, *args) -> list[dict]:
    out = tmp_path / "plan.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/plan_report.py"), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    figs = json.loads(out.read_text())
    return figs if isinstance(figs, list) else [figs]


@pytest.mark.parametrize(
    "configs",
    [
        ["configs/llama_600m.yaml"],
        ["configs/llama_600m.yaml", "configs/comm/geofp8.yaml", "optimizer.name=adamw"],
        ["configs/llama_300m.yaml"],
    ],
    ids=["600m-muon", "600m-adamw-geofp8", "300m-muon"],
)
def test_plan_report_meets_the_targets_at_the_users_shape(tmp_path, configs):
    args = []
    for c in configs:
        args += ["--config", str(ROOT / c)] if c.endswith(".yaml") else [c]
    figs = _plan_json(tmp_path, *args, "--dp", "8", "16", "64", "128")
    for f in figs:
        for key in (
            "parameters",
            "buffer_elements_per_rank",
            "padding_ratio",
            "wire_bytes_per_rank",
            "even_reduce_scatter_bytes",
            "optimizer_flops_max_over_mean",
            "persistent_bytes_per_rank",
        ):
            assert key in f, key
        assert f["buffer_elements_per_rank"] >= f["parameters"]
        assert f["padding_ratio"] <= 1.05, f
        assert f["wire_bytes_per_rank"] <= 1.05 * f["even_reduce_scatter_bytes"], f
        if f["dp"] <= 64 or f["config"]["optimizer"] != "muon":
            assert f["optimizer_flops_max_over_mean"] <= 1.25, f
            assert f["muon_split"]["matrices"] == 0, f  # whole-matrix ownership balances: nothing is split
        else:  # an MLP matrix costs more than the mean share, but splitting the MLP matrices over pairs of ranks
            # saves less compute than the pairs' collectives cost (docs/sharding.md): whole matrices
            auto = f["muon_split_auto"]
            assert auto["chosen"] == "whole" and auto["compute_saved_s"] < auto["collectives_added_s"], auto
            assert auto["split"]["group_size"] == 2 and auto["split"]["matrices"] == 3 * f["config"]["layers"]
            mlp = (1536, 4096) if "600m" in configs[0] else (1024, 2816)
            assert f["optimizer_flops_max"] == newton_schulz_flops(mlp), f  # the busiest rank owns one MLP matrix
            assert f["muon_split"]["matrices"] == 0, f
            assert "Muon split auto: whole matrices: over groups of 2" in load_tool("plan_report").report_text(f)
    by_dp = {f["dp"]: f for f in figs}
    assert by_dp[64]["uneven_buckets"] == by_dp[64]["buckets"]
    # the even plan of the same model pads to the largest matrix: the figure this change removes
    assert by_dp[64]["parameters"] == by_dp[8]["parameters"]


# -- reductions over uneven ranges against FP64 ---------------------------------------------------------------------

SHAPES = [(48, 32), (16, 64), (33,), (96, 16), (7,), (64, 48), (128,)]  # 1-D and odd sizes on purpose
MODES = {
    "fp32": {},
    "bf16": {},
    "fp8_e4m3": {},
    "fp8_block": {"scaling": "block", "block_size": 16},
    "nvfp4": {},
    "fp8_hadamard": {"transform": "hadamard", "hadamard_block": 16},
}


def _rank_grads(world: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    # ranks differ by 1000x (invariant 7 of docs/design.md section 3)
    return [
        [torch.randn(s, generator=g, dtype=torch.float64) * 1000.0 ** (r % 2) for s in SHAPES] for r in range(world)
    ]


def _uneven_reduce(rank, world):
    from megatron_geo.comm import build_reducer
    from megatron_geo.comm.lowp import LowPrecisionReducer
    from megatron_geo.config.schema import CommConfig

    pctx = pctx_for(1)
    numels = [int(torch.tensor(s).prod()) for s in SHAPES]
    out = {}
    for mode, kw in MODES.items():
        dtype = "fp8_e4m3" if mode.startswith("fp8") else mode
        red = (
            build_reducer(dtype, pctx)
            if not kw
            else LowPrecisionReducer(CommConfig(dtype=dtype, **kw), pctx.dp_group, world, rank)
        )
        specs = [ParamSpec(n, True, float(n)) for n in numels]
        plan = _one_bucket(specs, world, red.alignment())
        bucket = red.register_bucket(0, plan.offsets, numels, plan.bounds, "cpu")
        buf = torch.zeros(plan.buffer_numel)
        for i, off in enumerate(plan.offsets):
            buf[off : off + numels[i]] = _rank_grads(world)[rank][i].reshape(-1).float()
        red.reduce_scatter(buf, bucket).wait()
        lo, hi = plan.bounds[rank], plan.bounds[rank + 1]
        out[mode] = {"plan": (plan.bounds, plan.offsets), "own": buf[lo:hi].clone(), "bytes": red.bytes_sent}
    return out


def _one_bucket(specs, world, align):
    """All parameters in one bucket, each owned whole (uneven ranges, each padded to ``align``)."""
    from megatron_geo.distributed.shard_plan import _atomic_bucket, assign_owners

    return _atomic_bucket(list(range(len(specs))), specs, assign_owners(specs, world), world, align)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_reducer_averages_uneven_ranges_like_fp64(world):
    grads = _rank_grads(world)
    ref = [torch.stack([grads[r][i] for r in range(world)]).mean(0).reshape(-1) for i in range(len(SHAPES))]
    absmean = [torch.stack([grads[r][i].abs() for r in range(world)]).mean(0).reshape(-1) for i in range(len(SHAPES))]
    amax = [sum(grads[r][i].abs().max() for r in range(world)) / world for i in range(len(SHAPES))]
    outs = run_distributed(_uneven_reduce, world)
    # relative precision of each wire format (half an ulp of the mantissa), plus the underflow floor
    rel = {"fp32": 1e-6, "bf16": 2.0**-8, "fp8_e4m3": 2.0**-4, "fp8_block": 2.0**-4, "nvfp4": 0.0, "fp8_hadamard": None}
    for mode in MODES:
        bounds, offsets = outs[0][mode]["plan"]
        assert sizes_uneven(bounds)
        for rank in range(world):
            own = outs[rank][mode]["own"].double()
            lo = bounds[rank]
            for i, off in enumerate(offsets):
                n = ref[i].numel()
                if not (lo <= off and off + n <= bounds[rank + 1]):
                    continue
                got = own[off - lo : off - lo + n]
                if mode == "nvfp4":  # E2M1 (spacing 1/2 of a unit at the top binade) x E4M3 block scale
                    tol = 0.25 * amax[i] * 1.13
                elif mode == "fp8_hadamard":  # rotation spreads each block's energy: error bounded by the block's
                    tol = 2.0**-4 * amax[i] * 1.01
                else:
                    tol = rel[mode] * absmean[i] + 1e-5 * amax[i]
                err = (got - ref[i]).abs()
                assert (err <= tol).all(), (mode, world, rank, i, float((err - tol).max()))
        # this rank sends every range but its own: the wire bytes of an even reduce-scatter of the same buffer
        total = bounds[-1]
        esize = {"fp32": 4, "bf16": 2}.get(mode)
        if esize:
            for rank in range(world):
                assert outs[rank][mode]["bytes"] == (total - (bounds[rank + 1] - bounds[rank])) * esize


def sizes_uneven(bounds) -> bool:
    s = [b - a for a, b in zip(bounds, bounds[1:])]
    return len(set(s)) > 1


# -- training at DP = 3 with uneven ownership ------------------------------------------------------------------------


def _train(rank, world, overrides, steps, tp=1, micro=2):
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    cfg = tiny_cfg("train.global_batch_size=12", f"parallel.tensor={tp}", f"train.micro_batch_size={micro}", *overrides)
    pctx = pctx_for(tp)
    model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad, geo=reducer.geo)
    losses = []
    for step in range(steps):
        mbs = rank_micro_batches(global_batch(cfg, step), micro, pctx.dp_rank, pctx.dp_size)
        losses.append(train_step(ctx, step, mbs).loss)
    uneven = sum(1 for b in buckets if not b.plan.even)
    rows_cut = sum(1 for m in opt.mains if ".mlp." in m.name and not m.whole)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, uneven, rows_cut


@pytest.mark.parametrize(
    "overrides",
    [
        ["optimizer.name=muon"],
        [
            "optimizer.name=adamw",
            "comm.transform=geo",
            "comm.dtype=fp32",
            "geo.layers=layers.*.mlp.*_proj.weight",
            "geo.rank=4",
            "geo.refresh_interval=2",
        ],
    ],
    ids=["muon", "adamw-geo-fp32-wire"],
)
def test_dp3_with_uneven_owner_ranges_matches_single_process(overrides):
    ref_losses, ref_params, *_ = run_distributed(_train, 1, overrides, 3)[0]
    out = run_distributed(_train, 3, overrides, 3)
    assert out[0][2] > 0, "the DP=3 run must use uneven owner ranges"
    if "comm.transform=geo" in overrides:  # a GeoFP8 layer's rows are split between owners somewhere
        assert sum(o[3] for o in out) > 0, [o[3] for o in out]
    tol = 1e-5 if "optimizer.name=muon" in overrides else 1e-4  # geo: transform round trip in FP32
    for losses, params, *_ in out:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=tol)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], rtol=0, atol=tol, msg=lambda m: f"{n}: {m}")
    for n in out[0][1]:
        assert torch.equal(out[0][1][n], out[1][1][n]) and torch.equal(out[0][1][n], out[2][1][n]), n


GEO_FP32 = [
    "optimizer.name=adamw",
    "comm.transform=geo",
    "comm.dtype=fp32",
    "geo.layers=layers.*.mlp.down_proj.weight",
    "geo.rank=4",
    "geo.refresh_interval=2",
]


def test_tp2_dp2_and_accumulation_with_uneven_owner_ranges():
    ref_losses, ref_params, *_ = run_distributed(_train, 1, GEO_FP32, 2)[0]
    tp2 = run_distributed(_train, 4, GEO_FP32, 2, 2)  # TP = 2 x DP = 2, down projections owned whole
    assert tp2[0][2] > 0
    for losses, *_ in tp2:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=1e-4)
    a = run_distributed(_train, 3, ["optimizer.name=muon"], 2, 1, 1)  # micro batch 1 x 4 per rank
    b = run_distributed(_train, 3, ["optimizer.name=muon"], 2, 1, 4)  # micro batch 4 x 1
    torch.testing.assert_close(torch.tensor(a[0][0]), torch.tensor(b[0][0]), rtol=0, atol=1e-5)
    for n in a[0][1]:
        torch.testing.assert_close(a[0][1][n], b[0][1][n], rtol=0, atol=1e-5, msg=lambda m: f"{n}: {m}")


# -- checkpoints made before the change ------------------------------------------------------------------------------

PRE_CASES = {
    "muon": ["optimizer.name=muon"],
    "adamw_geofp8": [
        "optimizer.name=adamw",
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "comm.error_feedback=true",
        "geo.layers=layers.*.mlp.down_proj.weight",
        "geo.rank=4",
        "geo.refresh_interval=1",
    ],
}


def _load_pre(rank, world, root):
    from megatron_geo.training.checkpointing import Checkpointer
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    out = {}
    for name, ov in PRE_CASES.items():
        d = Path(root) / name
        # the checkpoints were saved by a release that only had the stream order (a resume refuses another)
        cfg = tiny_cfg(
            f"checkpoint.dir={d}", f"train.run_dir={d}", "train.global_batch_size=12", "data.sample_order=stream", *ov
        )
        pctx = pctx_for(1)
        model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
        ck = Checkpointer(cfg, pctx, model, opt, reducer, reducer.geo, lambda m: None)
        step, consumed, _ = ck.resume()
        state = local_state(opt)
        mbs = rank_micro_batches(global_batch(cfg, step), 2, pctx.dp_rank, pctx.dp_size)
        loss = train_step(StepContext(model, sync, opt, pctx, 1.0, geo=reducer.geo), step, mbs).loss
        out[name] = {"state": state, "step": step, "loss": loss, "uneven": sum(1 for b in buckets if not b.plan.even)}
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_checkpoint_made_with_the_padded_plan_loads_bitwise_into_uneven_ranges(tmp_path, world):
    root = tmp_path / "ckpt"
    shutil.copytree(DATA, root)
    saved_ranks = torch.load(DATA / "pieces.pt", weights_only=False)
    vocab = tiny_cfg().model.vocab_size
    out = run_distributed(_load_pre, world, str(root))
    for name in PRE_CASES:
        saved = assemble([r[name]["state"] for r in saved_ranks], 1, vocab)
        loaded = assemble([r[name]["state"] for r in out], 1, vocab)
        assert saved.keys() == loaded.keys()
        for pname in saved:
            for key, a in saved[pname].items():
                b = loaded[pname][key]
                assert (a == b) if isinstance(a, float) else torch.equal(a, b), (name, world, pname, key)
        assert all(r[name]["step"] == 2 for r in out)
        assert len({r[name]["loss"] for r in out}) == 1 and torch.isfinite(torch.tensor(out[0][name]["loss"]))
    assert out[0]["muon"]["uneven"] > 0


# -- DP = 64 on one device -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [[], ["--config", "configs/comm/geofp8.yaml", "optimizer.name=adamw", "model.num_layers=2"]],
    ids=["muon-600m", "adamw-geofp8-600m-2-layers"],
)
def test_dry_run_of_llama_600m_at_dp64(tmp_path, extra):
    out = tmp_path / "dry.json"
    cmd = [
        sys.executable,
        str(ROOT / "tools/dry_run.py"),
        "--config",
        str(ROOT / "configs/llama_600m.yaml"),
        *[str(ROOT / e) if e.endswith(".yaml") else e for e in extra],
        "--dp",
        "64",
        "--steps",
        "2",
        "model.seq_length=16",
        "train.global_batch_size=64",
        "train.micro_batch_size=1",
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["optimizer_steps"] == 2, res["steps"]
    assert abs(res["measured_over_plan"] - 1.0) <= 0.10, res
    assert "uneven owner ranges" in r.stdout
