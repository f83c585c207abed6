"""NCCL-only behaviour checked on CPU: when the DP group may sum FP8 natively (torch build, NCCL version, GPU
generation), and the per-owner reduces of uneven ranges issued as one coalesced group where the backend
coalesces (NCCL), on torch's fake process group at DP = 2, 32 and 64.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from megatron_geo.parallel import build_groups
from megatron_geo.parallel import collectives as C


@pytest.fixture
def fake_world():
    """``make(world, rank)`` -> an initialised ``fake`` default process group (every collective returns at once,
    data untouched), torn down afterwards. A default group another test module left behind is shut first."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(world: int, rank: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        return dist.group.WORLD

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


# -- native FP8 sums ---------------------------------------------------------------------------------------------


@pytest.fixture
def nccl_like(monkeypatch):
    """The fake group presented as an NCCL one on a GPU machine; ``set(**)`` changes what that machine reports:
    torch's version, NCCL's version, the GPU's compute capability. Records the devices asked about."""
    asked = []
    state = {"torch": "2.8.0+cu128", "nccl": (2, 27, 3), "cap": (9, 0)}
    monkeypatch.setattr(C, "required_device_type", lambda group: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: state["nccl"])

    def capability(device=None):
        asked.append(torch.device(device))
        return state["cap"]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)

    def set_(**kw):
        state.update(kw)
        monkeypatch.setattr(torch, "__version__", state["torch"])

    set_()
    return set_, asked


def test_fp8_sum_needs_torch_2_8_nccl_2_24_and_sm90(fake_world, nccl_like):
    set_, asked = nccl_like
    g = fake_world(2, 0)
    for kw, want in [
        ({"torch": "2.7.1+cu126"}, False),  # FP8 sent as uint8, FP8 reductions refused
        ({"torch": "2.9.0a0+git1234"}, True),
        ({"torch": "2.11.0"}, True),
        ({"torch": "3.0.0"}, True),
        ({"nccl": (2, 23, 4)}, False),
        ({"nccl": (2, 24, 3)}, True),
        ({"nccl": (2, 26, 2, "+cuda12.8")}, True),
        ({"cap": (8, 0)}, False),
        ({"cap": (8, 9)}, False),  # A100, L40S: NCCL refuses FP8 sums
        ({"cap": (9, 0)}, True),
        ({"cap": (10, 0)}, True),
    ]:
        set_(**{"torch": "2.8.0+cu128", "nccl": (2, 27, 3), "cap": (9, 0), **kw})
        assert C.supports_fp8_sum(g) is want, kw
    asked.clear()
    assert C.supports_fp8_sum(g) is True and asked == [torch.device("cuda", 0)]  # the group's (current) device
    assert C.supports_fp8_sum(g, device="cuda:1") is True and asked[-1] == torch.device("cuda", 1)


def test_fp8_sum_is_never_claimed_off_nccl(fake_world, monkeypatch):
    g = fake_world(2, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert C.required_device_type(g) is None and C.supports_fp8_sum(g) is False  # the fake backend
    monkeypatch.setattr(C, "required_device_type", lambda group: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert C.supports_fp8_sum(g) is False  # no CUDA at all


# -- coalesced uneven reduces ------------------------------------------------------------------------------------


def _record(monkeypatch):
    """Wraps torch.distributed's coalescing manager and reduce: returns the list of events they produce
    (``("start",)``, ``("reduce", global dst, inside a coalescing block)``, ``("end", works)``)."""
    events, inside = [], [False]
    real_cm, real_reduce = dist._coalescing_manager, dist.reduce

    @contextlib.contextmanager
    def coalescing(*a, **k):
        events.append(("start",))
        inside[0] = True
        with real_cm(*a, **k) as cm:
            yield cm
        inside[0] = False
        events.append(("end", len(cm.works)))

    def reduce(t, dst=None, *a, **k):
        events.append(("reduce", dst, t.data_ptr(), t.numel(), inside[0]))
        return real_reduce(t, dst, *a, **k)

    monkeypatch.setattr(dist, "_coalescing_manager", coalescing)
    monkeypatch.setattr(dist, "reduce", reduce)
    return events


@pytest.mark.parametrize("world,tp,rank", [(2, 1, 1), (64, 1, 5), (64, 2, 3)])
def test_uneven_reduces_of_one_call_are_one_coalesced_group(fake_world, monkeypatch, world, tp, rank):
    """Whole-matrix owners at DP = 2, 64 and 32 (TP = 2, strided DP group): where the backend coalesces (NCCL;
    the fake group stands in for it) every owner's reduce is issued inside one coalescing block, onto its owner,
    over exactly its range, and the call returns one waitable; elsewhere (gloo, the fake backend itself) one
    reduce per owner as before."""
    fake_world(world, rank)
    pctx = build_groups(rank, world, tp, torch.device("cpu"), "fake")
    g, dp = pctx.dp_group, pctx.dp_size
    sizes = [((r * 37 + 3) % 11) * 16 for r in range(dp)]  # uneven; at DP >= 3 some owners have nothing
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    buf = torch.arange(bounds[-1], dtype=torch.float32)
    before = buf.clone()
    owners = [r for r in range(dp) if sizes[r]]
    assert len(owners) >= 2
    want = [(pctx.dp_ranks()[r], buf.data_ptr() + 4 * bounds[r], sizes[r]) for r in owners]

    events = _record(monkeypatch)
    real_coalesces = getattr(C, "coalesces", None)
    monkeypatch.setattr(C, "coalesces", lambda group, device: True, raising=False)  # what NCCL reports
    w = C.reduce_ranges(buf, bounds, g, async_op=True)
    assert events[0] == ("start",) and events[-1][0] == "end" and [e[0] for e in events].count("start") == 1
    reduces = events[1:-1]
    assert [(d, p, n) for _, d, p, n, _ in reduces] == want and all(e[4] for e in reduces)
    assert events[-1] == ("end", 1) and len(w.works) == 1  # one waitable for the whole call
    assert w.wait() is True
    assert torch.equal(buf, before)  # the fake reduce leaves the data as it was
    events.clear()
    C.reduce_ranges(buf, bounds, g, async_op=False)  # a synchronous call: the same single group
    assert [e[0] for e in events].count("start") == 1

    events.clear()
    monkeypatch.setattr(C, "coalesces", real_coalesces)
    assert C.coalesces(g, buf.device) is False  # the fake backend itself does not group collectives
    w = C.reduce_ranges(buf, bounds, g, async_op=True)
    assert [e[0] for e in events] == ["reduce"] * len(owners) and len(w.works) == len(owners)
    assert [(d, p, n) for _, d, p, n, inside in events] == want and w.wait() is True


def test_coalescing_follows_the_backends_capability(world):
    """gloo does not coalesce (its per-range reduces stay); a backend that reports coalescing does."""
    import types

    assert C.coalesces(world, torch.device("cpu")) is False
    nccl = types.SimpleNamespace(_get_backend=lambda device: types.SimpleNamespace(supports_coalescing=True))
    assert C.coalesces(nccl, torch.device("cpu")) is True


def test_nccl_collectives_refuse_a_tensor_on_another_gpu(monkeypatch):
    """The device check compares the index too: on NCCL a tensor on cuda:1 of a process bound to cuda:0 is
    refused before the collective (fake CUDA tensors: only their device is read)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_geo.parallel import collectives as C

    monkeypatch.setattr(C, "required_device_type", lambda group: "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(C.dist, "get_backend", lambda group=None: "nccl")
    with FakeTensorMode():
        on0, on1 = torch.empty(4, device="cuda:0"), torch.empty(4, device="cuda:1")
    C.check_devices("all_reduce", None, on0)
    with pytest.raises(C.CollectiveDeviceError, match=r"all_reduce: tensor 1 .* is on cuda:1 .* run on cuda:0"):
        C.check_devices("all_reduce", None, on0, on1)
