"""Checkpoints: bitwise resume, resharding (DP 2->3, 2->1, TP 2->1), atomic saves, stop signals,
non-finite steps and dead ranks. References: an uninterrupted run, the saved state reassembled from
every rank's pieces with torch.cat, and the processes' own exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ckpt_helpers import assemble, local_state, make_corpus, tiny_train_overrides
from ckpt_helpers import train_jobs as _train_jobs
from dist_harness import free_port, run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    return make_corpus(tmp_path_factory.mktemp("corpus"))


# ---------------------------------------------------------------------------------------------------
# 8 steps straight vs 4 steps + checkpoint + a fresh process + 4 steps
MODES = {
    "bf16": ["comm.dtype=bf16"],
    "fp8_ef": ["comm.dtype=fp8_e4m3", "comm.error_feedback=true"],
    "geofp8": [
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "geo.rank=8",
        "geo.refresh_interval=3",
        "comm.error_feedback=true",
        "comm.rounding=stochastic",
    ],
    # sketched statistics, resumed just after a refresh (3), at one (exit at 6: refresh at 6 right after
    # the resume) and before one (5), with geo.select=auto and geo.power_search
    "geofp8_sketch": [
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "geo.rank=4",
        "geo.refresh_interval=3",
        "comm.error_feedback=true",
        "geo.statistics=sketch",
        "geo.sketch_size=16",
    ],
    "geofp8_sketch_at_refresh": [
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "geo.rank=4",
        "geo.refresh_interval=3",
        "comm.error_feedback=true",
        "geo.statistics=sketch",
        "geo.sketch_size=16",
        "train.exit_interval=6",
    ],
    "geofp8_auto_search_before_refresh": [
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "geo.rank=4",
        "geo.refresh_interval=3",
        "geo.select=auto",
        "geo.num_layers=1",
        "geo.profile_steps=1",
        "geo.statistics=sketch",
        "geo.sketch_size=16",
        "geo.power_search=[0.5,0.25,0]",
        "train.exit_interval=5",
    ],
}


def _preset_overrides(name: str) -> list[str]:
    """``configs/comm/<name>.yaml`` as dotted overrides (GeoFP8 refreshing every 3 steps of the 8)."""
    import yaml

    data = yaml.safe_load((ROOT / "configs" / "comm" / f"{name}.yaml").read_text())
    out = [
        f"{sec}.{k}={'[' + ','.join(map(str, v)) + ']' if isinstance(v, list) else v}"
        for sec, body in data.items()
        for k, v in body.items()
    ]
    return out + (["geo.refresh_interval=3", "geo.rank=8"] if "geo" in data else [])


# every preset, resumed just after a refresh (exit at 4; GeoFP8 refreshes at 0, 3, 6)
MODES.update(
    {f"preset_{p.stem}": _preset_overrides(p.stem) for p in sorted((ROOT / "configs" / "comm").glob("*.yaml"))}
)
# geo.power_search resumed at a refresh (3) and before one (5)
MODES["preset_geofp8_search_at_refresh"] = _preset_overrides("geofp8_search") + ["train.exit_interval=3"]
MODES["preset_geofp8_search_before_refresh"] = _preset_overrides("geofp8_search") + ["train.exit_interval=5"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_is_bitwise_identical(tmp_path, corpus):
    first, second = [], []
    for mode, extra in MODES.items():
        exit_at = [e for e in extra if e.startswith("train.exit_interval=")] or ["train.exit_interval=4"]
        base = ["train.steps=8", *(e for e in extra if not e.startswith("train.exit_interval="))]
        first.append(tiny_train_overrides(tmp_path / f"{mode}-straight", corpus, *base))
        first.append(tiny_train_overrides(tmp_path / f"{mode}-resumed", corpus, *base, *exit_at))
        second.append(tiny_train_overrides(tmp_path / f"{mode}-resumed", corpus, *base))
    run_distributed(_train_jobs, 2, first)
    # fresh processes: everything comes from the checkpoint; then a relaunch with train.steps below the
    # checkpoint's step must write nothing
    second.append(tiny_train_overrides(tmp_path / "bf16-resumed", corpus, "train.steps=3", *MODES["bf16"]))
    run_distributed(_train_jobs, 2, second)
    keys = ("step", "loss", "grad_norm", "val_loss", "comm_bytes", "consumed_samples")
    for mode in MODES:
        straight = [{k: r.get(k) for k in keys} for r in _records(tmp_path / f"{mode}-straight")]
        resumed = [{k: r.get(k) for k in keys} for r in _records(tmp_path / f"{mode}-resumed")]
        assert [r["step"] for r in resumed] == list(range(1, 9)), mode
        assert resumed == straight, mode
        ckdir = tmp_path / f"{mode}-resumed/checkpoints"
        assert (ckdir / "latest").read_text().strip() == "step_00000008"
        if mode.startswith(("geofp8_", "preset_")):
            continue
        assert sorted(p.name for p in ckdir.glob("step_*")) == ["step_00000004", "step_00000008"]
        meta = json.loads((ckdir / "step_00000004/meta.json").read_text())
        assert meta["step"] == 4 and meta["consumed_samples"] == 32
        if mode == "geofp8":
            assert meta["geo"]["last_refresh"] == 3  # refreshes at steps 0, 3 (before the save) and 6 (after)
            assert [r.get("geo_refresh") for r in _records(tmp_path / f"{mode}-resumed")][6] is True


# ---------------------------------------------------------------------------------------------------
# resharding: the state loaded at another layout equals the saved one, element for element
RESHARD_CASES = {  # name: (overrides, tp at save)
    "adamw": (["optimizer.name=adamw"], 1),
    "muon": (["optimizer.name=muon"], 1),
    "adamw_tp2": (["optimizer.name=adamw"], 2),
    "adamw_nodistopt": (["optimizer.name=adamw", "parallel.distributed_optimizer=false"], 1),
}


def _build(overrides, tp, ckpt_dir):
    from megatron_geo.training.checkpointing import Checkpointer
    from megatron_geo.training.setup import build_model_and_optimizer

    cfg = tiny_cfg(
        f"parallel.tensor={tp}",
        f"checkpoint.dir={ckpt_dir}",
        "train.run_dir=" + str(ckpt_dir),
        "train.global_batch_size=12",
        *overrides,
    )  # 12: whole micro-batches at DP 1, 2 and 3
    pctx = pctx_for(tp)
    model, buckets, reducer, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
    ck = Checkpointer(cfg, pctx, model, opt, reducer, None, lambda m: None)
    return cfg, pctx, model, buckets, grad_sync, opt, ck


def _steps(cfg, pctx, model, grad_sync, opt, first, n):
    from megatron_geo.training.step import StepContext, train_step

    ctx = StepContext(model, grad_sync, opt, pctx, 1.0)
    losses = []
    for s in range(first, first + n):
        mbs = rank_micro_batches(global_batch(cfg, s), cfg.train.micro_batch_size, pctx.dp_rank, pctx.dp_size)
        losses.append(train_step(ctx, s, mbs).loss)
    return losses


def _save_worker(rank, world, root):
    out = {}
    for name, (overrides, tp) in RESHARD_CASES.items():
        cfg, pctx, model, buckets, grad_sync, opt, ck = _build(overrides, tp, Path(root) / name)
        _steps(cfg, pctx, model, grad_sync, opt, 0, 2)
        ck.save(2, 24)
        out[name] = {"state": local_state(opt), "buckets": len(buckets), "split": any(not m.whole for m in opt.mains)}
    return out


def _load_worker(rank, world, root, jobs):
    out = {}
    for name, tp in jobs:
        overrides, _ = RESHARD_CASES[name]
        cfg, pctx, model, buckets, grad_sync, opt, ck = _build(overrides, tp, Path(root) / name)
        step, consumed, _ = ck.resume()
        state = local_state(opt)
        params_match = all(
            torch.equal(
                m.param.detach().reshape(-1)[m.param_start : m.param_start + m.main.numel()],
                m.main.detach().reshape(-1),
            )
            for m in opt.mains
        )
        loss = _steps(cfg, pctx, model, grad_sync, opt, step, 1)[0]
        out[(name, tp)] = {
            "state": state,
            "step": step,
            "consumed": consumed,
            "params_match": params_match,
            "loss": loss,
        }
    return out


def _assert_same(saved: dict, loaded: dict, case: str):
    assert saved.keys() == loaded.keys(), case
    for pname in saved:
        for key in saved[pname]:
            a, b = saved[pname][key], loaded[pname][key]
            if isinstance(a, float):
                assert a == b, (case, pname, key)
            else:
                assert not torch.isnan(a).any(), (case, pname, key, "piece missing in the saved layout")
                assert torch.equal(a, b), (case, pname, key)


def test_resharding_dp2_to_dp3_and_dp1_and_tp2_to_tp1(tmp_path):
    saved_ranks = run_distributed(_save_worker, 2, str(tmp_path))
    assert saved_ranks[0]["adamw"]["buckets"] >= 2 and saved_ranks[0]["adamw"]["split"]  # pieces cut mid-parameter
    vocab = tiny_cfg().model.vocab_size
    saved = {n: assemble([r[n]["state"] for r in saved_ranks], RESHARD_CASES[n][1], vocab) for n in RESHARD_CASES}
    assert saved["adamw"]["embed.weight"]["main"].shape[0] == vocab
    dp3 = run_distributed(_load_worker, 3, str(tmp_path), [("adamw", 1), ("muon", 1), ("adamw_nodistopt", 1)])
    dp1 = run_distributed(_load_worker, 1, str(tmp_path), [(n, 1) for n in RESHARD_CASES])
    w2 = run_distributed(_load_worker, 2, str(tmp_path), [("adamw", 2), ("adamw_tp2", 2), ("adamw_nodistopt", 1)])
    checks = (
        [(n, 1, dp3) for n in ("adamw", "muon", "adamw_nodistopt")]
        + [(n, 1, dp1) for n in RESHARD_CASES]
        + [("adamw", 2, w2), ("adamw_tp2", 2, w2), ("adamw_nodistopt", 1, w2)]
    )
    for name, tp, ranks in checks:
        key = (name, tp)
        loaded = assemble([r[key]["state"] for r in ranks], tp, vocab)
        _assert_same(saved[name], loaded, f"{name} at DP={len(ranks) // tp} TP={tp}")
        for r in ranks:
            assert (r[key]["step"], r[key]["consumed"], r[key]["params_match"]) == (2, 24, True), key
            assert torch.isfinite(torch.tensor(r[key]["loss"]))
        assert len({r[key]["loss"] for r in ranks}) == 1, key
    # export the TP=2 checkpoint to one consolidated file: it holds exactly the saved main params
    out = tmp_path / "tp2.pt"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/convert_checkpoint.py"),
            str(tmp_path / "adamw_tp2"),
            str(out),
            "--no-tokenizer",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    exported = torch.load(out, weights_only=True)["model"]
    assert exported.keys() == saved["adamw_tp2"].keys()
    for pname, t in exported.items():
        assert torch.equal(t, saved["adamw_tp2"][pname]["main"]), pname
    # the step after loading matches between layouts that hold the same state (fp32 reduction order aside)
    assert dp3[0][("adamw", 1)]["loss"] == pytest.approx(dp1[0][("adamw", 1)]["loss"], rel=1e-6)
    assert w2[0][("adamw", 2)]["loss"] == pytest.approx(dp1[0][("adamw", 1)]["loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------------
_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    sys.path.insert(0, {tests!r})
    from helpers import tiny_cfg, pctx_for
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.checkpointing import Checkpointer
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = tiny_cfg("checkpoint.dir=" + {root!r}, "checkpoint.keep_latest=1")
    pctx = pctx_for(1)
    model, buckets, reducer, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
    ck = Checkpointer(cfg, pctx, model, opt, reducer, None, print)
    if sys.argv[1] == "save":
        ck.save(1, 8)
        real = dcp.save
        def save_then_die(*a, **k):
            real(*a, **k)                          # the files of step 2 are written ...
            os.kill(os.getpid(), signal.SIGKILL)   # ... and the process dies before publishing them
        dcp.save = save_then_die
        ck.save(2, 16)
    else:
        print("RESUMED", ck.resume())
        ck.save(3, 24)
""")


def test_save_killed_midway_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ck"
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT.format(tests=str(ROOT / "tests"), root=str(root)))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(script), "save"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert (root / "latest").read_text().strip() == "step_00000001"
    assert (root / ".tmp-step_00000002").is_dir() and not (root / "step_00000002").exists()
    from megatron_geo.checkpoint.manager import latest_checkpoint

    assert latest_checkpoint(root).name == "step_00000001"
    r = subprocess.run([sys.executable, str(script), "load"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RESUMED (1, 8, 0)" in r.stdout
    # the next complete save removes the leftover and (keep_latest=1) the older checkpoint
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003"]


# ---------------------------------------------------------------------------------------------------
def _nan_worker(rank, world):
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    cfg = tiny_cfg("comm.dtype=fp8_e4m3", "comm.error_feedback=true")
    pctx = pctx_for(1)
    model, buckets, reducer, grad_sync, opt = build_model_and_optimizer(cfg, pctx)
    _steps(cfg, pctx, model, grad_sync, opt, 0, 1)
    before = [p.detach().clone() for p in model.parameters()]
    hook = None
    if rank == 1:  # poison this rank's activations only
        hook = model.layers[0].register_forward_hook(lambda m, i, o: o * float("nan"))
    mbs = rank_micro_batches(global_batch(cfg, 1), cfg.train.micro_batch_size, pctx.dp_rank, pctx.dp_size)
    res = train_step(StepContext(model, grad_sync, opt, pctx, 1.0), 1, mbs)
    if hook:
        hook.remove()
    unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    after = _steps(cfg, pctx, model, grad_sync, opt, 2, 1)[0]
    return {
        "skipped": res.skipped,
        "unchanged": unchanged,
        "after": after,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def test_nan_on_one_rank_is_skipped_on_all_ranks():
    r0, r1 = run_distributed(_nan_worker, 2)
    assert r0["skipped"] and r1["skipped"] and r0["unchanged"] and r1["unchanged"]
    assert torch.isfinite(torch.tensor(r0["after"])) and r0["after"] == r1["after"]
    assert torch.equal(r0["params"], r1["params"])


def test_consecutive_skips_stop_the_run():
    from megatron_geo.training.trainer import NonFiniteGradientError, handle_nonfinite

    class R:
        zeroed = 0

        def reset_error_feedback(self):
            self.zeroed += 1

    r = R()
    handle_nonfinite(5, float("nan"), "skip", r, in_a_row=2, max_in_a_row=3)
    assert r.zeroed == 1
    with pytest.raises(NonFiniteGradientError, match="3 consecutive steps .*max_skipped_steps=3"):
        handle_nonfinite(6, float("nan"), "skip", r, in_a_row=3, max_in_a_row=3)


# ---------------------------------------------------------------------------------------------------
def _wait_for_records(path: Path, n: int, procs, timeout: float = 120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"process exited early ({p.returncode}): {p.stderr.read()}")
        time.sleep(0.2)
    raise AssertionError(f"no {n} records in {path} after {timeout} s")


def _launch(run_dir: Path, corpus: list[str], *extra: str, env=None):
    args = tiny_train_overrides(run_dir, corpus, "train.steps=100000", "train.eval_interval=100000", *extra)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "pretrain_llama.py"), *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env or dict(os.environ),
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT-ctrl-c"])
def test_stop_signal_saves_checkpoint_and_exits_4(tmp_path, corpus, sig):
    run = tmp_path / "run"
    p = _launch(run, corpus)
    _wait_for_records(run / "metrics.jsonl", 2, [p])
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 4, err
    ck = run / "checkpoints"
    meta = json.loads((ck / (ck / "latest").read_text().strip() / "meta.json").read_text())
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert meta["step"] == steps[-1] >= 2
    assert "stopped by signal" in out and "relaunch with the same train.run_dir" in out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_killed_rank_makes_the_other_exit(tmp_path, corpus):
    run = tmp_path / "run"
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
        procs.append(_launch(run, corpus, "parallel.timeout_minutes=0.5", "checkpoint.save_at_end=false", env=env))
    _wait_for_records(run / "metrics.jsonl", 2, procs)
    procs[1].kill()
    t0 = time.time()
    _, err = procs[0].communicate(timeout=90)
    assert procs[0].returncode == 5 and "a collective failed: another rank died" in err, err
    assert time.time() - t0 < 60
    procs[1].communicate()


# ---------------------------------------------------------------------------------------------------
def _mismatch_worker(rank, world, root):
    from megatron_geo.config import ConfigError

    cfg, pctx, model, buckets, grad_sync, opt, ck = _build([], 1, Path(root))
    _steps(cfg, pctx, model, grad_sync, opt, 0, 1)
    ck.save(1, 8)
    errors = []
    for overrides in (["model.hidden_size=48"], ["optimizer.name=muon"]):
        try:
            _build(overrides, 1, Path(root))[-1].resume()
            errors.append("")
        except ConfigError as e:
            errors.append(str(e))
    logs = []
    from megatron_geo.training.checkpointing import Checkpointer
    from megatron_geo.training.setup import build_model_and_optimizer

    cfg2 = tiny_cfg(
        f"checkpoint.dir={root}",
        f"train.run_dir={root}",  # the same run (a checkpoint.dir of another run folder is refused)
        "comm.dtype=fp8_e4m3",
        "train.global_batch_size=12",
        "checkpoint.allow_changes=comm.dtype",
    )
    m2, b2, r2, g2, o2 = build_model_and_optimizer(cfg2, pctx)
    step = Checkpointer(cfg2, pctx, m2, o2, r2, None, logs.append).resume()[0]
    import torch.distributed as dist

    if rank == 0:  # truncate one data file of the checkpoint
        data = sorted((Path(root) / "step_00000001").glob("*.distcp"))[0]
        data.write_bytes(data.read_bytes()[:100])
    dist.barrier()
    try:
        Checkpointer(cfg2, pctx, m2, o2, r2, None, logs.append).resume()
        errors.append("")
    except ConfigError as e:
        errors.append(str(e))
    return errors, logs, step


def test_mismatched_checkpoint_is_a_clear_error(tmp_path):
    (errors, logs, step), _ = run_distributed(_mismatch_worker, 2, str(tmp_path))
    assert "model.hidden_size=32 but this run has model.hidden_size=48" in errors[0]
    assert "optimizer.name=adamw but this run has optimizer.name=muon" in errors[1]
    assert step == 1 and any(
        "comm.dtype changed on resume: 'fp32' -> 'fp8_e4m3'" in m and "allowed by checkpoint.allow_changes" in m
        for m in logs
    )
    assert "__0_0.distcp has 100 bytes but its entries end at byte" in errors[2] and "truncated" in errors[2], errors[2]


def test_piece_rectangles_tile_the_global_tensor():
    from megatron_geo.checkpoint.layout import global_shape, piece_rects

    for shape, pdim, tp, rows in (
        ((6, 5), 0, 2, None),
        ((6, 5), 1, 3, None),
        ((7, 4), 0, 2, 13),
        ((9,), None, 2, None),
    ):
        g = global_shape(shape, pdim, tp, rows)
        cover = torch.zeros(g, dtype=torch.int64)
        numel = int(torch.tensor(shape).prod())
        for t in range(tp if pdim is not None else 1):
            local = torch.arange(numel).view(shape) + 1000 * t
            full = (
                torch.cat([torch.arange(numel).view(shape) + 1000 * k for k in range(tp)], dim=pdim)
                if pdim is not None
                else local
            )
            if rows is not None:
                full = full[:rows]
            cuts = [0, 3, 4, numel // 2, numel - 1, numel]
            for lo, hi in zip(cuts, cuts[1:]):
                for r in piece_rects(shape, pdim, t, lo, hi, rows):
                    sl = tuple(slice(o, o + s) for o, s in zip(r.offsets, r.sizes))
                    assert torch.equal(local.reshape(-1)[r.flat_lo : r.flat_hi].view(r.sizes), full[sl])
                    cover[sl] += 1
        assert torch.equal(cover, torch.ones_like(cover)), (shape, pdim, tp)


def test_bad_checkpoint_load_values(tmp_path):
    from megatron_geo.checkpoint.manager import resolve_load
    from megatron_geo.config import ConfigError, load_config
    from megatron_geo.training.validate import validate_config

    with pytest.raises(ConfigError, match="checkpoint.load='/nonexistent' is not a folder"):
        validate_config(load_config([], ["checkpoint.load=/nonexistent"]), 1)
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        resolve_load(load_config([], [f"checkpoint.load={tmp_path}"]))
    damaged = tmp_path / "step_00000002"
    damaged.mkdir()
    (damaged / "meta.json").write_text(json.dumps({"format": "megatron-geo-dcp-v1", "step": 2}))
    from megatron_geo.checkpoint.manager import read_meta

    with pytest.raises(ConfigError, match="meta.json lacks consumed_samples, dp_size, tp_size, config"):
        read_meta(damaged)
    with pytest.raises(ConfigError, match="checkpoint.load=latest but .* holds no complete checkpoint"):
        resolve_load(load_config([], ["checkpoint.load=latest", f"train.run_dir={tmp_path}"]))
    assert resolve_load(load_config([], [f"train.run_dir={tmp_path}"])) is None


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo PWNED > /dev/null",))


def test_checkpoint_metadata_is_never_unpickled_freely(tmp_path):
    import pickle

    from megatron_geo.checkpoint.safe_reader import SafeFileSystemReader, UnsafeCheckpointError

    ck = tmp_path / "step_00000001"
    ck.mkdir()
    (ck / ".metadata").write_bytes(pickle.dumps(_Evil()))
    from megatron_geo.config import config_to_dict, load_config

    (ck / "meta.json").write_text(
        json.dumps(
            {
                "format": "megatron-geo-dcp-v1",
                "step": 1,
                "consumed_samples": 8,
                "dp_size": 1,
                "tp_size": 1,
                "config": config_to_dict(load_config()),
            }
        )
    )
    with pytest.raises(UnsafeCheckpointError, match="posix.system, which is not part of"):
        SafeFileSystemReader(str(ck)).read_metadata()
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/convert_checkpoint.py"), str(ck), str(tmp_path / "o.pt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "refusing to load it" in r.stderr, r.stderr


def test_truncated_data_file_and_damaged_meta_and_latest_are_clear_errors(tmp_path):
    import warnings

    import torch.distributed.checkpoint as dcp

    from megatron_geo.checkpoint.manager import read_meta, resolve_load
    from megatron_geo.checkpoint.safe_reader import SafeFileSystemReader, UnsafeCheckpointError
    from megatron_geo.config import ConfigError, config_to_dict, load_config

    ck = tmp_path / "checkpoints" / "step_00000004"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model/w": torch.arange(1000.0)}, checkpoint_id=str(ck), no_dist=True)
    assert SafeFileSystemReader(str(ck)).read_metadata().state_dict_metadata["model/w"].size == torch.Size([1000])
    data = sorted(ck.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(UnsafeCheckpointError, match="has .* bytes but its entries end at byte .* truncated"):
        SafeFileSystemReader(str(ck)).read_metadata()
    good = (ck / ".metadata").read_bytes()
    for garbage in (b"garbage\n", b"\x80\x04K\x07.", b"(lp0\nI1\naI2\na."):  # text, an int pickle, protocol 0
        (ck / ".metadata").write_bytes(garbage)
        with pytest.raises(
            UnsafeCheckpointError,
            match=r"(unreadable checkpoint metadata .*damaged.*checkpoint\.load"
            r"|does not hold DCP metadata)",
        ):
            SafeFileSystemReader(str(ck)).read_metadata()
    (ck / ".metadata").write_bytes(good)

    meta = {
        "format": "megatron-geo-dcp-v1",
        "step": 4,
        "consumed_samples": 32,
        "dp_size": "two",
        "tp_size": 1,
        "config": config_to_dict(load_config()),
    }
    (ck / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="dp_size='two', not a valid count"):
        read_meta(ck)
    (tmp_path / "checkpoints" / "latest").write_text("../../elsewhere/step_00000009\n")
    logs = []
    assert resolve_load(load_config([], [f"train.run_dir={tmp_path}"]), logs.append) == ck
    assert "not the name of a step_* folder" in logs[0] and "using the newest complete checkpoint" in logs[0]
    with pytest.raises(ConfigError, match="checkpoint.load=latest but .* not the name of a step_\\* folder"):
        resolve_load(load_config([], [f"train.run_dir={tmp_path}", "checkpoint.load=latest"]))
    # the only checkpoint damaged (its .metadata gone): auto never starts the run over from step 0 on top of it
    (tmp_path / "checkpoints" / "latest").write_text("step_00000004\n")
    (ck / ".metadata").unlink()
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.load=auto but .* names step_00000004, which is not a complete "
        r"checkpoint, and .* no other complete checkpoint.*checkpoint.load=none",
    ):
        resolve_load(load_config([], [f"train.run_dir={tmp_path}"]))
    assert resolve_load(load_config([], [f"train.run_dir={tmp_path}", "checkpoint.load=none"])) is None


# ---------------------------------------------------------------------------------------------------
# resuming from step N starts a new timeline; later checkpoints of the old one are moved aside


def test_resuming_from_an_earlier_step_moves_the_abandoned_timeline_aside(tmp_path, corpus):
    run = tmp_path / "run"
    ck = run / "checkpoints"
    first = tiny_train_overrides(run, corpus, "train.steps=6", "checkpoint.interval=2", "checkpoint.keep_latest=0")
    second = tiny_train_overrides(
        run,
        corpus,
        "train.steps=4",
        "checkpoint.interval=2",
        "checkpoint.keep_latest=1",
        f"checkpoint.load={ck / 'step_00000002'}",
    )
    run_distributed(_train_jobs, 1, [first])
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000002", "step_00000004", "step_00000006"]
    old4 = json.loads((ck / "step_00000004/meta.json").read_text())["saved_at"]
    run_distributed(_train_jobs, 1, [second])
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000004"]  # keep_latest=1 of the new one
    assert json.loads((ck / "step_00000004/meta.json").read_text())["step"] == 4
    aside = sorted(p.name.split("-")[0] for p in (ck / "abandoned").iterdir())
    assert aside == ["step_00000004", "step_00000006"]  # the old 4 and 6, kept aside
    assert (ck / "latest").read_text().strip() == "step_00000004"
    (ck / "latest").unlink()  # a crash before the pointer ...
    auto = tiny_train_overrides(run, corpus, "train.steps=5", "checkpoint.interval=0", "checkpoint.save_at_end=false")
    out = run_distributed(_train_jobs, 1, [auto])[0][0]  # ... auto resumes the new 4
    assert out["steps"] == 5
    recs = _records(run)
    assert [r["step"] for r in recs][-1] == 5 and old4


# ---------------------------------------------------------------------------------------------------
# a save that fails (disk full) is one error line, exit 6, no partial folder, the previous checkpoint intact

_ENOSPC_SCRIPT = textwrap.dedent("""
    import errno, sys
    import torch.distributed.checkpoint.filesystem as fs
    real, calls = fs.FileSystemWriter.write_data, [0]
    def full_disk(self, plan, planner):
        calls[0] += 1
        if calls[0] >= 2:                       # the second save runs out of space while writing its data
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, plan, planner)
    fs.FileSystemWriter.write_data = full_disk
    from megatron_geo.training.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_a_save_that_runs_out_of_disk_space_is_one_clear_error(tmp_path, corpus):
    run = tmp_path / "run"
    args = tiny_train_overrides(
        run,
        corpus,
        "train.steps=4",
        "checkpoint.interval=2",
        "checkpoint.keep_latest=1",
        "checkpoint.save_at_end=false",
    )
    r = subprocess.run(
        [sys.executable, "-c", _ENOSPC_SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 6, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left on device" in errors[0] and str(run / "checkpoints") in errors[0]
    assert "Traceback" not in r.stderr
    ck = run / "checkpoints"
    assert not list(ck.glob(".tmp-*"))  # the partial folder is gone
    assert (ck / "latest").read_text().strip() == "step_00000002"  # the previous one is intact
    assert json.loads((ck / "step_00000002/meta.json").read_text())["step"] == 2
