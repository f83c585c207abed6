"""Muon matrices split by rows over a small group of DP ranks: the split Newton-Schulz against the unsplit
``orthogonalize`` in one process (simulated groups), the plan's split rule and FLOP model, and the full
optimizer step of a split plan against the whole-matrix plan with real gloo processes (checkpoints included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_geo.optim.muon import NSSettings, orthogonalize
from megatron_geo.optim.split_ns import even_cuts, local_group, split_orthogonalize

COEFFS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's
EPS = 1e-7
U32 = 2.0**-24  # unit roundoff
U64 = 2.0**-53

# -- split Newton-Schulz in one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(96, 40), (40, 96), (48, 48)], ids=["tall", "wide", "square"])
@pytest.mark.parametrize("g", [2, 3, 4])
@pytest.mark.parametrize("ns", ["quintic", "gram"])
def test_split_newton_schulz_equals_the_unsplit_one(shape, g, ns):
    """The tolerance is derived from the iteration's own rounding: the unsplit FP32 result's distance to the FP64
    one is ``kappa * u32`` (kappa: how much the 5 steps amplify one rounding). The split run rounds the same
    operations in another order, an error of the same size: its distance to the FP64 result must be within 4x
    the unsplit one's (the max over elements of another draw), and in FP64 split and unsplit must agree to
    ``4 kappa u64``."""
    gen = torch.Generator().manual_seed(hash((shape, g, ns)) % 2**31)
    w = torch.randn(shape, generator=gen, dtype=torch.float64)
    ref64 = orthogonalize(w, ns, COEFFS, 5, EPS, torch.float64)
    err32 = (orthogonalize(w.float(), ns, COEFFS, 5, EPS, torch.float32).double() - ref64).abs().max().item()
    kappa = err32 / U32
    cuts = even_cuts(shape[0], g)
    all_reduce, exchange = local_group(g)
    calls = []

    def counted(parts):
        calls.append(parts[0].shape)
        return all_reduce(parts)

    for dtype, bound in ((torch.float32, 4 * err32), (torch.float64, 4 * kappa * U64)):
        blocks = [w[cuts[i] : cuts[i + 1]].to(dtype) for i in range(g)]
        calls.clear()
        out = split_orthogonalize(blocks, range(g), cuts, NSSettings(ns, COEFFS, 5, EPS, dtype), counted, exchange)
        assert all(o.dtype == dtype for o in out)
        got = torch.cat(out).double()
        assert got.shape == w.shape
        err = (got - ref64).abs().max().item()
        assert err <= bound, (dtype, err, bound)
        m = min(shape)
        assert all(s == (m, m) for s in calls), calls  # only the small Gram travels
        gram_form = ns == "gram" and shape[0] != shape[1]
        assert len(calls) == (2 if gram_form else 5)  # gram: start + one restart; quintic: one per step


def test_split_newton_schulz_rejects_bad_blocks():
    ar, ex = local_group(2)
    quintic = NSSettings("quintic", COEFFS, 5, EPS, torch.float32)
    w = torch.randn(10, 4)
    with pytest.raises(ValueError, match="row_cuts"):
        split_orthogonalize([w[:4], w[4:]], [0, 1], [0, 5, 10], quintic, ar, ex)
    with pytest.raises(ValueError, match="muon_ns"):
        split_orthogonalize([w[:5], w[5:]], [0, 1], [0, 5, 10], dataclasses.replace(quintic, ns="cubic"), ar, ex)


# -- the optimizer step of a split plan with real gloo processes -----------------------------------------------------


def _run(rank, world, overrides, steps, save_at=None, ckpt=None, resume=False):
    """``steps`` training steps of the tiny model (after resuming from ``ckpt`` when ``resume``; saving there after
    step ``save_at``): losses, final parameters, how many main params are split row blocks, and this rank's pieces
    with their optimizer state as loaded (``resume``) or as saved (``save_at``)."""
    from ckpt_helpers import local_state
    from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg
    from megatron_geo.training.checkpointing import Checkpointer
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    extra = [f"checkpoint.dir={ckpt}", f"train.run_dir={ckpt}"] if ckpt else []
    # 24 samples: whole micro-batches of 2 at DP 3 and 4 (the same global batch either way)
    cfg = tiny_cfg("optimizer.name=muon", "train.global_batch_size=24", *extra, *overrides)
    pctx = pctx_for(1)
    model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    ck = Checkpointer(cfg, pctx, model, opt, reducer, reducer.geo, lambda m: None) if ckpt else None
    start, loaded = 0, None
    if resume:
        start, _, _ = ck.resume()
        loaded = local_state(opt)
    ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad)
    losses = []
    for step in range(start, start + steps):
        mbs = rank_micro_batches(global_batch(cfg, step), 2, pctx.dp_rank, pctx.dp_size)
        losses.append(train_step(ctx, step, mbs).loss)
        if save_at is not None and step + 1 == save_at:
            ck.save(step + 1, (step + 1) * cfg.train.global_batch_size)
            loaded = local_state(opt)
    n_split = sum(1 for m in opt.mains if m.split is not None)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, n_split, loaded


def _close(a: dict, b: dict, tol: float) -> None:
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=tol, msg=lambda m: f"{n}: {m}")


# FP32 rounding of 3 Muon steps of the tiny model (lr 1e-2): the same bound the DP = 3 equivalence test of
# test_sharding uses for whole-matrix plans against a single process (reordered FP32 sums, amplified through
# the loss of later steps).
TOL = 1e-5


@pytest.mark.parametrize(
    "world,split,ns", [(3, "2", "quintic"), (4, "4", "quintic"), (3, "3", "gram"), (4, "2", "gram")]
)
def test_split_plan_steps_like_the_whole_matrix_plan(world, split, ns):
    from dist_harness import run_distributed

    whole = run_distributed(_run, world, ["optimizer.muon_split=off", f"optimizer.muon_ns={ns}"], 3)
    got = run_distributed(_run, world, [f"optimizer.muon_split={split}", f"optimizer.muon_ns={ns}"], 3)
    assert all(o[2] == 0 for o in whole)
    assert sum(o[2] for o in got) >= int(split), [o[2] for o in got]  # row blocks exist
    for (lw, pw, *_), (ls, ps, *_) in zip(whole, got):
        torch.testing.assert_close(torch.tensor(ls), torch.tensor(lw), rtol=0, atol=TOL)
        _close(ps, pw, TOL)
    for n in got[0][1]:  # the gather leaves every rank with the same parameters
        assert all(torch.equal(got[0][1][n], o[1][n]) for o in got), n


def test_split_plan_resumes_bitwise_and_across_split_and_whole_plans(tmp_path):
    from ckpt_helpers import assemble
    from dist_harness import run_distributed
    from helpers import tiny_cfg

    vocab = tiny_cfg().model.vocab_size
    split, whole = str(tmp_path / "split"), str(tmp_path / "whole")
    straight = run_distributed(_run, 4, ["optimizer.muon_split=2"], 3)
    saved = {
        split: run_distributed(_run, 4, ["optimizer.muon_split=2"], 2, 2, split),
        whole: run_distributed(_run, 4, ["optimizer.muon_split=off"], 2, 2, whole),
    }
    same = run_distributed(_run, 4, ["optimizer.muon_split=2"], 1, None, split, True)
    for (ls, ps, *_), (lr_, pr, *_) in zip(straight, same):
        assert ls[-1] == lr_[0]
        for n in ps:
            assert torch.equal(ps[n], pr[n]), n  # bitwise: the same plan, the same operations
    # a split checkpoint into a whole-matrix plan at DP 3, a whole-matrix one into a split plan at DP 4
    to_whole = run_distributed(_run, 3, ["optimizer.muon_split=off"], 1, None, split, True)
    to_split = run_distributed(_run, 4, ["optimizer.muon_split=2"], 1, None, whole, True)
    assert sum(o[2] for o in saved[split]) > 0 and sum(o[2] for o in to_split) > 0
    assert all(o[2] == 0 for o in to_whole) and all(o[2] == 0 for o in saved[whole])
    for src, dst in ((split, to_whole), (whole, to_split), (split, same)):
        ref = assemble([o[3] for o in saved[src]], 1, vocab)
        loaded = assemble([o[3] for o in dst], 1, vocab)
        assert loaded.keys() == ref.keys()
        for name in ref:
            for key, a in ref[name].items():
                b = loaded[name][key]
                assert (a == b) if isinstance(a, float) else torch.equal(a, b), (name, key)  # resharding is exact
    for (ls, ps, *_), (lo, po, *_) in zip(straight, to_whole):  # then one step of either plan: FP32 rounding
        torch.testing.assert_close(torch.tensor(lo[0]), torch.tensor(ls[-1]), rtol=0, atol=TOL)
        _close(po, ps, TOL)


# -- the plan --------------------------------------------------------------------------------------------------------


def _random_specs(rnd, policy):
    from megatron_geo.distributed.shard_plan import ParamSpec, newton_schulz_flops

    specs = []
    for _ in range(rnd.randint(2, 14)):
        if rnd.random() < 0.6:
            rows, cols = rnd.choice([8, 12, 33, 64, 96]), rnd.choice([8, 16, 24, 40])
            ns = rnd.choice(["quintic", "gram"])
            f = newton_schulz_flops((rows, cols), ns=ns)
            specs.append(ParamSpec(rows * cols, True, f, 1, rows, cols, ns, policy))
        else:
            n = rnd.randint(1, 900)
            specs.append(ParamSpec(n, False, 12.0 * n))
    return specs


def test_split_plans_cover_every_element_once_in_contiguous_aligned_row_blocks():
    import random

    from megatron_geo.distributed.shard_plan import plan_model

    rnd = random.Random(5)
    n_split = 0
    for _ in range(300):
        policy = rnd.choice(["2", "3", "4", "auto"])
        specs = _random_specs(rnd, policy)
        dp, align = rnd.choice([2, 3, 4, 5, 8]), rnd.choice([1, 4, 16])
        for idx, pl in plan_model(specs, rnd.choice([50, 500, 5000]), dp, align):
            assert all(b % align == 0 for b in pl.bounds) and pl.bounds == sorted(pl.bounds)
            seen = {j: [] for j in range(len(idx))}
            for r in range(dp):
                for pc in pl.pieces[r]:
                    assert pl.bounds[r] <= pc.buffer_start and pc.buffer_start + pc.numel <= pl.bounds[r + 1]
                    assert pc.buffer_start == pl.offsets[pc.index] + pc.param_start  # the parameter is contiguous
                    seen[pc.index].append((pc.param_start, pc.param_end, r))
            for j, spans in seen.items():
                spans.sort()
                assert spans[0][0] == 0 and spans[-1][1] == specs[idx[j]].numel
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
                sp = pl.splits.get(j)
                if specs[idx[j]].atomic and sp is None:
                    assert len(spans) == 1  # whole
                if sp is not None:
                    n_split += 1
                    assert specs[idx[j]].atomic and sp.first % sp.size == 0 and sp.first + sp.size <= dp
                    assert [r for *_, r in spans] == list(range(sp.first, sp.first + sp.size))  # member order
                    assert [a for a, *_ in spans] == [c * sp.cols for c in sp.row_cuts[:-1]]
                    assert all(c * sp.cols % align == 0 for c in sp.row_cuts[:-1])
                    for k in range(1, sp.size - 1):  # a middle member's range is its block alone
                        assert pl.bounds[sp.first + k + 1] - pl.bounds[sp.first + k] == spans[k][1] - spans[k][0]
    assert n_split > 100


def test_auto_split_keeps_the_whole_matrix_plan_where_splitting_does_not_pay():
    """Llama-600M and -300M at DP 8 and 64 (nothing costs more than the mean share) and at DP 128 (splitting the MLP
    matrices over pairs saves less compute than its group collectives cost): the plan of ``off``, bit for bit."""
    from megatron_geo.analysis.plan_report import meta_model_params, plan_layout
    from megatron_geo.config import load_config

    for name in ("llama_600m", "llama_300m"):
        auto = load_config([f"configs/{name}.yaml"], [])
        off = load_config([f"configs/{name}.yaml"], ["optimizer.muon_split=off"])
        params = meta_model_params(auto)
        for dp in (8, 64, 128):
            a, b = plan_layout(auto, dp, params), plan_layout(off, dp, params)
            assert [(n, p.bounds, p.offsets, p.pieces) for n, p in a] == [
                (n, p.bounds, p.offsets, p.pieces) for n, p in b
            ], (name, dp)
            assert not any(p.splits for _, p in a)


def _specs(cfg):
    """The planner's view of ``cfg``'s model (meta device), in backward order, and the codec alignment."""
    from megatron_geo.analysis.plan_report import meta_model_params
    from megatron_geo.comm.formats import comm_alignment
    from megatron_geo.distributed.ownership import param_specs

    params = meta_model_params(cfg)
    align = comm_alignment(cfg.comm)
    return param_specs(cfg, list(reversed(params.infos)), align, params.geo_layers), align


def _hand_time(specs, dp, owner, splits, flops_per_s, link, latency) -> list[float]:
    """Per rank: optimizer FLOPs at ``flops_per_s``, plus per split it is a member of: the 5 Gram all-reduces of
    a quintic (ring: ``2 (g - 1) / g`` of ``k^2`` elements sent each, the first FP32, four BF16) and a wide
    matrix's two re-layouts (its rows of the others' columns, FP32 there and BF16 back), at ``link`` bytes/s
    plus ``latency`` per collective."""
    from megatron_geo.distributed.split_plan import plan_loads

    flops = plan_loads(specs, dp, owner, splits)[0]
    sent, colls = [0.0] * dp, [0] * dp
    for sp in splits.values():
        k, g = min(sp.rows, sp.cols), sp.size
        col = [c * sp.cols // sp.rows for c in sp.row_cuts]
        for m in range(g):
            r = sp.first + m
            sent[r] += 2 * (g - 1) / g * k * k * (4 + 4 * 2)
            colls[r] += 5
            if sp.rows < sp.cols:
                sent[r] += (sp.row_cuts[m + 1] - sp.row_cuts[m]) * (sp.cols - (col[m + 1] - col[m])) * (4 + 2)
                colls[r] += 2
    return [flops[r] / flops_per_s + sent[r] / link + colls[r] * latency for r in range(dp)]


def test_auto_split_at_llama_600m_dp128_weighs_compute_saved_against_group_collectives():
    """Llama-600M, DP = 128, quintic in BF16, on the assumed 400 TFLOP/s, 50 GB/s and 20 us per collective. Whole
    matrices: the busiest rank owns one 4096 x 1536 MLP matrix, ``5 (4 k^2 K + 2 k^3)`` = 229.5 GFLOP (0.574 ms).
    Split over pairs (the plan ``auto`` tried): the busiest rank does 187.2 GFLOP (0.106 ms less), but the slowest
    rank also waits on 5 Gram all-reduces and 2 re-layouts of 34.8 MB (0.835 ms more): whole matrices."""
    from megatron_geo.config import load_config
    from megatron_geo.distributed.shard_plan import muon_split_decision, plan_model
    from megatron_geo.distributed.split_plan import SPLIT_COST, SplitCost

    assert SplitCost(flops_per_s=400e12, link_bytes_per_s=50e9, collective_latency_s=20e-6) == SPLIT_COST
    cfg = load_config(["configs/llama_600m.yaml"], [])
    specs, align = _specs(cfg)
    d = muon_split_decision(specs, cfg.parallel.bucket_size, 128, align)
    assert d is not None and d.split is not None and d.split_plan is not None
    k, big = 1536, 4096
    mlp = 5 * (4 * k * k * big + 2 * k**3)
    assert d.whole.max_flops == mlp and d.whole.time_s == pytest.approx(mlp / 400e12, rel=1e-12)
    per_rank = _hand_time(specs, 128, *d.split_plan, 400e12, 50e9, 20e-6)
    t_split = max(per_rank)
    assert d.split.time_s == pytest.approx(t_split, rel=1e-12) and d.split.group_size == 2
    assert d.split.rank == per_rank.index(t_split)
    saved = (mlp - d.split.max_flops) / 400e12
    added = t_split - d.split.max_flops / 400e12
    assert d.saved_s == pytest.approx(saved, rel=1e-12) and d.added_s == pytest.approx(added, rel=1e-12)
    assert 0.09e-3 < saved < 0.12e-3 and 0.75e-3 < added < 0.95e-3, (saved, added)
    assert not d.chosen_split and t_split > mlp / 400e12
    assert not any(pl.splits for _, pl in plan_model(specs, cfg.parallel.bucket_size, 128, align))


def test_auto_split_splits_where_the_compute_saved_outweighs_the_collectives():
    """(a) DP = 2 and one 16384 x 2048 matrix: whole, one rank does ``5 (4 k^2 K + 2 k^3)`` = 1460 GFLOP (3.65
    ms); over the pair each member does ``5 (4 k^2 K / 2 + 2 k^3)`` (1.93 ms) and sends 5 x ``k^2`` elements, one
    FP32 and four BF16 (50.3 MB, 1.01 ms) in 5 all-reduces (0.1 ms): 3.04 ms, split. (b) Llama-600M at DP = 128 on a
    machine 10x slower at the optimizer's products (40 TFLOP/s): 1.06 ms saved against 0.835 ms added, split."""
    from megatron_geo.config import load_config
    from megatron_geo.distributed.plan_types import ParamSpec
    from megatron_geo.distributed.shard_plan import muon_split_decision, plan_model
    from megatron_geo.distributed.split_plan import SplitCost, auto_split

    rows, cols = 16384, 2048
    k, big = cols, rows
    whole_fl = 5 * (4 * k * k * big + 2 * k**3)
    specs = [ParamSpec(rows * cols, True, float(whole_fl), 1, rows, cols, "quintic", "auto")]
    d, owner, splits = auto_split(specs, 2, 16, {0: 0})
    member_fl = 5 * (4 * k * k * big / 2 + 2 * k**3)
    comm = k * k * (4 + 4 * 2) / 50e9 + 5 * 20e-6
    assert d is not None and d.split is not None
    assert d.whole.time_s == pytest.approx(whole_fl / 400e12, rel=1e-12)
    assert d.split.time_s == pytest.approx(member_fl / 400e12 + comm, rel=1e-12)
    assert d.chosen_split and list(splits) == [0] and splits[0].row_cuts == (0, rows // 2, rows)
    assert d.saved_s > d.added_s

    slow = SplitCost(flops_per_s=40e12)
    cfg = load_config(["configs/llama_600m.yaml"], [])
    specs, align = _specs(cfg)
    d = muon_split_decision(specs, cfg.parallel.bucket_size, 128, align, slow)
    assert d is not None and d.split is not None and d.split_plan is not None and d.chosen_split
    assert d.split.time_s == pytest.approx(max(_hand_time(specs, 128, *d.split_plan, 40e12, 50e9, 20e-6)), rel=1e-12)
    assert d.saved_s > d.added_s and d.split.group_size == 2
    plans = plan_model(specs, cfg.parallel.bucket_size, 128, align, slow)
    assert sum(len(pl.splits) for _, pl in plans) == d.split.matrices > 0


def test_flop_model_counts_what_each_member_does():
    """The quintic and Gram counts against a count of the products :func:`orthogonalize` and the split iteration
    perform (a matrix product ``[a, b] x [b, c]`` is ``2 a b c`` FLOPs), traced with torch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    from megatron_geo.distributed.shard_plan import Split, newton_schulz_flops
    from megatron_geo.distributed.split_plan import split_member_flops

    for shape in [(96, 40), (40, 96), (48, 48)]:
        for ns in ("quintic", "gram"):
            w = torch.randn(shape)
            with FlopCounterMode(display=False) as fc:
                orthogonalize(w, ns, COEFFS, 5, EPS, torch.float32)
            assert newton_schulz_flops(shape, ns=ns) == pytest.approx(fc.get_total_flops(), rel=0.02), (shape, ns)
            cuts = (0, shape[0] // 4, shape[0])
            sp = Split(0, cuts, shape[1])
            ar, ex = local_group(2)
            blocks = [w[cuts[0] : cuts[1]], w[cuts[1] :]]
            col = tuple(c * shape[1] // shape[0] for c in cuts)
            for k in range(2):  # member k alone: the other member's block in the group is not counted
                with FlopCounterMode(display=False) as fc:
                    x = blocks[k].T if shape[0] >= shape[1] else w[:, col[k] : col[k + 1]]
                    from megatron_geo.optim.split_ns import split_gram, split_quintic

                    fn = split_gram if ns == "gram" and shape[0] != shape[1] else split_quintic
                    fn([x], COEFFS, 5, EPS, torch.float32, lambda parts: parts[0])
                assert split_member_flops(sp, k, ns) == pytest.approx(fc.get_total_flops(), rel=0.02), (shape, ns, k)


def test_muon_split_setting_is_checked():
    from helpers import tiny_cfg
    from megatron_geo.config import ConfigError
    from megatron_geo.distributed.ownership import param_specs

    infos = [("w", (8, 4), True)]
    for bad in ("1", "two", "-2", "0"):
        with pytest.raises(ConfigError, match="optimizer.muon_split"):
            param_specs(tiny_cfg("optimizer.name=muon", f"optimizer.muon_split={bad}"), infos, 1)
    (s,) = param_specs(tiny_cfg("optimizer.name=muon", "optimizer.muon_split=4"), infos, 1)
    assert (s.rows, s.cols, s.split, s.atomic) == (8, 4, "4", True)


def test_dry_run_of_llama_600m_at_dp128_steps_the_split_plan(tmp_path):
    """Rank 0 of the 128-rank job on the fake process group with the Muon matrices split over pairs: two real
    steps with its row blocks (the Gram all-reduces and re-layouts run on the fake group), memory as the plan
    says."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "dry.json"
    cmd = [
        sys.executable,
        str(root / "tools/dry_run.py"),
        "--config",
        str(root / "configs/llama_600m.yaml"),
        "--dp",
        "128",
        "--steps",
        "2",
        "optimizer.muon_split=2",  # auto keeps whole matrices at DP 128: force the pairs
        "model.seq_length=16",
        "train.global_batch_size=128",
        "train.micro_batch_size=1",
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=root)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["optimizer_steps"] == 2, res["steps"]
    assert res["muon_split_blocks"] >= 1 and res["muon_split_group_size"] == 2, res
    assert abs(res["measured_over_plan"] - 1.0) <= 0.10, res
    assert "split over groups of 2 DP ranks" in r.stdout


@pytest.mark.parametrize("value", ["1", "three", "0", "-2"])
def test_bad_muon_split_is_a_config_error_before_any_plan(value):
    from helpers import tiny_cfg
    from megatron_geo.config import ConfigError
    from megatron_geo.training.validate import validate_config

    cfg = tiny_cfg("optimizer.name=muon", f"optimizer.muon_split={value}")
    with pytest.raises(ConfigError, match=f"optimizer.muon_split='{value}' is not auto, off or a group size >= 2"):
        validate_config(cfg, 1)
