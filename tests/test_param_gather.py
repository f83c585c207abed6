"""The quantised parameter all-gather (``comm.param_gather=fp8`` / ``nvfp4``): the owner sends the difference between
its new parameters and what every replica holds, quantised per 128-element block, and every replica adds the same
decoded difference. References: torch's own ``float8_e4m3fn`` cast of the scaled block, an E2M1 grid search, a
simulation of the update sent without the difference (which drifts), the other ranks' bits, a run resumed from a
checkpoint, and the checkpoint loaded at another DP size."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg

ROOT = Path(__file__).resolve().parents[1]
BF16 = ["train.param_dtype=bf16"]


# -- the codec -------------------------------------------------------------------------------------------------------
def _blocks(seed: int = 0) -> torch.Tensor:
    """FP32 ``[6, 128]`` differences: ordinary, all zero, wide range (values down to E4M3's subnormals after
    scaling), one outlier, negative only, and tiny."""
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(6, 128, generator=g) * 1e-3
    d[1] = 0.0
    d[2] = torch.randn(128, generator=g) * torch.logspace(-12, 0, 128)
    d[3, 7] = 5.0
    d[4] = -d[4].abs()
    d[5] *= 1e-30
    return d


def test_decoded_fp8_difference_equals_torchs_own_e4m3_cast_of_the_scaled_block():
    from megatron_geo.comm.param_codec import GATHER_CODECS

    d = _blocks()
    codec = GATHER_CODECS["fp8"]
    rec = codec.encode(d)
    assert rec.dtype == torch.uint8 and rec.shape == (6, 132)
    amax = d.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448.0)
    ref = (d / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    assert torch.equal(codec.decode(rec), ref)
    assert torch.equal(rec[:, 128:].contiguous().view(torch.float32), scale)  # the FP32 scale travels as is


def _e2m1_nearest_even(a: torch.Tensor) -> torch.Tensor:
    """Round magnitudes ``a`` (in [0, 6]) to the E2M1 grid, ties to the even code, by an exhaustive grid search."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    dist = (a.unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    code = torch.where(ties & (torch.arange(8) % 2 == 0), torch.arange(8), 99).min(dim=-1).values
    code = torch.where(ties.sum(-1) > 1, code, dist.argmin(dim=-1))
    return grid[code]


def test_decoded_nvfp4_difference_equals_an_e2m1_grid_search_with_e4m3_block_scales():
    from megatron_geo.comm.param_codec import GATHER_CODECS

    d = _blocks(1)
    codec = GATHER_CODECS["nvfp4"]
    rec = codec.encode(d)
    assert rec.shape == (6, 76)
    amax = d.abs().amax(dim=1, keepdim=True)
    g = torch.where(amax == 0, torch.ones_like(amax), amax / (448.0 * 6.0))  # one FP32 scale per 128 elements
    x = d.view(6, 8, 16)
    bamax = x.abs().amax(dim=2, keepdim=True)
    s = (bamax / (6.0 * g.unsqueeze(1))).to(torch.float8_e4m3fn).float()
    s = torch.where((s == 0) & (bamax > 0), 2.0**-9, s)  # a non-zero block never gets scale 0
    div = torch.where(s * g.unsqueeze(1) == 0, 1.0, s * g.unsqueeze(1))
    y = x / div
    ref = torch.sign(y) * _e2m1_nearest_even(y.abs().clamp(max=6.0)) * s * g.unsqueeze(1)
    assert torch.equal(codec.decode(rec), ref.view(6, 128))


def _simulate(name: str, steps: int, mode: str) -> list[float]:
    """Per step, the largest deviation (BF16 ulps at the block's largest magnitude) from the BF16 target of what a
    replica holds when the owner sends ``mode``: ``difference`` (this scheme), ``update`` (the quantised change of the
    target, no difference: the error is never corrected) or ``parameter`` (the quantised parameter itself)."""
    from megatron_geo.comm.param_codec import GATHER_CODECS, bf16_ulp

    codec = GATHER_CODECS[name]
    g = torch.Generator().manual_seed(7)
    main = torch.randn(16, 128, generator=g) * 0.02
    held = main.bfloat16()
    prev = held.clone()
    out = []
    for _ in range(steps):  # an Adam-like step: every element moves by about lr, with a drifting sign
        main -= 1e-3 * torch.tanh(torch.randn(16, 128, generator=g) + 0.3)
        target = main.bfloat16()
        if mode == "difference":
            held = (held.float() + codec.decode(codec.encode(target.float() - held.float()))).bfloat16()
        elif mode == "update":
            held = (held.float() + codec.decode(codec.encode(target.float() - prev.float()))).bfloat16()
        else:
            held = codec.decode(codec.encode(target.float())).bfloat16()
        prev = target
        t = target.float()
        dev = (held.float() - t).abs().amax(dim=1).double() / bf16_ulp(t.abs().amax(dim=1))
        out.append(float(dev.max()))
    return out


@pytest.mark.parametrize("name", ["fp8", "nvfp4"])
def test_the_deviation_is_bounded_and_does_not_grow_where_the_quantised_update_drifts(name):
    steps = 60
    ours = _simulate(name, steps, "difference")
    update = _simulate(name, steps, "update")
    param = _simulate(name, steps, "parameter")
    assert max(ours[-20:]) <= max(ours[:20]), ours  # error feedback by construction: no growth
    assert max(ours) <= (0.5 if name == "fp8" else 2.0), max(ours)  # measured: 0.25 and 1.0
    assert max(update[-20:]) > 4 * update[0], update  # the uncorrected errors add up ...
    assert max(update[-20:]) > 3 * max(ours), (update, ours)
    assert min(param) > 3 * max(ours), (param, ours)  # ... and quantising the parameter itself is far coarser


# -- the config ------------------------------------------------------------------------------------------------------
def test_bf16_gather_of_fp32_parameters_and_unknown_values_are_config_errors():
    from megatron_geo.config import ConfigError
    from megatron_geo.training.validate import validate_config

    with pytest.raises(
        ConfigError, match=r"comm\.param_gather=bf16 with train\.param_dtype=fp32.*comm\.param_gather=auto"
    ):
        validate_config(tiny_cfg("comm.param_gather=bf16"), 2)
    with pytest.raises(ConfigError, match=r"comm\.param_gather='fp4' is not supported; choose one of auto, bf16, fp8"):
        validate_config(tiny_cfg("comm.param_gather=fp4"), 2)
    for ok in (["comm.param_gather=bf16", *BF16], ["comm.param_gather=fp8"], ["comm.param_gather=nvfp4", *BF16]):
        validate_config(tiny_cfg(*ok), 2)


def test_a_bad_param_gather_is_refused_before_the_process_group(tmp_path, monkeypatch, capsys):
    from ckpt_helpers import trap_process_group
    from megatron_geo.training import cli

    trap_process_group(monkeypatch)
    code = cli.main(
        ["--config", str(ROOT / "configs/tiny.yaml"), f"train.run_dir={tmp_path}", "comm.param_gather=bf16"]
    )
    assert code == 2
    assert "comm.param_gather=bf16 with train.param_dtype=fp32" in capsys.readouterr().err


def test_the_label_names_a_quantised_parameter_gather():
    from megatron_geo.config import load_config

    fp8 = str(ROOT / "configs/comm/fp8.yaml")
    assert load_config([fp8], ["comm.param_gather=fp8"]).comm.label == "fp8+pg=fp8"
    assert load_config([fp8], ["comm.param_gather=bf16"]).comm.label == "fp8"
    assert load_config([], ["comm.dtype=bf16", "comm.param_gather=nvfp4"]).comm.label == "bf16+pg=nvfp4"


def test_plan_report_at_llama_600m_dp64_sends_at_most_052_of_bf16_both_ways():
    from megatron_geo.analysis.plan_report import meta_model_params, plan_figures
    from megatron_geo.config import load_config

    cfg = load_config([str(ROOT / "configs/llama_600m.yaml"), str(ROOT / "configs/comm/fp8.yaml")])
    params = meta_model_params(cfg)
    plain = plan_figures(cfg, 64, params)
    cfg.comm.param_gather = "fp8"
    f = plan_figures(cfg, 64, params)
    assert f["gather_bytes_per_element"] == 132 / 128 and plain["gather_bytes_per_element"] == 4.0
    assert f["dp_bytes_vs_bf16"] <= 0.52, f["dp_bytes_vs_bf16"]
    both = f["wire_bytes_per_rank"] + f["gather_bytes_per_rank"]  # each the worst rank's: an upper bound
    assert max(f["wire_bytes_per_rank"], f["gather_bytes_per_rank"]) < f["dp_bytes_per_rank"] <= both
    assert f["gather_bytes_per_rank"] < 0.3 * plain["gather_bytes_per_rank"]  # FP32 parameters before


def test_plan_report_counts_both_halves_of_the_all_reduce_without_the_distributed_optimizer():
    from megatron_geo.analysis.plan_report import plan_figures
    from megatron_geo.config import load_config

    for dtype, b in (("fp32", 4), ("bf16", 2)):
        cfg = load_config([str(ROOT / "configs/tiny.yaml"), str(ROOT / f"configs/comm/{dtype}.yaml")])
        rs = plan_figures(cfg, 4, bf16_reference=False)
        cfg.parallel.distributed_optimizer = False
        ar = plan_figures(cfg, 4, bf16_reference=False)
        # reducer.py: an all-reduce is a reduce-scatter and an all-gather of the averaged ranges, each sending
        # S - own elements in the wire format; nothing else is gathered
        assert ar["wire_bytes_per_rank"] == 2 * 3 * ar["buffer_elements_per_rank"] // 4 * b
        assert ar["wire_bytes_per_rank"] == 2 * rs["wire_bytes_per_rank"]
        assert ar["gather_bytes_per_rank"] == 0 and ar["dp_bytes_per_rank"] == ar["wire_bytes_per_rank"]


# -- training at DP 2 ------------------------------------------------------------------------------------------------
def _digest(model) -> str:
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _build(overrides):
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext

    cfg = tiny_cfg(*overrides)
    pctx = pctx_for(cfg.parallel.tensor)
    model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    return cfg, pctx, model, opt, StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad, geo=reducer.geo)


def _train(cfg, pctx, model, opt, ctx, first: int, n: int) -> list[dict]:
    from megatron_geo.training.step import train_step

    out = []
    for s in range(first, first + n):
        mbs = rank_micro_batches(global_batch(cfg, s), 2, pctx.dp_rank, pctx.dp_size)
        loss = train_step(ctx, s, mbs).loss
        report = opt.gather_report()  # waits for the gathers, checks the replicas' digests (collective)
        owned = [(m.bucket.param_data[m.buffer_start : m.buffer_start + m.main.numel()], m.main) for m in opt.mains]
        same = sum(int((h == mn.reshape(-1).to(h.dtype)).sum()) for h, mn in owned)
        out.append(
            {
                "loss": loss,
                "digest": _digest(model),
                "ulps": report.get("param_gather/max_ulps"),
                "same_as_main": same / max(1, sum(mn.numel() for _, mn in owned)),
                "gather_bytes": opt.reset_gather_bytes(),
            }
        )
    return out


def _preset(name: str) -> list[str]:
    """``configs/comm/<name>.yaml`` as dotted overrides (GeoFP8 with a small rank, refreshed every 2 steps)."""
    import yaml

    data = yaml.safe_load((ROOT / "configs" / "comm" / f"{name}.yaml").read_text())
    out = [f"{sec}.{k}={v}" for sec, body in data.items() for k, v in body.items() if k != "layers"]
    return out + (["geo.rank=4", "geo.refresh_interval=2"] if "geo" in data else [])


# every case pairs a parameter gather with another gradient preset (their alignments differ)
CASES = {
    "adamw_fp8": [*BF16, *_preset("fp8"), "comm.param_gather=fp8"],
    "adamw_fp8_overlapped": [*BF16, *_preset("fp8"), "comm.param_gather=fp8", "parallel.overlap_param_gather=true"],
    "adamw_nvfp4": [*BF16, *_preset("nvfp4"), "comm.param_gather=nvfp4"],
    "adamw_fp8_fp32_params_geofp8": [*_preset("geofp8"), "comm.param_gather=fp8"],
    "muon_fp8_whole": [
        *BF16,
        *_preset("fp8_block"),
        "comm.param_gather=fp8",
        "optimizer.name=muon",
        "optimizer.muon_split=off",
    ],
    "muon_nvfp4_split": [
        *BF16,
        *_preset("fp8_hadamard"),
        "comm.param_gather=nvfp4",
        "optimizer.name=muon",
        "optimizer.muon_split=2",
    ],
    "adamw_plain": [*BF16, *_preset("bf16")],
}


def _cases_worker(rank, world, names, steps):
    out = {}
    for name in names:
        cfg, pctx, model, opt, ctx = _build(CASES[name])
        split = any(m.split is not None for m in opt.mains)
        out[name] = {"steps": _train(cfg, pctx, model, opt, ctx, 0, steps), "split": split}
    return out


def test_replicas_stay_bitwise_equal_with_adamw_and_muon_whole_split_and_overlapped():
    steps = 3
    ranks = run_distributed(_cases_worker, 2, list(CASES), steps)
    for name in CASES:
        a, b = (r[name]["steps"] for r in ranks)
        assert [s["digest"] for s in a] == [s["digest"] for s in b], name  # every step, every parameter
        assert [s["loss"] for s in a] == [s["loss"] for s in b], name
        if name == "adamw_plain":
            assert all(s["ulps"] is None and s["same_as_main"] == 1.0 for s in a)
            continue
        ulps = [s["ulps"] for s in a]
        # lr 1e-2: AdamW's first steps move every element by ~lr, half the size of the parameters; measured fp8 2-3,
        # nvfp4 7-14 ulps (E2M1 keeps one mantissa bit)
        assert all(u is not None and 0 < u < (6 if "fp8" in name.split("_")[1] else 20) for u in ulps), (name, ulps)
        assert ulps == sorted(ulps), name  # a running maximum
        same = [s["same_as_main"] for s in a]  # the replicas differ from the rounded mains in a part of the elements
        assert (max(same) < 0.1) if "fp32_params" in name else (min(same) > 0.2 and max(same) < 1.0), (name, same)
        assert all(s["gather_bytes"] > 0 for s in a + b), name
    assert ranks[0]["muon_nvfp4_split"]["split"] and not ranks[0]["muon_fp8_whole"]["split"]
    # the overlapped gather waits in the forward pre-hooks: the same bits as the blocking one
    assert ranks[0]["adamw_fp8_overlapped"]["steps"] == ranks[0]["adamw_fp8"]["steps"]
    # FP8 records are 132 bytes per 128 elements, BF16 parameters 256
    plain, fp8 = ranks[0]["adamw_plain"]["steps"][0], ranks[0]["adamw_fp8"]["steps"][0]
    assert fp8["gather_bytes"] / plain["gather_bytes"] == pytest.approx(132 / 256, rel=0.05)


def _tp_worker(rank, world, pgs, root):
    """Two steps at TP 2 x DP 2 per gather; then a save, and a fresh model and optimizer loaded from it (the
    TP-replicated parameters' replica values are read by TP rank 0 and broadcast)."""
    from megatron_geo.training.checkpointing import Checkpointer

    out = {}
    for pg in pgs:
        ov = [*BF16, *_preset("fp8"), f"comm.param_gather={pg}", "parallel.tensor=2", f"checkpoint.dir={root}/{pg}"]
        cfg, pctx, model, opt, ctx = _build(ov)
        steps = _train(cfg, pctx, model, opt, ctx, 0, 2)
        Checkpointer(cfg, pctx, model, opt, ctx.reducer, ctx.geo, lambda m: None).save(2, 16)
        cfg, pctx, loaded, opt, ctx = _build(ov)
        Checkpointer(cfg, pctx, loaded, opt, ctx.reducer, ctx.geo, lambda m: None).resume()
        replicated = {
            n: p.detach().clone() for n, p in model.named_parameters() if not getattr(p, "tensor_model_parallel", False)
        }
        out[pg] = {
            "tp": pctx.tp_rank,
            "dp": pctx.dp_rank,
            "steps": steps,
            "replicated": replicated,
            "digest": _digest(model),
            "loaded": _digest(loaded),
        }
    return out


def test_tp2_dp2_keeps_dp_replicas_and_tp_replicated_norm_weights_bitwise_equal(tmp_path):
    ranks = run_distributed(_tp_worker, 4, ["fp8", "nvfp4"], str(tmp_path))
    for pg in ("fp8", "nvfp4"):
        assert all(r[pg]["loaded"] == r[pg]["digest"] for r in ranks), pg  # a load restores every rank's bits
        by = {(r[pg]["tp"], r[pg]["dp"]): r[pg] for r in ranks}
        for tp in (0, 1):  # every step's report checked the DP replicas; the end state too
            assert by[(tp, 0)]["digest"] == by[(tp, 1)]["digest"], pg
        assert by[(0, 0)]["digest"] != by[(1, 0)]["digest"]  # (TP ranks hold different shards)
        norms = by[(0, 0)]["replicated"]
        assert norms and all(torch.equal(norms[n], by[(1, d)]["replicated"][n]) for n in norms for d in (0, 1)), pg
        assert all(s["ulps"] > 0 for s in by[(0, 0)]["steps"]), pg


def _syncs_worker(rank, world, names):
    """Per case, the host syncs of two steps after the first (no report between them: the overlapped gathers of one
    step are decoded in the next step's forward hooks), as ``(op and where, inside backward)``."""
    from megatron_geo.comm.op_trace import OpRecorder
    from megatron_geo.training.step import train_step

    out = {}
    for name in names:
        cfg, pctx, model, opt, ctx = _build(CASES[name])
        batches = [rank_micro_batches(global_batch(cfg, s), 2, pctx.dp_rank, pctx.dp_size) for s in range(3)]
        tokens = cfg.train.global_batch_size * cfg.model.seq_length  # every token counts (as the sampler says)
        train_step(ctx, 0, batches[0], global_tokens=tokens)
        rec = OpRecorder(keep_events=True)
        with rec:
            for s in (1, 2):
                train_step(ctx, s, batches[s], global_tokens=tokens)
        opt.wait_param_gather()
        out[name] = [(n, bwd) for kind, n, bwd in rec.events if kind == "sync"]
    return out


def test_the_quantised_gather_adds_no_host_sync_to_a_step():
    names = ["adamw_fp8_overlapped", "muon_nvfp4_split"]
    got = run_distributed(_syncs_worker, 2, names)[0]
    for name in names:
        # none but torch's single-tensor AdamW reading its CPU step counter (fused on CUDA); the gradient norm's read
        # is a list conversion, which the recorder does not see
        ours = [(n, bwd) for n, bwd in got[name] if "torch.optim.optimizer:_get_value" not in n]
        assert ours == [], (name, ours)


def _layouts_with_every_preset(dp: int) -> dict:
    """In a fresh process, on a fake process group of ``dp`` ranks: per (preset, optimizer, gather), whether the
    trainer's buckets are aligned for the quantised gather, and the report's plan against the trainer's."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_geo.analysis.plan_report import meta_model_params, plan_layout
    from megatron_geo.config import load_config
    from megatron_geo.parallel import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer

    torch.set_num_threads(1)
    cases = [
        (p.stem, opt, pg)
        for p in sorted((ROOT / "configs/comm").glob("*.yaml"))
        for opt in ("adamw", "muon")
        for pg in ("fp8", "nvfp4")
    ]

    def cfg_of(preset, opt, pg):
        return load_config(
            [str(ROOT / "configs/tiny.yaml"), str(ROOT / f"configs/comm/{preset}.yaml")],
            [
                "model.hidden_size=40",
                "parallel.bucket_size=30000",
                "train.device=cpu",
                "logging.wandb=disabled",
                f"optimizer.name={opt}",
                f"comm.param_gather={pg}",
            ],
        )

    report = {}
    for case in cases:
        cfg = cfg_of(*case)
        report[case] = [
            (n, list(pl.offsets), list(pl.bounds)) for n, pl in plan_layout(cfg, dp, meta_model_params(cfg))
        ]
    out = {}
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    try:
        pctx = build_groups(0, dp, 1, torch.device("cpu"), "fake")
        for case in cases:
            _, buckets, _, _, opt = build_model_and_optimizer(cfg_of(*case), pctx)
            trainer = [(list(b.names), list(b.plan.offsets), list(b.plan.bounds)) for b in buckets]
            out[case] = (opt.quantized_gather is not None, trainer == report[case])
    finally:
        dist.destroy_process_group()
    return out


def test_every_gradient_preset_lays_out_buckets_the_quantised_gather_accepts():
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        got = ex.submit(_layouts_with_every_preset, 3).result(timeout=300)
    assert len(got) == len(list((ROOT / "configs/comm").glob("*.yaml"))) * 4  # every preset x optimizer x gather
    # built (QuantizedParamGather refuses a bucket with an offset or bound off the 128 grid) and planned alike
    assert all(built and same for built, same in got.values()), [c for c, v in got.items() if not all(v)]


# -- checkpoints -----------------------------------------------------------------------------------------------------
CKPT_CASES = {
    "adamw_fp8": [*BF16, *_preset("fp8"), "comm.param_gather=fp8"],
    "muon_nvfp4": [*BF16, *_preset("fp8_ef"), "comm.param_gather=nvfp4", "optimizer.name=muon"],
}


def _ckpt_build(name: str, root: str):
    from megatron_geo.training.checkpointing import Checkpointer

    d = Path(root) / name
    built = _build([*CKPT_CASES[name], f"checkpoint.dir={d}", f"train.run_dir={d}", "train.global_batch_size=12"])
    cfg, pctx, model, opt, ctx = built
    return built, Checkpointer(cfg, pctx, model, opt, ctx.reducer, ctx.geo, lambda m: None)


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save_and_resume_worker(rank, world, root):
    """3 steps, save, 3 more; then a fresh model and optimizer resumed from the save for the same 3 steps."""
    from ckpt_helpers import local_state

    out = {}
    for name in CKPT_CASES:
        (cfg, pctx, model, opt, ctx), ck = _ckpt_build(name, root)
        _train(cfg, pctx, model, opt, ctx, 0, 3)
        ck.save(3, 36)
        saved = {"params": _params(model), "state": local_state(opt)}
        cont = _train(cfg, pctx, model, opt, ctx, 3, 3)
        (cfg, pctx, model, opt, ctx), ck = _ckpt_build(name, root)
        step, _, _ = ck.resume()
        out[name] = {**saved, "cont": cont, "resumed": _train(cfg, pctx, model, opt, ctx, step, 3), "step": step}
    return out


def _load_worker(rank, world, root):
    from ckpt_helpers import local_state

    out = {}
    for name in CKPT_CASES:
        (cfg, pctx, model, opt, ctx), ck = _ckpt_build(name, root)
        step, _, _ = ck.resume()
        rounded = all(
            torch.equal(
                m.bucket.param_data[m.buffer_start : m.buffer_start + m.main.numel()], m.main.reshape(-1).bfloat16()
            )
            for m in opt.mains
        )
        out[name] = {"params": _params(model), "state": local_state(opt), "step": step, "rounded": rounded}
        out[name]["next"] = _train(cfg, pctx, model, opt, ctx, step, 1)[0]["digest"]
    return out


def test_resume_is_bitwise_and_dp2_to_dp3_restores_the_replicas_parameters_exactly(tmp_path):
    from ckpt_helpers import assemble

    two = run_distributed(_save_and_resume_worker, 2, str(tmp_path))
    three = run_distributed(_load_worker, 3, str(tmp_path))
    for name in CKPT_CASES:
        r0 = two[0][name]
        assert r0["step"] == 3
        assert r0["resumed"] == r0["cont"], name  # losses, parameter digests and deviations of steps 4-6
        shared = [{k: s[k] for k in ("loss", "digest", "ulps")} for s in r0["resumed"]]  # (the rest is per rank)
        assert [{k: s[k] for k in ("loss", "digest", "ulps")} for s in two[1][name]["resumed"]] == shared, name
        # DP 3: every replica holds the DP-2 replicas' parameters, bit for bit (not the main params rounded), ...
        for r in three:
            assert r[name]["step"] == 3
            assert r[name]["params"].keys() == r0["params"].keys()
            for n, p in r0["params"].items():
                assert torch.equal(r[name]["params"][n], p), (name, n)
        assert not any(r[name]["rounded"] for r in three), name  # (they differ from the mains somewhere)
        assert len({r[name]["next"] for r in three}) == 1, name  # ... and the next step keeps them equal
        # ... and the main params and optimizer state are the saved ones
        saved = assemble([two[k][name]["state"] for k in range(2)], 1)
        loaded = assemble([r[name]["state"] for r in three], 1)
        for n in saved:
            for key, v in saved[n].items():
                assert (v == loaded[n][key]) if isinstance(v, float) else torch.equal(v, loaded[n][key]), (name, n, key)


def test_a_resume_refuses_a_changed_param_gather_unless_allowed():
    from megatron_geo.checkpoint.resume_changes import check_resume_changes
    from megatron_geo.config import ConfigError, config_to_dict

    saved = config_to_dict(tiny_cfg(*BF16))
    with pytest.raises(ConfigError, match=r"comm\.param_gather changed on resume: 'auto' -> 'fp8'"):
        check_resume_changes(saved, tiny_cfg(*BF16, "comm.param_gather=fp8"), 3, "resume")
    allowed = tiny_cfg(*BF16, "comm.param_gather=fp8", "checkpoint.allow_changes=comm.param_gather")
    assert any("comm.param_gather" in n for n in check_resume_changes(saved, allowed, 3, "resume"))
    del saved["comm"]["param_gather"]  # a checkpoint saved before the key existed gathered plainly
    assert check_resume_changes(saved, tiny_cfg(*BF16), 3, "resume") == []
    with pytest.raises(ConfigError, match=r"comm\.param_gather"):
        check_resume_changes(saved, tiny_cfg(*BF16, "comm.param_gather=nvfp4"), 3, "resume")
