"""GeoFP8: exact invertibility, rank consistency, transform-only exactness, error-feedback re-basing."""

import math

import pytest
import torch

from dist_harness import run_distributed
from helpers import geo_state, global_batch, pctx_for, rank_micro_batches, tiny_cfg
from megatron_geo.geometry import TransformMismatchError, build_transform
from megatron_geo.training.step import StepContext


def _factors():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(400, 48, generator=g, dtype=torch.float64)
    X[:, :4] *= 40  # anisotropic
    full = X.T @ X / 400
    low = X[:, :5] @ torch.randn(5, 48, generator=g, dtype=torch.float64)
    deficient = low.T @ low / 400  # rank 5
    dup = torch.cat([X[:, :24], X[:, :24]], dim=1)  # duplicated features
    duplicated = dup.T @ dup / 400
    return {"full": full, "rank-deficient": deficient, "duplicated": duplicated}


@pytest.mark.parametrize("kind", ["full", "rank-deficient", "duplicated"])
@pytest.mark.parametrize("rank", [1, 8, 32, 64])
def test_inverse_is_exact(kind, rank):
    A = _factors()[kind]
    T = build_transform(A, rank, damping=1e-3 * A.diagonal().mean().item())
    eye = torch.eye(48, dtype=torch.float64)
    M = T.dense().double()
    Minv = T.apply_inverse(torch.eye(48)).double()
    cond = (1 / T.d.min()).item() if T.d.numel() else 1.0  # damping keeps it bounded
    # FP32 precision times the condition number of T
    assert (Minv @ M - eye).abs().max() < 1e-6 * cond
    G = torch.randn(7, 48)
    assert ((T.apply_inverse(T.apply(G)) - G).norm() / G.norm()) < 1e-6 * cond
    assert torch.equal(T.apply(torch.zeros(3, 48)), torch.zeros(3, 48))
    # the reducer's in-place forms on a view into a larger buffer: same values, neighbours untouched
    buf = torch.full((5 + 7 * 48,), 7.0)
    view = buf[5:].view(7, 48)
    view.copy_(G)
    torch.testing.assert_close(T.apply_(view), T.apply(G), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(T.apply_inverse_(view), T.apply_inverse(T.apply(G)), rtol=1e-5, atol=1e-5)
    assert torch.equal(buf[:5], torch.full((5,), 7.0))
    # the dominant directions are scaled down, the complement is untouched
    assert (T.d <= 1.0 + 1e-6).all()


@pytest.mark.parametrize("power", [0.5, 0.25])
def test_transform_matches_formula_in_fp64(power):
    A = _factors()["full"]
    r, damp = 6, 1e-2
    T = build_transform(A, r, damp, power)
    lam, U = torch.linalg.eigh(A)
    lam, U = lam.flip(0), U.flip(1)
    ref_d = ((lam[r:].mean() + damp) / (lam[:r] + damp)) ** power
    ref = torch.eye(48, dtype=torch.float64) + U[:, :r] @ torch.diag(ref_d - 1) @ U[:, :r].T
    torch.testing.assert_close(T.dense().double(), ref, rtol=0, atol=1e-5)


def _build_geo(rank, world, overrides, corrupt=False):
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import train_step

    cfg = tiny_cfg("comm.transform=geo", "geo.rank=8", "geo.refresh_interval=2", *overrides)
    pctx = pctx_for(1)
    model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    return cfg, pctx, model, reducer, sync, opt, train_step


def _consistency(rank, world):
    cfg, pctx, model, reducer, sync, opt, train_step = _build_geo(rank, world, ["comm.dtype=fp8_e4m3"])
    geo = reducer.geo
    mb = rank_micro_batches(global_batch(cfg, 0), 2, rank, world)  # different data on each rank
    train_step(StepContext(model, sync, opt, pctx, 1.0, geo=geo), 0, mb)
    sums = {n: t.checksum() for n, t in geo.transforms.items()}
    # now corrupt one rank's transform and check again
    name = sorted(geo.transforms)[1]
    bad = dict(geo.transforms)
    if rank == 1:
        t = bad[name]
        bad[name] = type(t)(t.U.clone(), t.d * (1 + 1e-6))
    try:
        geo.check_consistent(bad)
        err = None
    except TransformMismatchError as e:
        err = str(e)
    return sums, err, name, geo.last_refresh


def test_rank_consistent_transform_and_mismatch_detection():
    out = run_distributed(_consistency, 2)
    assert out[0][0] == out[1][0] and len(out[0][0]) == 2  # tiny model: 2 down projections
    for _sums, err, name, last in out:
        assert last == 0
        assert err is not None and name in err and "differs across DP ranks" in err


def _exact_wire(rank, world):
    """fp32 wire + geo: the transform alone must not change the reduced gradient."""
    cfg, pctx, model, reducer, sync, opt, _ = _build_geo(
        rank, world, ["comm.dtype=fp32", "parallel.distributed_optimizer=false"]
    )
    geo = reducer.geo
    mb = rank_micro_batches(global_batch(cfg, 0), 8 // world, rank, world)[0]
    geo.arm()
    model(mb["tokens"], mb["labels"]).mean()
    geo.disarm()
    geo.refresh(0)
    sync.start_step(defer=True)
    model(mb["tokens"], mb["labels"]).mean().backward()
    local = {n: p.main_grad.clone().double() for n, p in model.named_parameters()}
    sync.finish()
    reduced = {n: p.main_grad.clone().double() for n, p in model.named_parameters()}
    assert all(t.U.shape[1] == 8 for t in geo.transforms.values())
    return local, reduced, sorted(geo.params)


def test_geo_with_exact_wire_equals_fp64_average():
    out = run_distributed(_exact_wire, 2)
    names = out[0][2]
    for n in out[0][0]:
        ref = (out[0][0][n] + out[1][0][n]) / 2
        for _, reduced, _ in out:
            rel = (reduced[n] - ref).norm() / ref.norm().clamp(min=1e-30)
            assert rel < 1e-5, (n, rel.item(), n in names)


def _rebase(rank, world):
    cfg, pctx, model, reducer, sync, opt, train_step = _build_geo(
        rank, world, ["comm.dtype=fp8_e4m3", "comm.error_feedback=true"]
    )
    geo = reducer.geo
    for step in range(2):  # refresh at step 0; builds a residual at steps 0 and 1
        mb = rank_micro_batches(global_batch(cfg, step), 2, rank, world)
        train_step(StepContext(model, sync, opt, pctx, 1.0, geo=geo), step, mb)
    key, slots = next(iter(reducer.transform.slots.items()))
    name, off, rows, cols = slots[0]
    residual = reducer.state_dict()["residuals"][key]
    before = residual[off : off + rows * cols].view(rows, cols).clone().double()
    old = geo.transforms[name]
    other = residual.clone()
    mb = rank_micro_batches(global_batch(cfg, 2), 2, rank, world)
    geo.arm()
    model(mb[0]["tokens"], mb[0]["labels"])
    geo.disarm()
    geo.refresh(2)
    new = geo.transforms[name]
    after = residual[off : off + rows * cols].view(rows, cols).double()
    # R T_old^-1 (the residual in gradient coordinates) is unchanged by the re-basing
    grad_coords_before = old.apply_inverse(before.float()).double()
    grad_coords_after = new.apply_inverse(after.float()).double()
    mask = torch.ones_like(other, dtype=torch.bool)
    for _, o, r_, c_ in slots:
        mask[o : o + r_ * c_] = False
    untouched = torch.equal(residual[mask], other[mask])
    return before.abs().max().item(), (grad_coords_after - grad_coords_before).abs().max().item(), untouched


def test_error_feedback_rebase_is_exact():
    for size, diff, untouched in run_distributed(_rebase, 2):
        assert size > 0  # there was a residual to re-base
        assert diff <= 1e-5 * size + 1e-12  # nothing spurious injected
        assert untouched  # non-geo parameters' residuals are left alone


def _factors_tp(rank, world, tp):
    cfg = tiny_cfg("comm.transform=geo", "geo.rank=4", "comm.dtype=fp32", "optimizer.name=adamw")
    from megatron_geo.training.setup import build_model_and_optimizer

    pctx = pctx_for(tp)
    model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    geo = reducer.geo
    batch = global_batch(cfg, 0)
    mb = rank_micro_batches(batch, 8 // pctx.dp_size, pctx.dp_rank, pctx.dp_size)[0]
    geo.arm()
    model(mb["tokens"], mb["labels"])
    geo.disarm()
    factors = geo.stats.reduce(pctx.dp_group)
    geo.refresh(0)
    dense = {n: t.dense() for n, t in geo.transforms.items()}
    return pctx.tp_rank, factors, dense


def test_tp2_geo_is_block_diagonal_of_the_full_factor():
    """TP=2 x DP=2: each row-parallel slice's factor is the matching diagonal block of the TP=1 factor
    (statistics reduced over DP only), and its transform is the one built from that block."""
    ((_, full, _),) = run_distributed(_factors_tp, 1, 1)
    out = run_distributed(_factors_tp, 4, 2)
    for tp_rank, factors, dense in out:
        for name, A in factors.items():
            n = A.shape[0]
            block = full[name][tp_rank * n : (tp_rank + 1) * n, tp_rank * n : (tp_rank + 1) * n]
            torch.testing.assert_close(A, block, rtol=1e-4, atol=1e-6)
            ref = build_transform(block, 4, 1e-3 * block.diagonal().mean().item()).dense()
            torch.testing.assert_close(dense[name], ref, rtol=0, atol=2e-3)


def _auto(rank, world):
    from megatron_geo.model import Llama

    cfg = tiny_cfg()
    pctx = pctx_for(1)
    model = Llama(cfg.model, pctx.tp_group, 0)
    logs = []
    geo = geo_state(
        model,
        pctx.dp_group,
        layers="layers.*.weight",
        rank=4,
        refresh_interval=5,
        select="auto",
        num_layers=3,
        profile_steps=2,
        log=logs.append,
    )
    names = sorted(geo.candidates)
    # rank-dependent profiles: rank 0 alone would pick names[0..2], the DP sum picks names[-3:]
    for step in range(2):
        assert not geo.is_refresh_step(step)
        for i, n in enumerate(names):
            g = torch.zeros(100)
            hits = (3 - i) if rank == 0 else 3 * i  # number of underflowing non-zero entries
            g[:50] = 1.0
            g[50 : 50 + hits] = 1e-9
            geo.record_bound_hits(n, g)
        geo.end_profiled_step()
    assert geo.is_refresh_step(2)  # choosing happens here, then the first refresh
    return sorted(geo.selected), logs, names


def test_auto_selection_is_rank_consistent():
    """Summed over DP the hit counts are 3 + 2 i, so the last three candidates win on every rank,
    although rank 0's own profile ranks the first three highest."""
    out = run_distributed(_auto, 2)
    names = out[0][2]
    for selected, _logs, _ in out:
        assert selected == sorted(names[-3:])
    assert "after 2 profiled steps" in out[0][1][0]


def test_sketch_transform_is_exact_for_low_rank_factors():
    """Nystrom from Y = A Omega recovers A exactly when rank(A) <= k: same transform as the full factor."""
    from megatron_geo.geometry.transform import build_transform_from_sketch, sketch_matrix

    A = _factors()["rank-deficient"]  # rank 5, d_in 48
    om = sketch_matrix(48, 16, seed=3)
    damp = 1e-3 * A.diagonal().mean().item()
    full = build_transform(A, 4, damp)
    sk = build_transform_from_sketch(A.float() @ om, om, A.trace().item(), 4, damp)
    torch.testing.assert_close(sk.dense(), full.dense(), rtol=0, atol=1e-4)


def _sketch_train(rank, world):
    cfg, pctx, model, reducer, sync, opt, train_step = _build_geo(
        rank, world, ["comm.dtype=fp8_e4m3", "geo.statistics=sketch", "geo.sketch_size=16"]
    )
    geo = reducer.geo
    for step in range(3):
        mb = rank_micro_batches(global_batch(cfg, step), 2, rank, world)
        res = train_step(StepContext(model, sync, opt, pctx, 1.0, geo=geo), step, mb)
    return res.loss, {n: t.checksum() for n, t in geo.transforms.items()}, list(geo.stats.sketches)


def test_sketch_statistics_train_and_stay_rank_consistent():
    (l0, c0, s0), (l1, c1, s1) = run_distributed(_sketch_train, 2)
    assert l0 == l1 and c0 == c1 and len(s0) == 2


# -- geo.power_search ---------------------------------------------------------------------------------
def _torch_fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Independent reference: tensor-scaled E4M3 through torch's own cast (amax -> 448)."""
    x = x.double()
    scale = x.abs().max() / 448.0
    return (x / scale).clamp(-448, 448).float().to(torch.float8_e4m3fn).double() * scale


def test_with_power_matches_the_formula_and_zero_is_identity():
    from megatron_geo.geometry.power_search import with_power

    A = _factors()["full"]
    base = build_transform(A, 6, 1e-2, power=1.0)
    for p in (0.5, 0.25, 1.0):
        ref = build_transform(A, 6, 1e-2, power=p)
        torch.testing.assert_close(with_power(base, p).dense(), ref.dense(), rtol=0, atol=1e-6)
    ident = with_power(base, 0.0)
    assert ident.U.shape == (48, 0)
    G = torch.randn(5, 48)
    assert torch.equal(ident.apply(G), G) and torch.equal(ident.apply_inverse(G), G)
    with pytest.raises(ValueError, match="power 1.5"):
        with_power(base, 1.5)


def test_roundtrip_errors_match_an_fp64_reference_with_torch_casts():
    from megatron_geo.comm.roundtrip import quantize_roundtrip
    from megatron_geo.geometry.power_search import roundtrip_errors

    A = _factors()["full"]
    base = build_transform(A, 8, 1e-3 * A.diagonal().mean().item(), power=1.0)
    g = torch.Generator().manual_seed(3)
    G = torch.randn(20, 48, generator=g) @ A.float()  # energy along A's dominant directions
    powers = [0.5, 0.25, 0.0]
    got = roundtrip_errors(G, base, powers, lambda x: quantize_roundtrip(x, "fp8_e4m3:tensor"))
    U, d = base.U.double(), base.d.double()
    eye = torch.eye(48, dtype=torch.float64)
    for j, p in enumerate(powers):
        T = eye + U @ torch.diag(d**p - 1) @ U.T
        Tinv = eye + U @ torch.diag(d**-p - 1) @ U.T
        ref = ((_torch_fp8_roundtrip(G.double() @ T) @ Tinv) - G.double()).pow(2).sum().item()
        assert got[j].item() == pytest.approx(ref, rel=1e-3), (p, got[j].item(), ref)
    # Euclidean (p = 0) is exactly one tensor-scaled E4M3 round trip
    assert got[2].item() == pytest.approx((_torch_fp8_roundtrip(G) - G.double()).pow(2).sum().item(), rel=1e-6)


def test_pick_powers_takes_the_minimum_and_the_earliest_on_ties_or_nonfinite():
    from megatron_geo.geometry.power_search import pick_powers

    inf = float("inf")
    errs = torch.tensor([[3.0, 1.0, 2.0], [1.0, 1.0, 5.0], [inf, inf, inf], [inf, 4.0, 4.0]], dtype=torch.float64)
    assert pick_powers(errs, [0.5, 0.25, 0.0]) == [0.25, 0.5, 0.5, 0.25]


def _power_search(rank, world):
    import torch.distributed as dist

    cfg, pctx, model, reducer, sync, opt, train_step = _build_geo(
        rank, world, ["comm.dtype=fp8_e4m3", "geo.power_search=0.5,0.25,0"]
    )
    geo = reducer.geo
    seen, logs = {}, []
    geo.log = logs.append
    orig = geo._search_powers

    def spy(transforms, step):
        seen[step] = (
            {n: (t.U.clone(), t.d.clone()) for n, t in transforms.items()},
            {n: geo.grad_of(n).clone() for n in geo.selected},
        )
        orig(transforms, step)
        seen[step] += (dict(geo.powers),)

    geo._search_powers = spy
    losses = []
    for step in range(4):  # refreshes at steps 0 and 2
        mb = rank_micro_batches(global_batch(cfg, step), 2, rank, world)  # different data on each rank
        losses.append(train_step(StepContext(model, sync, opt, pctx, 1.0, geo=geo), step, mb).loss)
    out = {}
    for step, (bases, grads, chosen) in seen.items():
        gathered = {}
        for n, G in grads.items():
            parts = [torch.empty_like(G) for _ in range(world)]
            dist.all_gather(parts, G.contiguous())
            gathered[n] = parts
        out[step] = (bases, gathered, chosen)
    return out, {n: t.checksum() for n, t in geo.transforms.items()}, losses, logs


def test_power_search_picks_the_dp_summed_best_power_on_every_rank():
    (o0, c0, l0, logs0), (o1, c1, l1, logs1) = run_distributed(_power_search, 2)
    assert sorted(o0) == [0, 2] and c0 == c1 and l0 == l1
    assert all(torch.isfinite(torch.tensor(l0)))
    assert any(m.startswith("step 3: geo.power_search") for m in logs0)  # the refresh of step index 2, 1-based
    powers = [0.5, 0.25, 0.0]
    decided = 0
    for step in (0, 2):
        bases, grads, chosen = o0[step]
        assert chosen == o1[step][2]  # the same choice on both ranks
        for n, (U, d) in bases.items():
            U, d = U.double(), d.double()
            eye = torch.eye(U.shape[0], dtype=torch.float64)
            errs = []
            for p in powers:
                T = eye + U @ torch.diag(d**p - 1) @ U.T
                Tinv = eye + U @ torch.diag(d**-p - 1) @ U.T
                errs.append(
                    sum(
                        ((_torch_fp8_roundtrip(G.double() @ T) @ Tinv) - G.double()).pow(2).sum().item()
                        for G in grads[n]
                    )
                )
            best = min(range(3), key=lambda j: errs[j])
            second = sorted(errs)[1]
            if second > errs[best] * (1 + 1e-3):  # a clear winner: the trainer must pick it
                assert chosen[n] == powers[best], (step, n, errs, chosen[n])
                decided += 1
    assert decided >= 2


def _owner_refresh(rank, world):
    import torch.distributed as dist

    cfg, pctx, model, reducer, sync, opt, _ = _build_geo(rank, world, ["comm.dtype=fp8_e4m3"])
    geo = reducer.geo
    mb = rank_micro_batches(global_batch(cfg, 0), 1, rank, world)[0]  # different data on each rank
    geo.arm()
    model(mb["tokens"], mb["labels"]).mean()
    geo.disarm()
    local = {n: (geo.stats.sums[n].clone().double(), geo.stats.counts[n]) for n in geo.selected}
    geo.refresh(0)
    # reference: every rank sums all statistics itself (FP64) and builds every transform
    ref = {}
    for n, (s, c) in sorted(local.items()):
        cnt = torch.tensor([c], dtype=torch.float64)
        dist.all_reduce(s)
        dist.all_reduce(cnt)
        A = s / cnt
        ref[n] = build_transform(A, cfg.geo.rank, cfg.geo.damping * A.diagonal().mean().item()).dense()
    return (
        geo.owners(),
        {n: t.dense() for n, t in geo.transforms.items()},
        ref,
        {n: t.checksum() for n, t in geo.transforms.items()},
    )


def test_owner_decomposes_and_broadcasts_the_transform_of_the_dp_summed_factor():
    out = run_distributed(_owner_refresh, 3)
    owners = out[0][0]
    assert sorted(owners.values()) == [0, 1]  # 2 layers over 3 ranks: round robin, rank 2 owns none
    assert out[0][3] == out[1][3] == out[2][3]  # the owner's exact bytes everywhere
    for _, dense, ref, _ in out:
        for n in ref:
            torch.testing.assert_close(dense[n].double(), ref[n].double(), rtol=0, atol=1e-5)


def _power_auto_gain(rank, world):
    import torch.distributed as dist

    cfg, pctx, model, reducer, sync, opt, train_step = _build_geo(
        rank,
        world,
        [
            "comm.dtype=fp8_e4m3",
            "geo.power=auto",
            "geo.select=gain",
            "geo.num_layers=1",
            "geo.layers=layers.*.mlp.down_proj.weight,layers.*.mlp.up_proj.weight",
        ],
    )
    geo = reducer.geo
    seen, orig = {}, geo._auto_powers

    def spy(transforms, moments, d1, step):
        seen[step] = (
            {n: (t.U.clone(), t.d.clone()) for n, t in transforms.items()},
            {n: geo.grad_of(n).clone() for n in geo.selected},
        )
        orig(transforms, moments, d1, step)

    geo._auto_powers = spy
    for step in range(3):  # refreshes at steps 0 and 2
        mb = rank_micro_batches(global_batch(cfg, step), 2, rank, world)  # different data on each rank
        train_step(StepContext(model, sync, opt, pctx, 1.0, geo=geo), step, mb)
    bases, grads = seen[2]
    gathered = {}
    for n, G in grads.items():
        parts = [torch.empty_like(G) for _ in range(world)]
        dist.all_gather(parts, G.contiguous())
        gathered[n] = parts
    return (
        bases,
        gathered,
        dict(geo.powers),
        dict(geo.diagnostics),
        sorted(geo.active),
        {n: (t.U.shape[1], t.checksum()) for n, t in geo.transforms.items()},
    )


def test_power_auto_and_select_gain_follow_the_slope_rule_on_every_rank():
    import numpy as np

    from megatron_geo.geometry.refresh_stats import MIN_AUTO_GAIN

    (b0, g0, p0, diag0, act0, tr0), (_, _, p1, diag1, act1, tr1) = run_distributed(_power_auto_gain, 2)
    assert p0 == p1 and diag0 == diag1 and act0 == act1 and tr0 == tr1 and len(p0) == 4
    gains = {}
    for n, (U, d) in b0.items():
        U, d = U.double(), d.double()
        e = sum((G.double() @ U).pow(2).sum(0) for G in g0[n])  # DP-summed energy along u_i
        E = sum(G.double().pow(2).sum() for G in g0[n])
        d_in, r = U.shape
        x = np.concatenate([-np.log(d.numpy()), [0.0]])  # log((lambda + damping) / (ref + damping))
        y = np.concatenate([np.log(e.numpy()), [np.log(float(E - e.sum()) / (d_in - r))]])
        s = np.polyfit(x, y, 1)[0]  # independent least-squares slope
        assert diag0[n]["slope"] == pytest.approx(s, abs=1e-6)
        p_rule = min(max(s / 4, 0.0), 0.5)
        dp = d**p_rule
        T = torch.eye(d_in, dtype=torch.float64) + U @ torch.diag(dp - 1) @ U.T
        Tinv = torch.linalg.inv(T)
        col = sum((G.double() @ T).pow(2).sum(0) for G in g0[n])  # wire column energies
        ratio = math.sqrt(float((col * Tinv.pow(2).sum(1)).sum() / E))  # relative-precision model
        gain = 1 - ratio if p_rule > 0 else 0.0
        assert diag0[n]["pred_gain"] == pytest.approx(gain, abs=1e-6)  # of the slope rule's transform
        # kept Euclidean (p = 0) when the predicted gain is below the floor
        want_p = p_rule if gain >= MIN_AUTO_GAIN else 0.0
        assert p0[n] == pytest.approx(want_p, abs=1e-6) and diag0[n]["power"] == pytest.approx(want_p, abs=1e-6)
        gains[n] = gain if want_p > 0 else 0.0
        assert {"ipr", "cancel", "sat", "flush", "sat_euclid", "flush_euclid", "power", "active"} <= set(diag0[n])
    best = max(gains, key=gains.get)
    want = [best] if gains[best] > 0 else []
    assert act0 == want  # select=gain keeps the best positive one
    assert all((tr0[n][0] > 0) == (n in want) for n in tr0)  # the others stay Euclidean (identity)


def test_the_auto_power_log_line_summarises_many_layers_per_kind():
    """Up to 16 layers: one name=p each; beyond, one entry per layer kind with its upper median (as
    statistics.median_high), range and count of Euclidean layers."""
    import statistics

    from megatron_geo.geometry.geo import _powers_line

    few = {"layers.0.mlp.down_proj.weight": 0.2, "layers.1.mlp.down_proj.weight": 0.0}
    assert _powers_line(few) == "layers.0.mlp.down_proj=0.2, layers.1.mlp.down_proj=0"
    many = {f"layers.{i}.attn.q_proj.weight": (i % 4) / 8 for i in range(20)}
    many["output.weight"] = 0.25
    ps = [(i % 4) / 8 for i in range(20)]
    line = _powers_line(many)
    assert line.startswith(f"attn.q_proj x20: median {statistics.median_high(ps):.3g} [0, 0.375], 5 Euclidean")
    assert line.endswith("output x1: median 0.25 [0.25, 0.25], 0 Euclidean")


def test_geo_layers_select_linear_weights_only_never_the_embedding_table(world):
    from megatron_geo.geometry import select_parameters
    from megatron_geo.model.llama import Llama

    cfg = tiny_cfg()
    model = Llama(cfg.model, world, 0)
    every = select_parameters(model, "*")
    m = cfg.model
    assert sorted(every) == sorted(n for n, p in model.named_parameters() if p.ndim == 2 and n != "embed.weight")
    assert len(every) == 7 * m.num_layers + 1  # q, k, v, o, gate, up, down per layer and the output layer
    # the embedding's input is token ids: never an input-side transform, even named alone (seq length != hidden)
    with pytest.raises(ValueError, match=r"'embed\.weight' matches no linear weight \(embed\.weight is not a linear"):
        select_parameters(model, "embed.weight")
