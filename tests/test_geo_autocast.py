"""GeoFP8 and the Hadamard rotation keep FP32 precision whatever the caller runs under: BF16 autocast around the
forward (the GPU forward has CUDA BF16 autocast; CPU BF16 autocast stands in for it here) and TF32 matmul
settings (``torch.set_float32_matmul_precision("medium")`` / ``allow_tf32=True``, as NGC images may set)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from helpers import geo_state
from megatron_geo.geometry import LowRankTransform

D_FULL, D_SKETCH, K, RANK, TOKENS = 16, 64, 8, 3, 257  # 257 tokens: a count BF16 cannot hold (it rounds to 256)


pytestmark = pytest.mark.usefixtures("one_thread")


class TwoLayers(nn.Module):
    """One layer small enough for the full factor, one sketched (``geo.statistics=auto``: d_in > 4 k)."""

    def __init__(self, device=None):
        super().__init__()
        self.full = nn.Linear(D_FULL, 4, bias=False, device=device)
        self.sk = nn.Linear(D_SKETCH, 4, bias=False, device=device)

    def forward(self, a, b):
        return self.full(a).sum() + self.sk(b).sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(TOKENS, D_FULL, generator=g)
    b = torch.randn(TOKENS, D_SKETCH, generator=g)
    for x in (a, b):  # well-separated dominant directions: the top eigenvectors are stable under FP32 rounding
        x[:, :4] *= torch.tensor([40.0, 20.0, 10.0, 5.0])
    return a, b


def _geo(world, seed=1):
    torch.manual_seed(seed)
    model = TwoLayers()
    geo = geo_state(
        model, world, layers="full.weight,sk.weight", rank=RANK, refresh_interval=1, statistics="auto", sketch_size=K
    )
    g = torch.Generator().manual_seed(2)
    for p in geo.params.values():  # the local gradient a refresh reads (the reducer's main_grad in training)
        p.main_grad = torch.randn(p.shape, generator=g)
    return model, geo


def _collect(model, geo, autocast: bool):
    a, b = _inputs()
    geo.arm()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(a, b)
        geo.disarm()
        geo.refresh(0)  # under the caller's autocast too: the refresh must not care
    return a, b


def _ref_transform(A, rank, damping, power=0.5):
    """FP64 reference of the damped transform T = I + U (D - I) U^T (dense)."""
    lam, U = torch.linalg.eigh(A)
    lam, U = lam.flip(0).clamp(min=0), U.flip(1)
    d = ((lam[rank:].mean() + damping) / (lam[:rank] + damping)) ** power
    return torch.eye(A.shape[0], dtype=torch.float64) + U[:, :rank] @ torch.diag(d - 1) @ U[:, :rank].T


def _ref_sketch_transform(Y, omega, trace, rank, damping, power=0.5):
    """FP64 reference of the Nystrom transform (Tropp et al. 2017, Alg. 3) with FP32's eps for the shift."""
    d_in = Y.shape[0]
    nu = torch.finfo(torch.float32).eps * Y.norm().item() * d_in**0.5
    Yn = Y + nu * omega
    B = omega.T @ Yn
    C = torch.linalg.cholesky(0.5 * (B + B.T))
    F = torch.linalg.solve_triangular(C, Yn.T, upper=False).T
    U, S, _ = torch.linalg.svd(F, full_matrices=False)
    lam = (S**2 - nu).clamp(min=0)
    top = lam[:rank]
    lam_ref = max(trace - top.sum().item(), 0.0) / (d_in - rank)
    d = ((lam_ref + damping) / (top + damping)) ** power
    return torch.eye(d_in, dtype=torch.float64) + U[:, :rank] @ torch.diag(d - 1) @ U[:, :rank].T


def test_refresh_under_bf16_autocast_is_fp32_and_matches_fp64(world):
    model, geo = _geo(world)
    a, b = _collect(model, geo, autocast=True)
    A_ref = a.double().T @ a.double() / TOKENS
    B_ref = b.double().T @ b.double() / TOKENS
    omega = geo.stats.sketches["sk.weight"]
    assert omega.dtype == torch.float32
    # what the hooks accumulated: FP32, the exact token count
    assert all(s.dtype == torch.float32 for s in geo.stats.sums.values())
    assert geo.stats.counts == {"full.weight": float(TOKENS), "sk.weight": float(TOKENS)}
    factors = geo.stats.reduce(world)
    A = factors["full.weight"]
    Y, trace = factors["sk.weight"]
    assert A.dtype == torch.float32 and Y.dtype == torch.float32 and A.shape == (D_FULL, D_FULL)
    Y_ref = B_ref @ omega.double()
    trace_ref = B_ref.trace().item()
    # FP32 rounding of sums over 257 tokens (BF16 matmuls or a BF16 count would be ~1e-2 off)
    torch.testing.assert_close(A.double(), A_ref, rtol=2e-6, atol=2e-6 * A_ref.abs().max().item())
    torch.testing.assert_close(Y.double(), Y_ref, rtol=2e-6, atol=2e-6 * Y_ref.abs().max().item())
    assert trace == pytest.approx(trace_ref, rel=2e-6)
    # the built transforms: FP32, equal to the FP64 construction from the FP64 factors
    T_full, T_sk = geo.transforms["full.weight"], geo.transforms["sk.weight"]
    for t in (T_full, T_sk):
        assert t.U.dtype == torch.float32 and t.d.dtype == torch.float32 and t.U.shape[1] == RANK
    damping_full = 1e-3 * A_ref.diagonal().mean().item()
    torch.testing.assert_close(T_full.dense().double(), _ref_transform(A_ref, RANK, damping_full), rtol=0, atol=2e-5)
    damping_sk = 1e-3 * trace_ref / D_SKETCH
    torch.testing.assert_close(
        T_sk.dense().double(),
        _ref_sketch_transform(Y_ref, omega.double(), trace_ref, RANK, damping_sk),
        rtol=0,
        atol=2e-5,
    )


def test_refresh_under_autocast_equals_refresh_without(world):
    """Same inputs, same model: statistics, transforms and per-layer diagnostics identical with and without
    BF16 autocast around the forward and the refresh (every GeoFP8 computation runs in FP32 either way)."""
    runs = []
    for autocast in (False, True):
        model, geo = _geo(world)
        _collect(model, geo, autocast)
        runs.append(geo)
    plain, auto = runs
    for n in plain.stats.sums:
        assert torch.equal(auto.stats.sums[n], plain.stats.sums[n]), n
        assert auto.stats.traces.get(n) == plain.stats.traces.get(n), n
    for n in plain.transforms:
        assert torch.equal(auto.transforms[n].U, plain.transforms[n].U), n
        assert torch.equal(auto.transforms[n].d, plain.transforms[n].d), n
    assert auto.diagnostics.keys() == plain.diagnostics.keys()
    for n, diag in plain.diagnostics.items():
        for k, v in diag.items():
            assert auto.diagnostics[n][k] == pytest.approx(v, rel=1e-12, nan_ok=True), (n, k)


def test_sketch_shift_uses_fp32_eps_for_any_dtype():
    from megatron_geo.geometry.transform import sketch_shift

    g = torch.Generator().manual_seed(3)
    Y = torch.randn(4096, 8, generator=g, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        Yd = Y.to(dtype)
        want = torch.finfo(torch.float32).eps * Yd.double().norm().item() * 4096**0.5
        assert sketch_shift(Yd) == pytest.approx(want, rel=1e-12), dtype


# -- TF32 / matmul precision ---------------------------------------------------------------------------------------

_MATMULS = {
    torch.matmul,
    torch.mm,
    torch.addmm,
    torch.Tensor.__matmul__,
    torch.Tensor.__rmatmul__,
    torch.Tensor.matmul,
    torch.Tensor.mm,
    torch.Tensor.addmm,
    torch.Tensor.addmm_,
}


def _flags():
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.is_autocast_enabled("cpu"),
    )


class RecordMatmulFlags(TorchFunctionMode):
    """Records the global precision flags (and CPU autocast) at every matmul call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _MATMULS:
            self.seen.append(_flags())
        return func(*args, **(kwargs or {}))


@pytest.fixture
def tf32_on():
    """The caller enabled TF32 (legacy API, as NGC images do); the defaults are put back afterwards."""
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True
    yield ("medium", True, True, False)
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True


EXACT = ("highest", False, False, False)


def _check(rec, outside, what):
    assert rec.seen, f"{what}: no matmul recorded"
    assert set(rec.seen) == {EXACT}, f"{what}: matmul ran with {set(rec.seen)} (want {EXACT})"
    assert _flags() == outside, f"{what}: flags not restored ({_flags()} != {outside})"


def test_transform_and_hadamard_force_highest_precision_and_restore(tf32_on):
    from megatron_geo.comm.lowp import LowPrecisionReducer
    from megatron_geo.config.schema import CommConfig

    g = torch.Generator().manual_seed(4)
    U, _ = torch.linalg.qr(torch.randn(32, 4, generator=g))
    T = LowRankTransform(U.contiguous(), torch.tensor([0.1, 0.2, 0.5, 0.9]))
    G = torch.randn(6, 32, generator=g)
    assert _flags() == tf32_on
    for name, fn in [
        ("G T", lambda: T.apply(G)),
        ("G T^-1", lambda: T.apply_inverse(G)),
        ("G T in place", lambda: T.apply_(G.clone())),
        ("G T^-1 in place", lambda: T.apply_inverse_(G.clone())),
    ]:
        rec = RecordMatmulFlags()
        with rec:
            fn()
        _check(rec, tf32_on, name)
    # the reducer's Hadamard rotation (to the wire, back into the bucket, and back as a new tensor)
    comm = CommConfig(dtype="fp8_e4m3", transform="hadamard", hadamard_block=16, compile="false")
    red = LowPrecisionReducer(comm, None, 1, 0)
    x = torch.randn(64, generator=g)
    for name, fn in [
        ("rotation", lambda: red.transform.to_wire(x.clone(), None)),
        ("inverse rotation", lambda: red.transform.from_wire(x.clone(), None, 0)),
        ("inverse rotation into the bucket", lambda: red.transform.write_back(x.clone(), 0, x.clone(), None)),
    ]:
        rec = RecordMatmulFlags()
        with rec:
            fn()
        _check(rec, tf32_on, name)


def test_geo_hooks_and_refresh_force_highest_precision_and_restore(world, tf32_on):
    model, geo = _geo(world)
    a, b = _inputs()
    rec = RecordMatmulFlags()  # the model's own linears are F.linear, not recorded: only the hooks' matmuls
    geo.arm()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        model(a, b)
    geo.disarm()
    assert len(rec.seen) >= 3, rec.seen  # a^T a and a^T (a Omega)
    _check(rec, tf32_on, "statistics hooks")
    rec = RecordMatmulFlags()
    with rec:
        geo.refresh(0)
    _check(rec, tf32_on, "refresh")


def test_exact_fp32_restores_every_setting_also_on_error():
    from megatron_geo.parallel.precision import exact_fp32

    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = False
    try:
        before = _flags()
        with pytest.raises(KeyError), torch.autocast("cpu", dtype=torch.bfloat16), exact_fp32():
            assert _flags() == EXACT
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32  # no autocast inside
            raise KeyError("boom")
        assert _flags() == before
    finally:
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = True


# -- a refresh on fake tensors (FakeTensorMode) with the fake process group ----------------------------------------


def _fake_scalars_mode():
    """FakeTensorMode that answers host reads of a value (``float()``, ``.item()``, ``.tolist()``) with 1: the
    refresh's few host reads (damping, diagnostics, checksums) get placeholders; devices, shapes and dtypes of
    everything else are the real ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class FakeScalars(FakeTensorMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                t = args[0]
                return True if t.dtype == torch.bool else (1.0 if t.dtype.is_floating_point else 1)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return FakeScalars()


def _fake_refresh(device: str, dp: int) -> dict:
    """Rank 0 of a DP = ``dp`` job (fake process group): arm, forward under the device's BF16 autocast, refresh;
    all tensors fake on ``device``. Returns what was built (dtype / device / shape strings) or why it cannot run."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_geo.geometry import transform as TR

    mode = _fake_scalars_mode()
    if device.startswith("cuda"):
        try:
            with mode:
                torch.empty(4, device=device)[:1]
        except RuntimeError as e:  # a CPU-only build has no CUDA device guard for FakeTensor's indexing
            return {"skip": f"FakeTensorMode cannot index {device} tensors on this build: {e}"}
        # the fake backend's broadcast asks the (absent) GPU for its compute capability
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    seen = []

    def checksum(self):  # the real one hashes the bytes, which a fake tensor does not have
        seen.append((str(self.U.dtype), str(self.U.device), str(self.d.dtype), str(self.d.device)))
        return "0" * 64

    TR.LowRankTransform.checksum = checksum
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    try:
        with mode:
            model = TwoLayers(device)
            geo = geo_state(
                model,
                dist.group.WORLD,
                layers="full.weight,sk.weight",
                rank=RANK,
                refresh_interval=1,
                statistics="auto",
                sketch_size=K,
            )
            for p in geo.params.values():
                p.main_grad = torch.randn(p.shape, device=device)
            a = torch.randn(TOKENS, D_FULL, device=device)
            b = torch.randn(TOKENS, D_SKETCH, device=device)
            geo.arm()
            with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                model(a, b)
            geo.disarm()
            sums = {n: (str(s.dtype), str(s.device), tuple(s.shape)) for n, s in geo.stats.sums.items()}
            geo.refresh(0)
            built = {
                n: (str(t.U.dtype), str(t.U.device), tuple(t.U.shape), str(t.d.dtype), str(t.d.device))
                for n, t in geo.transforms.items()
            }
            owners = geo.owners()
    finally:
        dist.destroy_process_group()
    return {"sums": sums, "built": built, "checksummed": seen, "owners": owners}


def _fake_worker(queue, cases):
    try:
        queue.put(("ok", [_fake_refresh(device, dp) for device, dp in cases]))
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put(("error", traceback.format_exc()))


def test_refresh_on_fake_tensors_with_fake_process_group():
    """DP = 2 and DP = 64 (rank 0 owns one layer, the other arrives by broadcast), fake ``cpu`` and ``cuda:0``
    tensors (the latter where the build supports them): FP32 statistics and transforms of the right shapes on
    the parameters' device. Runs in a fresh process: the fake process group must be the default one."""
    import torch.multiprocessing as mp

    cases = [(dev, dp) for dev in ("cpu", "cuda:0") for dp in (2, 64)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_fake_worker, args=(queue, cases))
    proc.start()
    try:
        status, out = queue.get(timeout=240)
    finally:
        proc.join(timeout=60)
    assert status == "ok", out
    ran = 0
    for (dev, dp), res in zip(cases, out):
        if "skip" in res:
            assert dev != "cpu", res["skip"]
            continue
        ran += 1
        want_owner = {"full.weight": 0, "sk.weight": 1 % dp}
        assert res["owners"] == want_owner
        assert res["sums"] == {
            "full.weight": ("torch.float32", dev, (D_FULL, D_FULL)),
            "sk.weight": ("torch.float32", dev, (D_SKETCH, K)),
        }, (dev, dp)
        for n, d_in in (("full.weight", D_FULL), ("sk.weight", D_SKETCH)):
            assert res["built"][n] == ("torch.float32", dev, (d_in, RANK), "torch.float32", dev), (dev, dp, n)
        assert res["checksummed"] and all(c == ("torch.float32", dev) * 2 for c in res["checksummed"]), (dev, dp)
    assert ran >= 2
