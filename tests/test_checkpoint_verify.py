"""A checkpoint counts only when complete where rank 0 loads it, and checkpoint.dir must be one folder that
every rank sees.

Faults are emulated in two gloo processes: rank 1's DCP writes landing in another folder (what a node-local
disk is), a data file cut short after DCP wrote it, a lost ``.metadata`` or ``meta.json``, and rank 1 given
its own ``checkpoint.dir``. References: torch's own ``FileSystemReader.read_metadata`` (the bytes each data
file must hold), the files as the test process sees them, and the processes' exit codes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_helpers import make_corpus, tiny_train_overrides
from dist_harness import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[1]


def _build(root: Path, *extra: str, train: bool = True):
    from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg
    from megatron_geo.training.checkpointing import Checkpointer
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    cfg = tiny_cfg(f"checkpoint.dir={root}", f"train.run_dir={root}", "checkpoint.keep_latest=1", *extra)
    pctx = pctx_for(1)
    model, buckets, reducer, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
    if train:  # one step: the checkpoint holds optimizer state
        mbs = rank_micro_batches(global_batch(cfg, 0), cfg.train.micro_batch_size, pctx.dp_rank, pctx.dp_size)
        train_step(StepContext(model, grad_sync, opt, pctx, 1.0), 0, mbs)
    return Checkpointer(cfg, pctx, model, opt, reducer, None, lambda m: None)


def _outcome(fn) -> dict:
    try:
        return {"type": None, "value": repr(fn())}
    except Exception as e:  # noqa: BLE001 - the parent checks the type and message
        return {"type": type(e).__name__, "msg": str(e)}


def _needed_bytes(folder: Path) -> dict[str, int]:
    """``{data file: max(offset + length)}`` from torch's own reader of the DCP metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    need: dict[str, int] = {}
    for info in FileSystemReader(str(folder)).read_metadata().storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return need


# ---------------------------------------------------------------------------------------------------
# (faulty rank, what goes wrong after DCP wrote the files)
SAVE_FAULTS = {
    "rank1_writes_elsewhere": 1,  # rank 1's checkpoint.dir is another disk: its shard never reaches rank 0's folder
    "rank1_file_truncated": 1,  # rank 1's data file ends early
    "rank0_file_truncated": 0,  # rank 0's own data file ends early
    "metadata_lost": 0,  # DCP's .metadata is gone
    "meta_json_lost": 0,  # rank 0's meta.json write is lost
}


def _inject(name: str, rank: int, elsewhere: Path, seen: dict):
    """Patch this rank's DCP save (or meta.json write) for fault ``name``; returns the undo callable."""
    import torch.distributed.checkpoint as dcp

    import megatron_geo.checkpoint.manager as manager

    real_save, real_write = dcp.save, manager._write_atomic
    if SAVE_FAULTS[name] != rank:
        return lambda: None

    def save(state, checkpoint_id):
        folder = Path(checkpoint_id)
        if name == "rank1_writes_elsewhere":
            folder = elsewhere / folder.name
            out = real_save(state, checkpoint_id=str(folder))
            seen["files"] = sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))
            return out
        out = real_save(state, checkpoint_id=checkpoint_id)
        if name == "metadata_lost":
            (folder / ".metadata").unlink()
            return out
        data = sorted(folder.glob(f"__{rank}_*.distcp"))[0]
        seen["need"] = _needed_bytes(folder)[data.name]
        keep = seen["need"] // 2
        with open(data, "r+b") as f:
            f.truncate(keep)
        seen["files"], seen["size"] = [data.name], keep
        return out

    def lost_meta_json(path, text):
        if path.name == "meta.json":  # the write "succeeds" but nothing reaches the folder
            return None
        return real_write(path, text)

    if name == "meta_json_lost":
        manager._write_atomic = lost_meta_json
    else:
        dcp.save = save

    def undo():
        dcp.save, manager._write_atomic = real_save, real_write

    return undo


def _save_fault_worker(rank, world, root):
    import torch.distributed as dist

    out = {}
    for name in SAVE_FAULTS:
        d = Path(root) / name
        ck = _build(d)
        ck.save(1, 8)  # the previous, good checkpoint
        seen: dict = {}
        undo = _inject(name, rank, Path(root) / f"{name}-rank{rank}-local", seen)
        try:
            failed = _outcome(lambda: ck.save(2, 16))
        finally:
            undo()
        dist.barrier()
        out[name] = {
            "save": failed,
            "seen": seen,
            "latest": (d / "latest").read_text().strip(),
            "folders": sorted(p.name for p in d.iterdir()),
            "resume": _outcome(_build(d, train=False).resume),
        }
    # the same run saves again without a fault: the check passes and keep_latest=1 prunes step 1
    d = Path(root) / "rank1_writes_elsewhere"
    ck = _build(d)
    ok = _outcome(lambda: ck.save(2, 16).name)
    dist.barrier()
    out["after"] = {
        "save": ok,
        "folders": sorted(p.name for p in d.iterdir()),
        "resume": _outcome(_build(d, train=False).resume),
    }
    return out


def _all_worker(rank, world, root):
    """The save, load and start-up scenarios in one pair of processes (each in a folder of its own)."""
    base = Path(root)
    return {
        "save": _save_fault_worker(rank, world, str(base / "save")),
        "load": _load_fault_worker(rank, world, str(base / "load")),
        "probe": _probe_worker(rank, world, str(base / "probe")),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """``(folder, [rank 0's results, rank 1's results])`` of :func:`_all_worker`."""
    root = tmp_path_factory.mktemp("two_ranks")
    return root, run_distributed(_all_worker, 2, str(root), timeout=300)


def test_a_save_missing_or_short_where_rank_0_reads_it_is_refused_before_publication(two_ranks):
    tmp_path, ranks = two_ranks[0] / "save", [r["save"] for r in two_ranks[1]]
    for name, bad in SAVE_FAULTS.items():
        seen = ranks[bad][name]["seen"]
        for r, res in enumerate(ranks):
            case = res[name]
            assert case["save"]["type"] == "CheckpointSaveError", (name, r, case["save"])  # trainer: exit 6
            msg = case["save"]["msg"]
            assert "\n" not in msg and str(tmp_path / name) in msg and "incomplete where rank 0 reads it" in msg, msg
            assert "nothing was published" in msg and "shared file system" in msg, msg
            if name == "rank1_writes_elsewhere":
                assert seen["files"], seen
                for f in seen["files"]:
                    assert f"{f} is missing (written by rank 1)" in msg, msg
            elif name.endswith("truncated"):
                f = seen["files"][0]
                assert f"{f} has {seen['size']:,} of {seen['need']:,} bytes (written by rank {bad})" in msg, msg
            elif name == "metadata_lost":
                assert ".metadata is missing (written by rank 0)" in msg, msg
            else:
                assert "meta.json is missing (written by rank 0)" in msg, msg
            # the previous checkpoint stays published, is not pruned, and loads; the half one is gone
            assert case["latest"] == "step_00000001", (name, case)
            assert case["folders"] == ["latest", "step_00000001"], (name, case["folders"])
            assert case["resume"] == {"type": None, "value": "(1, 8, 0)"}, (name, r, case["resume"])
    for r, res in enumerate(ranks):
        assert res["after"]["save"] == {"type": None, "value": "'step_00000002'"}, (r, res["after"])
        assert res["after"]["folders"] == ["latest", "step_00000002"], res["after"]
        assert res["after"]["resume"] == {"type": None, "value": "(2, 16, 0)"}, res["after"]


# ---------------------------------------------------------------------------------------------------
# the load side: a published checkpoint that lost a file is refused with a clear error on every rank


def _load_fault_worker(rank, world, root):
    import torch.distributed as dist

    out = {}
    for fault in ("rank1_file_missing", "rank1_file_short"):
        d = Path(root) / fault
        _build(d).save(1, 8)
        dist.barrier()
        if rank == 0:
            data = d / "step_00000001" / "__1_0.distcp"
            if fault.endswith("missing"):
                data.unlink()
            else:
                data.write_bytes(data.read_bytes()[:-64])
        dist.barrier()
        out[fault] = _outcome(_build(d, train=False).resume)
    return out


def test_a_published_checkpoint_with_a_missing_or_short_file_is_refused_at_load(two_ranks):
    ranks = [r["load"] for r in two_ranks[1]]
    for r, res in enumerate(ranks):
        for fault, what in (("rank1_file_missing", "is missing"), ("rank1_file_short", "bytes but its entries end")):
            assert res[fault]["type"] == "ConfigError", (r, fault, res[fault])  # trainer: exit 2
            msg = res[fault]["msg"]
            assert "__1_0.distcp" in msg and what in msg and "incomplete" in msg, msg
            assert "checkpoint.load=none" in msg, msg


# ---------------------------------------------------------------------------------------------------
# start-up: a checkpoint.dir that is not one folder for every rank


def _probe_worker(rank, world, root):
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    out = {}
    # per rank: (checkpoint.dir, extra overrides); rank 1 on its own folder is what a node-local disk is
    cases = {
        "own_folder_per_rank": (base / f"local-{rank}", ()),
        "shared": (base / "shared", ()),
        "symlinked_to_the_same_folder": (base / ("shared" if rank == 0 else "link"), ()),
        "own_folder_checkpointing_off": (
            base / f"off-{rank}",
            ("checkpoint.interval=0", "checkpoint.save_at_end=false", "checkpoint.load=none"),
        ),
        "own_folder_periodic_saves": (
            base / f"periodic-{rank}",
            ("checkpoint.interval=100", "checkpoint.save_at_end=false", "checkpoint.load=none"),
        ),
    }
    if rank == 1:
        (base / "shared").mkdir(exist_ok=True)
        os.symlink(base / "shared", base / "link")
    import torch.distributed as dist

    dist.barrier()
    for name, (d, extra) in cases.items():
        out[name] = _outcome(lambda: type(_build(d, *extra, train=False)).__name__)
        dist.barrier()
        out[name]["leftovers"] = sorted(str(p) for p in base.rglob(".shared-dir-probe-*"))
    return out


def test_a_checkpoint_dir_not_shared_by_every_rank_is_refused_at_start_up(two_ranks):
    tmp_path, ranks = two_ranks[0] / "probe", [r["probe"] for r in two_ranks[1]]
    for r, res in enumerate(ranks):
        for name in ("own_folder_per_rank", "own_folder_periodic_saves"):
            case = res[name]
            assert case["type"] == "ConfigError", (r, name, case)  # trainer: exit 2
            msg = case["msg"]
            folder = tmp_path / (f"local-{r}" if name == "own_folder_per_rank" else f"periodic-{r}")
            assert f"checkpoint.dir '{folder}' (as rank {r} sees it) is not one folder that every rank sees" in msg
            assert "rank(s) 1 (no such file) could not read it" in msg and "shared file system" in msg, msg
            assert "\n" not in msg
        for name in ("shared", "symlinked_to_the_same_folder", "own_folder_checkpointing_off"):
            assert res[name]["type"] is None, (r, name, res[name])
        for name, case in res.items():
            assert case["leftovers"] == [], (name, case["leftovers"])  # rank 0 removed its probe file


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


def test_pretrain_with_a_node_local_checkpoint_dir_exits_2_before_training(tmp_path, corpus):
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        args = tiny_train_overrides(
            tmp_path / "run",
            corpus,
            "train.steps=4",
            "checkpoint.interval=2",
            f"checkpoint.dir={tmp_path / f'node{rank}-scratch'}",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "pretrain_llama.py"), *args],
                cwd=ROOT,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
        )
    for rank, p in enumerate(procs):
        _, err = p.communicate(timeout=180)
        assert p.returncode == 2, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and "is not one folder that every rank sees" in errors[0], err[-3000:]
        assert str(tmp_path / f"node{rank}-scratch") in errors[0] and "rank(s) 1" in errors[0], errors[0]
        assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained
    assert not list(tmp_path.rglob(".shared-dir-probe-*"))


# ---------------------------------------------------------------------------------------------------
# the check itself, on a folder written by DCP in this process


def test_the_check_names_every_missing_short_or_unreadable_file(tmp_path):
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from megatron_geo.checkpoint.verify import IncompleteCheckpointError, verify_written

    ck = tmp_path / "step_00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {f"w{i}": torch.arange(100.0 + i) for i in range(3)},
            no_dist=True,
            storage_writer=FileSystemWriter(str(ck), thread_count=3),
        )  # three data files
    (ck / "meta.json").write_text("{}")
    need = _needed_bytes(ck)
    files = sorted(need)
    assert len(files) == 3
    verify_written(ck, {"meta.json": 2})  # complete: no error
    verify_written(ck, {"meta.json": 1})  # a longer own file is fine

    with open(ck / files[0], "r+b") as f:  # short by one byte
        f.truncate(need[files[0]] - 1)
    (ck / files[1]).unlink()
    (ck / files[1]).mkdir()  # not a regular file
    with pytest.raises(IncompleteCheckpointError) as e:
        verify_written(ck, {"meta.json": 3, "other.json": 1})
    msg = str(e.value)
    assert f"{files[0]} has {need[files[0]] - 1:,} of {need[files[0]]:,} bytes (written by rank 0)" in msg, msg
    assert f"{files[1]} is missing (written by rank 0)" in msg and files[2] not in msg, msg
    assert "meta.json has 2 of 3 bytes" in msg and "other.json is missing" in msg, msg
    assert sorted(p.name for p in e.value.problems) == sorted([files[0], files[1], "meta.json", "other.json"])

    (ck / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(IncompleteCheckpointError, match=r"\.metadata is unreadable \(.*\) \(written by rank 0\)"):
        verify_written(ck, {})
    (ck / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"\.metadata is missing \(written by rank 0\)"):
        verify_written(ck, {})
    many = {f"f{i}.json": 1 for i in range(9)}
    with pytest.raises(IncompleteCheckpointError, match=r"f5\.json is missing \(written by rank 0\); and 4 more$"):
        verify_written(ck, many)
