"""Low-precision reducers against an FP64 reference reduce of the same per-rank inputs (gloo, 2-3 ranks).

The deterministic paths (FP8 nearest, tensor or block scaling, per-rank or shared scales) are checked
against an independent re-implementation in this file built only on torch's own FP8 casts; the
stochastic and NVFP4 paths against error bounds of the format.
"""

import math

import pytest
import torch

from dist_harness import run_distributed
from helpers import dp_pctx, pctx_for
from megatron_geo.comm import build_reducer
from megatron_geo.config.schema import CommConfig
from megatron_geo.distributed.shard_plan import plan_shards

FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
# parameters of one bucket: a matrix, a 1-D vector, a tiny one, a zero-size one, a larger one
NUMELS = [40, 7, 1, 0, 61]


def _rank_grads(world: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world):
        x = torch.randn(sum(NUMELS), generator=g, dtype=torch.float64)
        x[:5] *= 50  # anisotropy: a few large entries set the scale
        out.append(x * (1000.0 ** (r % 2)))  # ranks differ by 1000x
    return out


def _layout(world, align):
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, align)
    return plan


def _to_buffer(flat: torch.Tensor, plan) -> torch.Tensor:
    buf = torch.zeros(plan.buffer_numel, dtype=torch.float64)
    pos = 0
    for off, n in zip(plan.offsets, NUMELS):
        buf[off : off + n] = flat[pos : pos + n]
        pos += n
    return buf


def _reference_fp8(world, fmt, scaling, block, sync, plan) -> torch.Tensor:
    """Independent FP8 reduce: per-rank scales (or MAX-shared), torch casts, FP64 sum, / world."""
    dt, fmax = FP8[fmt]
    bufs = [_to_buffer(x, plan) for x in _rank_grads(world)]

    def group_scales(buf):
        if scaling == "block":
            amax = buf.view(-1, block).abs().amax(1)
            sc = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
            return sc.repeat_interleave(block), amax.repeat_interleave(block)
        am = torch.zeros_like(buf)
        for off, n in zip(plan.offsets, NUMELS):
            if n:
                a = buf[off : off + n].abs().max()
                am[off : off + n] = a
        return torch.where(am > 0, am / fmax, torch.ones_like(am)), am

    scales = [group_scales(b.float().double())[0] for b in bufs]
    if sync:
        amax = torch.stack([group_scales(b.float().double())[1] for b in bufs]).max(0).values
        shared = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
        scales = [shared] * world
    total = torch.zeros_like(bufs[0])
    for b, s in zip(bufs, scales):
        s32 = s.float()
        q = (b.float() / s32).clamp(-fmax, fmax).to(dt).float() * s32
        total += q.double()
    return total / world


def _run(rank, world, comm_kwargs, mode, steps=1, inputs=None):
    pctx = pctx_for(1)
    comm = CommConfig(**comm_kwargs)
    red = build_reducer(comm, pctx, seed=5)
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
    bucket = red.register_bucket(0, plan.offsets, NUMELS, plan.chunk, "cpu")
    outs = []
    for step in range(steps):
        flat = (inputs[step] if inputs is not None else _rank_grads(world, step)[rank]).float()
        buf = _to_buffer(flat.double(), plan).float()
        op = red.reduce_scatter if mode == "rs" else red.all_reduce
        op(buf, bucket).wait()
        outs.append(buf.clone())
    resid = red.residuals.get(0).clone() if red.residuals else None
    return outs, red.bytes_sent, plan.chunk, resid, plan.offsets


def _run_rs_ar(rank, world, kw):
    return _run(rank, world, kw, "rs"), _run(rank, world, kw, "ar")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    "fmt,scaling,sync",
    [
        ("fp8_e4m3", "tensor", "none"),
        ("fp8_e5m2", "tensor", "none"),
        ("fp8_e4m3", "block", "none"),
        ("fp8_e4m3", "tensor", "max"),
    ],
)
def test_fp8_reduce_scatter_matches_independent_reference(world, fmt, scaling, sync):
    kw = dict(dtype=fmt, scaling=scaling, block_size=16, scale_sync=sync)
    both = run_distributed(_run_rs_ar, world, kw)
    results, ar = [b[0] for b in both], [b[1] for b in both]
    chunk = results[0][2]
    # tensor-scaled FP8 keeps parameters 16-aligned (its scales reach the elements one per 16-element block)
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, 16)
    assert plan.chunk == chunk
    ref = _reference_fp8(world, fmt, scaling, 16, sync == "max", plan)
    for r, (outs, _sent, _, _, _) in enumerate(results):
        got = outs[0][r * chunk : (r + 1) * chunk].double()
        torch.testing.assert_close(got, ref[r * chunk : (r + 1) * chunk], rtol=1e-6, atol=1e-9)
    # all-reduce: bitwise identical on every rank
    for outs, _, _, _, _ in ar:
        assert torch.equal(outs[0], ar[0][0][0])


EXTRAS = [
    {},
    {"transform": "hadamard", "hadamard_block": 16},
    {"rounding": "stochastic"},
    {"error_feedback": True},
    # a rotation block larger than the codec's own block (NVFP4: 16 elements)
    {"transform": "hadamard", "hadamard_block": 128, "error_feedback": True},
]


def _run_many(rank, world, fmt):
    return [_run(rank, world, dict(dtype=fmt, **extra), "ar") for extra in EXTRAS]


@pytest.mark.parametrize("fmt,bound", [("fp8_e4m3", 0.05), ("fp8_e5m2", 0.15), ("nvfp4", 0.2)])
def test_lowp_all_reduce_close_to_fp64_and_identical(fmt, bound):
    """Plain, Hadamard, stochastic rounding and error feedback (one spawn per format, world size 3)."""
    world = 3
    per_rank = run_distributed(_run_many, world, fmt)
    ref_flat = torch.stack(_rank_grads(world)).mean(0)
    for i, extra in enumerate(EXTRAS):
        out = [r[i] for r in per_rank]
        for outs, _, _, _, _ in out:
            assert torch.equal(outs[0], out[0][0][0]), f"{extra}: all ranks bitwise identical"
        offsets = out[0][4]  # compare on the parameter elements (padding positions are zero in both)
        got = torch.cat([out[0][0][0][off : off + n] for off, n in zip(offsets, NUMELS)]).double()
        rel = (got - ref_flat).norm() / ref_flat.norm()
        assert rel < bound, f"{fmt} {extra}: RelL2 {rel:.4f} >= {bound}"


def test_identical_inputs_round_trip_and_bytes():
    world = 2
    x = _rank_grads(1)[0].float()
    kw = dict(dtype="fp8_e4m3")
    out = run_distributed(_run, world, kw, "rs", 1, [x])
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, 16)
    buf = _to_buffer(x.double(), plan).float()
    for r, (outs, sent, chunk, _, _) in enumerate(out):
        got = outs[0][r * chunk : (r + 1) * chunk]
        want = buf[r * chunk : (r + 1) * chunk]
        # identical inputs: the average equals one rank's round trip; E4M3 relative step 2^-3 of the group max
        assert ((got - want).abs() <= want.abs().max() * 2**-4 + 1e-12).all()
        # bytes = codes + one FP32 scale per segment of each other rank's chunk, as handed to all_to_all
        from megatron_geo.comm.scale_layout import build_scale_layout

        extents = [-(-n // 16) * 16 for n in NUMELS]
        lay = build_scale_layout(plan.offsets, extents, chunk, world, "tensor", 128, "cpu", granule=16)
        assert sent == (world - 1) * (chunk + 4 * lay.K)


def test_error_feedback_telescopes_and_stays_bounded():
    """Same gradient stream on both ranks: sum of outputs == sum of inputs - last residual."""
    world, steps = 2, 12
    g = torch.Generator().manual_seed(9)
    stream = [torch.randn(sum(NUMELS), generator=g) * (1 + 0.1 * t) for t in range(steps)]
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, 16)
    truth = torch.stack([_to_buffer(s.double(), plan) for s in stream]).sum(0)
    rs_out = run_distributed(_run, world, dict(dtype="fp8_e4m3", error_feedback=True), "rs", steps, stream)
    for r, (o, _, c, res, _) in enumerate(rs_out):
        s = torch.stack(o).double()[:, r * c : (r + 1) * c].sum(0)
        t = truth[r * c : (r + 1) * c]
        torch.testing.assert_close(s, t - res.double()[r * c : (r + 1) * c], rtol=1e-5, atol=1e-5)
        # bounded: the residual never exceeds one quantisation step of the current scale
        assert res.abs().max() <= max(x.abs().max() for x in stream) * 2 * 2**-3


def _nonfinite(rank, world, dtype):
    from helpers import global_batch, rank_micro_batches, tiny_cfg
    from megatron_geo.training.setup import build_model_and_optimizer

    cfg = tiny_cfg(f"comm.dtype={dtype}", "parallel.overlap_grad_reduce=false")
    pctx = pctx_for(1)
    model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
    mb = rank_micro_batches(global_batch(cfg, 0), 4, rank, world)[0]
    norms = []
    for value in (float("nan"), float("inf"), float("-inf"), 1.0):
        sync.start_step()
        model(mb["tokens"], mb["labels"]).mean().backward()
        if rank == 1:  # one rank only; the last value (finite) is the control
            next(iter(model.parameters())).main_grad.view(-1)[3] = value
        sync.finish()
        norms.append(opt.grad_norm())
    # the same through a full train step: every rank skips the update; replicas stay identical
    from megatron_geo.training.step import StepContext, train_step

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    p0 = next(iter(model.parameters()))
    handle = p0.register_hook(lambda g: g * float("nan")) if rank == 1 else None
    res = train_step(StepContext(model, sync, opt, pctx, 1.0), 0, [mb])
    if handle is not None:
        handle.remove()
    unchanged = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return norms, res.skipped, unchanged, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "nvfp4", "bf16"])
def test_nonfinite_on_one_rank_is_seen_by_all(dtype):
    """NaN, +inf, -inf on rank 1 only: every rank's all-reduced gradient norm is non-finite."""
    out = run_distributed(_nonfinite, 2, dtype)
    for norms, skipped, unchanged, _params in out:
        assert [math.isfinite(n) for n in norms] == [False, False, False, True], norms
        assert skipped and unchanged
    for n in out[0][3]:
        assert torch.equal(out[0][3][n], out[1][3][n])


def _train_identical(rank, world, overrides):
    from helpers import global_batch, rank_micro_batches, tiny_cfg
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    cfg = tiny_cfg(*overrides)
    pctx = pctx_for(1)
    model, _, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    ctx = StepContext(model, sync, opt, pctx, 1.0)
    losses, sent = [], []
    for step in range(8):
        mbs = rank_micro_batches(global_batch(cfg, step % 2), 2, rank, world)
        losses.append(train_step(ctx, step, mbs).loss)
        sent.append(reducer.reset_bytes())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, sent


@pytest.mark.parametrize(
    "overrides",
    [
        ["comm.dtype=fp8_e4m3", "comm.error_feedback=true"],
        ["comm.dtype=nvfp4", "parallel.distributed_optimizer=false"],
        [
            "comm.dtype=fp8_e4m3",
            "comm.scaling=block",
            "comm.block_size=32",
            "comm.transform=hadamard",
            "comm.hadamard_block=64",
            "comm.rounding=stochastic",
        ],
        ["comm.dtype=fp8_e5m2", "comm.scale_sync=max", "optimizer.name=muon"],
        ["comm.dtype=nvfp4", "comm.transform=hadamard"],
    ],
    ids=["fp8-ef", "nvfp4-allreduce", "fp8-block-hadamard-sr", "e5m2-shared-muon", "nvfp4-hadamard128"],
)
def test_dp2_training_keeps_replicas_identical(overrides):
    out = run_distributed(_train_identical, 2, overrides)
    (l0, p0, s0), (l1, p1, s1) = out
    assert l0 == l1
    for n in p0:
        assert torch.equal(p0[n], p1[n]), n
    assert all(math.isfinite(x) for x in l0) and l0[-1] < l0[0]  # the two alternating batches get learned
    assert min(s0) > 0


def _tiny_bucket(rank, world, dtype):
    """A bucket smaller than the DP group: some ranks' shards hold only padding (empty shards)."""
    pctx = pctx_for(1)
    red = build_reducer(CommConfig(dtype=dtype), pctx, seed=1)
    numels = [2, 0]
    plan = plan_shards(numels, [False, False], world, red.alignment())
    red.register_bucket(0, plan.offsets, numels, plan.chunk, "cpu")
    buf = torch.zeros(plan.buffer_numel)
    buf[plan.offsets[0] : plan.offsets[0] + 2] = torch.tensor([3.0, -0.5]) * (rank + 1)
    red.all_reduce(buf, 0).wait()  # by its key
    return buf[plan.offsets[0] : plan.offsets[0] + 2], plan.chunk


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "nvfp4", "bf16", "fp32"])
def test_empty_shards_world3(dtype):
    ref = torch.tensor([3.0, -0.5]) * 2.0  # mean of (1, 2, 3) x [3, -0.5]
    out = run_distributed(_tiny_bucket, 3, dtype)
    for got, _chunk in out:
        assert torch.equal(got, out[0][0])
        # E4M3: 3 mantissa bits -> relative step 2^-3 of the group max; NVFP4: 2^-1 (E2M1) of the block max
        tol = {"fp8_e4m3": 2**-4, "nvfp4": 0.25, "bf16": 2**-8, "fp32": 1e-7}[dtype] * 6.0
        assert (got - ref).abs().max() <= tol, (dtype, got, ref)


def test_nonfinite_actions():
    from megatron_geo.training.trainer import NonFiniteGradientError, handle_nonfinite

    red = build_reducer(CommConfig(dtype="fp8_e4m3", error_feedback=True), dp_pctx(2))
    red.register_bucket(0, [0], [4], 16, "cpu")  # one 4-element parameter; chunks of the 16-element granule
    red.residuals[0].fill_(float("nan"))
    handle_nonfinite(7, float("nan"), "skip", red)
    assert torch.equal(red.residuals[0], torch.zeros(32))
    with pytest.raises(NonFiniteGradientError, match="step 7: the gradient norm is inf .* train.nonfinite=stop"):
        handle_nonfinite(7, float("inf"), "stop", red)


def _run_uneven(rank, world, bounds):
    comm = CommConfig(dtype="fp8_e4m3", scaling="block", block_size=16)
    red = build_reducer(comm, pctx_for(1), seed=5)
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, red.alignment())
    bucket = red.register_bucket(0, plan.offsets, NUMELS, bounds, "cpu")
    buf = _to_buffer(_rank_grads(world)[rank], plan).float()
    buf = torch.cat([buf, torch.zeros(bounds[-1] - buf.numel())])
    red.reduce_scatter(buf, bucket).wait()
    return buf, red.bytes_sent


@pytest.mark.parametrize("world", [2, 3])
def test_block_scales_of_uneven_ranges_travel_unpadded(world):
    """Uneven owner ranges (whole matrices, GeoFP8 rows): each rank is sent the scales of its own blocks only, so
    a rank sends its codes plus one FP32 scale per block of every other range (not the longest range's count per
    destination), and the reduced values are the independent reference's."""
    plan = plan_shards(NUMELS, [False] * len(NUMELS), world, 16)
    total = -(-plan.buffer_numel // 16) * 16 + 16 * 6
    # rank 0 owns one block, rank 1 (of 3) none, the last rank the rest
    bounds = [0, 16] + ([16] if world == 3 else []) + [total]
    out = run_distributed(_run_uneven, world, bounds)
    ref = _reference_fp8(world, "fp8_e4m3", "block", 16, False, plan)
    ref = torch.cat([ref, torch.zeros(total - ref.numel(), dtype=ref.dtype)])
    for r, (buf, sent) in enumerate(out):
        lo, hi = bounds[r], bounds[r + 1]
        torch.testing.assert_close(buf[lo:hi].double(), ref[lo:hi], rtol=1e-6, atol=1e-9)
        others = total - (hi - lo)
        assert sent == others + 4 * (others // 16)
