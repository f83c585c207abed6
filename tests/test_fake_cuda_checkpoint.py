"""Checkpoints of a model on ``cuda:0`` (FakeTensorMode on the fake process group: the real model, optimizer,
reducer and DCP code, shapes and devices without data) and errors inside the collective save and load (two
gloo processes, one of them failing).

References: the devices of the shard tensors themselves, the parameters' own shapes, the ranges the
distributed optimizer's main params cover, and a coverage count of every shard rectangle (torch ops).
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_harness import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("full_dp1", "layout_dp2", "layout_dp64")


# ---------------------------------------------------------------------------------------------------
# the fake-CUDA scenarios (run in a subprocess of their own: they patch torch.cuda and init the fake group)


def _describe(sd: dict) -> dict:
    """Every ShardedTensor of a DCP state dict: global size, local shards (placement, device, tensor device,
    offsets, sizes) and the global metadata (rank, offsets, sizes of every shard)."""
    import warnings

    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, v in sd.items():
            if not isinstance(v, ShardedTensor):
                continue
            md = v.metadata()
            out[k] = {
                "size": list(md.size),
                "local": [
                    {
                        "placement": str(s.metadata.placement),
                        "rank": s.metadata.placement.rank(),
                        "placement_device": str(s.metadata.placement.device()),
                        "tensor_device": str(s.tensor.device),
                        "offsets": list(s.metadata.shard_offsets),
                        "sizes": list(s.metadata.shard_sizes),
                        "tensor_shape": list(s.tensor.shape),
                    }
                    for s in v.local_shards()
                ],
                "all": [[m.placement.rank(), list(m.shard_offsets), list(m.shard_sizes)] for m in md.shards_metadata],
            }
    return out


def _build_fake(world: int, ckpt_dir: str):
    """Rank 0 of a DP = ``world`` job on ``cuda:0``: model, optimizer (with zero AdamW state), reducer."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ckpt_helpers import FakeCuda
    from helpers import tiny_cfg
    from megatron_geo.checkpoint.state import StateLayout, _ensure_optimizer_state
    from megatron_geo.parallel import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    pctx = build_groups(0, world, 1, torch.device("cuda", 0), "fake")
    cfg = tiny_cfg(f"train.global_batch_size={2 * world}", f"checkpoint.dir={ckpt_dir}", f"train.run_dir={ckpt_dir}")
    cuda = FakeCuda()
    with cuda:
        model, buckets, reducer, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
        layout = StateLayout(model, opt, pctx, cfg.model.vocab_size, cfg.optimizer.name)
        _ensure_optimizer_state(layout)  # AdamW's state as after a step (zeros)
    ref = {
        "device": str(pctx.device),
        "param_device": str(next(model.parameters()).device),
        "shapes": {n: list(p.shape) for n, p in model.named_parameters()},
        "owned": {},
    }
    for m in opt.mains:  # the flat ranges of each parameter rank 0's optimizer holds
        ref["owned"].setdefault(m.name, []).append([m.param_start, m.param_start + m.main.numel()])
    return cfg, pctx, model, opt, reducer, layout, cuda, ref


def _full_dp1(tmp: Path) -> dict:
    """Checkpointer.save then Checkpointer.resume (DCP writing and reading the files) at DP = 1 on cuda:0."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron_geo.checkpoint.safe_reader import SafeFileSystemReader
    from megatron_geo.training.checkpointing import Checkpointer

    cfg, pctx, model, opt, reducer, layout, cuda, ref = _build_fake(1, str(tmp))
    seen = {}
    real_save, real_load = dcp.save, dcp.load

    def save(state, **kw):
        seen["save"] = _describe(state)
        return real_save(state, **kw)

    def load(state, **kw):
        seen["load"] = _describe(state)
        return real_load(state, **kw)

    dcp.save, dcp.load = save, load
    try:
        with cuda:
            path = Checkpointer(cfg, pctx, model, opt, reducer, None, lambda m: None).save(1, 8)
            resumed = Checkpointer(cfg, pctx, model, opt, reducer, None, lambda m: None).resume()
    finally:
        dcp.save, dcp.load = real_save, real_load
        dist.destroy_process_group()
    keys = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    chunks = {
        k: {"size": list(v.size), "chunks": [[list(c.offsets), list(c.sizes)] for c in v.chunks]}
        for k, v in keys.items()
        if k.startswith(("model/", "optim/")) and hasattr(v, "chunks")
    }
    return {
        "ref": ref,
        "save": seen["save"],
        "load": seen["load"],
        "chunks": chunks,
        "resumed": list(resumed),
        "latest": (path.parent / "latest").read_text().strip(),
        "path": path.name,
    }


def _layout(world: int, tmp: Path) -> dict:
    """build_save_state and load_state's DCP request as rank 0 of DP = ``world`` on cuda:0 (no DCP I/O: the
    fake process group delivers no other rank's plan)."""
    import warnings

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from megatron_geo.checkpoint.state import build_save_state, load_state

    cfg, pctx, model, opt, reducer, layout, cuda, ref = _build_fake(world, str(tmp))
    try:
        with cuda:
            saved = _describe(build_save_state(layout, reducer, None, True))
        # a checkpoint of the right keys and global shapes (its metadata is what the load plans from)
        full = {}
        for n, shape in ref["shapes"].items():
            full[f"model/{n}"] = torch.zeros(shape)
            for s in ("exp_avg", "exp_avg_sq"):
                full[f"optim/{n}/{s}"] = torch.zeros(shape)
            full[f"optim/{n}/step"] = torch.zeros((), dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(full, checkpoint_id=str(tmp / "ck"), no_dist=True)
        seen = {}
        real_load = dcp.load

        def load(state, **kw):  # records DCP's request; the fake group cannot run the read plan's exchange
            seen["load"] = _describe(state)

        dcp.load = load
        try:
            with cuda:
                load_state(str(tmp / "ck"), layout, reducer, None, False, None, lambda m: None)
        finally:
            dcp.load = real_load
    finally:
        dist.destroy_process_group()
    return {"ref": ref, "save": saved, "load": seen["load"]}


def _main(out_dir: str) -> None:
    import tempfile
    import traceback

    from ckpt_helpers import install_fake_cuda_runtime

    install_fake_cuda_runtime()
    results = {}
    for name in SCENARIOS:
        tmp = Path(tempfile.mkdtemp(dir=out_dir))
        try:
            results[name] = {
                "ok": _full_dp1(tmp) if name == "full_dp1" else _layout(int(name[len("layout_dp") :]), tmp)
            }
        except BaseException:  # noqa: BLE001 - reported per scenario to the test
            results[name] = {"error": traceback.format_exc()[-4000:]}
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    print(json.dumps(results))


@pytest.fixture(scope="module")
def fake_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fake_cuda")
    r = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _scenario(fake_runs, name) -> dict:
    res = fake_runs[name]
    assert "error" not in res, res.get("error")
    return res["ok"]


def _coverage(size: list[int], rects) -> torch.Tensor:
    """How often each element of a tensor of ``size`` lies in one of ``rects`` (``(offsets, sizes)``)."""
    cover = torch.zeros(size, dtype=torch.int64)
    for off, sz in rects:
        cover[tuple(slice(o, o + s) for o, s in zip(off, sz))] += 1
    return cover


def _check_state_dict(desc: dict, ref: dict, world: int, where: str) -> None:
    names = list(ref["shapes"])
    want = {f"model/{n}" for n in names} | {f"optim/{n}/{s}" for n in names for s in ("exp_avg", "exp_avg_sq")}
    assert set(desc) == want, where
    assert ref["param_device"] == ref["device"] == "cuda:0", where  # the model really is on cuda:0
    for key, st in desc.items():
        name = key.split("/")[1]
        shape = ref["shapes"][name]
        assert st["size"] == shape, (where, key)
        for sh in st["local"]:  # every shard placement names its tensor's own device, index included
            assert sh["tensor_device"] == ref["device"], (where, key, sh)
            assert sh["placement_device"] == sh["tensor_device"], (where, key, sh)
            assert sh["placement"] == f"rank:0/{sh['tensor_device']}", (where, key, sh)
            assert sh["tensor_shape"] == sh["sizes"], (where, key, sh)
        # the global metadata: every rank's rectangles tile the global tensor exactly once ...
        assert {r for r, _, _ in st["all"]} <= set(range(world)), (where, key)
        cover = _coverage(shape, [(o, s) for _, o, s in st["all"]])
        assert torch.equal(cover, torch.ones_like(cover)), (where, key)
        # ... and rank 0's are its local shards, holding exactly the elements its optimizer owns
        mine = [[o, s] for r, o, s in st["all"] if r == 0]
        assert mine == [[sh["offsets"], sh["sizes"]] for sh in st["local"]], (where, key)
        owned = torch.zeros(torch.Size(shape).numel(), dtype=torch.int64)
        for lo, hi in ref["owned"].get(name, []):
            owned[lo:hi] = 1
        assert torch.equal(_coverage(shape, mine).reshape(-1), owned), (where, key)


def test_fake_cuda_save_and_resume_at_dp1(fake_runs):
    res = _scenario(fake_runs, "full_dp1")
    assert res["resumed"] == [1, 8, 0] and res["latest"] == res["path"] == "step_00000001"
    for side in ("save", "load"):
        _check_state_dict(res[side], res["ref"], 1, side)
    for key, md in res["chunks"].items():  # what DCP wrote: the global shape, tiled once
        if key.endswith("/step"):
            continue
        assert md["size"] == res["ref"]["shapes"][key.split("/")[1]], key
        cover = _coverage(md["size"], md["chunks"])
        assert torch.equal(cover, torch.ones_like(cover)), key


@pytest.mark.parametrize("world", [2, 64])
def test_fake_cuda_state_dicts_at_dp2_and_dp64(fake_runs, world):
    res = _scenario(fake_runs, f"layout_dp{world}")
    for side in ("save", "load"):
        _check_state_dict(res[side], res["ref"], world, side)
    spread = {len({r for r, _, _ in st["all"]}) for st in res["save"].values()}
    assert max(spread) > 1  # parameters split over several ranks (the metadata is not rank 0's alone)


# ---------------------------------------------------------------------------------------------------
# one rank failing inside the save or the load: every rank raises the documented error, no rank waits


def _build_real(root: Path, train: bool = True):
    from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg
    from megatron_geo.training.checkpointing import Checkpointer
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    cfg = tiny_cfg(f"checkpoint.dir={root}", f"train.run_dir={root}", "comm.dtype=fp8_e4m3", "comm.error_feedback=true")
    pctx = pctx_for(1)
    model, buckets, reducer, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
    if train:  # one step: the checkpoint holds optimizer state and error-feedback residuals
        mbs = rank_micro_batches(global_batch(cfg, 0), cfg.train.micro_batch_size, pctx.dp_rank, pctx.dp_size)
        train_step(StepContext(model, grad_sync, opt, pctx, 1.0), 0, mbs)
    return cfg, pctx, model, opt, reducer, Checkpointer(cfg, pctx, model, opt, reducer, None, lambda m: None)


def _outcome(fn) -> dict:
    try:
        return {"type": None, "value": repr(fn())}
    except Exception as e:  # noqa: BLE001 - the parent checks the type and message
        return {"type": type(e).__name__, "msg": str(e)}


def _save_fault_worker(rank, world, root):
    import megatron_geo.checkpoint.manager as manager
    import megatron_geo.checkpoint.state as state

    out = {}
    faults = {
        # rank 1 fails while building its state dict (before any file is written)
        "state": (state, "residual_views", 1, RuntimeError("injected fault in the state dict")),
        # rank 0 fails while publishing (meta.json / latest), after every rank wrote its files
        "publish": (manager, "_write_atomic", 0, OSError(errno.ENOSPC, "No space left on device")),
    }
    for name, (mod, attr, bad_rank, exc) in faults.items():
        d = Path(root) / name
        cfg, pctx, model, opt, reducer, ck = _build_real(d)
        ck.save(1, 8)  # the previous, good checkpoint
        real = getattr(mod, attr)

        def boom(*a, **k):
            raise exc

        if rank == bad_rank:
            setattr(mod, attr, boom)
        try:
            failed = _outcome(lambda: ck.save(2, 16))
        finally:
            setattr(mod, attr, real)
        cfg2, pctx2, model2, opt2, reducer2, ck2 = _build_real(d, train=False)
        out[name] = {
            "save": failed,
            "resume": _outcome(ck2.resume),
            "latest": (d / "latest").read_text().strip(),
            "folders": sorted(p.name for p in d.iterdir()),
            "same_params": all(torch.equal(a.main, b.main) for a, b in zip(opt.mains, opt2.mains)),
        }
    return out


def test_a_rank_failing_inside_the_save_fails_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    ranks = run_distributed(_save_fault_worker, 2, str(tmp_path), timeout=120)
    for r, res in enumerate(ranks):
        st = res["state"]
        assert st["save"]["type"] == "CheckpointSaveError", (r, st["save"])  # trainer: exit code 6
        assert "rank 1" in st["save"]["msg"] and "injected fault in the state dict" in st["save"]["msg"], st["save"]
        pub = res["publish"]
        assert pub["save"]["type"] == "CheckpointSaveError", (r, pub["save"])
        assert "no space left on device" in pub["save"]["msg"] and "rank 0" in pub["save"]["msg"], pub["save"]
        for case in (st, pub):  # the previous checkpoint is intact, loads, and `latest` still names it
            assert case["latest"] == "step_00000001", (r, case)
            assert case["resume"] == {"type": None, "value": "(1, 8, 0)"}, (r, case)
            assert case["same_params"], r
            assert not [f for f in case["folders"] if f not in ("latest", "step_00000001")], (r, case["folders"])


def _load_fault_worker(rank, world, root):
    import megatron_geo.checkpoint.safe_reader as safe_reader

    d = Path(root)
    cfg, pctx, model, opt, reducer, ck = _build_real(d)
    ck.save(1, 8)
    out = {}

    def unreadable(self):
        raise OSError(errno.EIO, "Input/output error", str(d / "step_00000001" / ".metadata"))

    def bad_rng(state):
        raise RuntimeError("injected fault restoring the RNG")

    faults = {
        "read": (safe_reader.SafeFileSystemReader, "read_metadata", unreadable),
        "restore": (torch, "set_rng_state", bad_rng),
    }
    for name, (owner, attr, fn) in faults.items():
        ck2 = _build_real(d, train=False)[-1]
        real = getattr(owner, attr)
        if rank == 1:
            setattr(owner, attr, fn)
        try:
            out[name] = _outcome(ck2.resume)
        finally:
            setattr(owner, attr, real)
    out["after"] = _outcome(_build_real(d, train=False)[-1].resume)
    return out


def test_a_rank_failing_inside_the_load_fails_every_rank(tmp_path):
    ranks = run_distributed(_load_fault_worker, 2, str(tmp_path), timeout=120)
    for r, res in enumerate(ranks):
        assert res["read"]["type"] == "ConfigError", (r, res["read"])  # trainer: exit code 2
        assert "could not be read on rank 1" in res["read"]["msg"] and "Input/output error" in res["read"]["msg"], (
            r,
            res["read"],
        )
        assert res["restore"]["type"] == "ConfigError", (r, res["restore"])
        msg = res["restore"]["msg"]
        assert "rank 1" in msg and "injected fault restoring the RNG" in msg and "damaged" not in msg, (r, msg)
        assert res["after"] == {"type": None, "value": "(1, 8, 0)"}, (r, res["after"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(ROOT))
    _main(sys.argv[1])
