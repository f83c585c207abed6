"""Relaunches continue their own run: the start point (own checkpoint, an explicit one, a roll-back), the
settings a resume may not silently change (data order, global batch, learning-rate schedule), and the wandb
run id of a copied run folder."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from ckpt_helpers import golden_corpus_data, make_corpus, tiny_train_overrides, trap_process_group
from dist_harness import run_distributed
from megatron_geo.config import ConfigError, load_config


def _fake_checkpoint(root: Path, step: int, timeline: dict | None = None, **extra) -> Path:
    """A folder that passes the completeness checks (meta.json with the required keys and a .metadata)."""
    p = root / f"step_{step:08d}"
    p.mkdir(parents=True)
    meta = {
        "format": "megatron-geo-dcp-v1",
        "step": step,
        "consumed_samples": 8 * step,
        "dp_size": 1,
        "tp_size": 1,
        "config": {},
        **extra,
    }
    if timeline is not None:
        meta["timeline"] = timeline
    (p / "meta.json").write_text(json.dumps(meta))
    (p / ".metadata").write_bytes(b"")
    (root / "latest").write_text(p.name + "\n")
    return p


def resolve_start(cfg):
    from megatron_geo.checkpoint.start import resolve_start as resolve

    return resolve(cfg)


def _cfg(run_dir: Path, load: str):
    return load_config([], [f"train.run_dir={run_dir}", f"checkpoint.load={load}"])


def test_the_start_point_of_every_relaunch(tmp_path):
    a_step2 = _fake_checkpoint(tmp_path / "A/checkpoints", 2)
    b = tmp_path / "B"
    # an empty run folder: the explicit checkpoint initialises it
    sp = resolve_start(_cfg(b, str(a_step2)))
    assert (sp.kind, sp.path) == ("init", a_step2) and str(a_step2) in sp.reason
    # the run saved its own checkpoint (timeline from A's step 2): a relaunch resumes it, not A's again
    own = _fake_checkpoint(b / "checkpoints", 4, {"start": "init", "from": str(a_step2.resolve()), "from_step": 2})
    sp = resolve_start(_cfg(b, str(a_step2)))
    assert (sp.kind, sp.path) == ("resume", own) and "not loaded" in sp.reason
    # the same when the explicit checkpoint is gone meanwhile (pruned, moved)
    shutil.rmtree(a_step2)
    assert resolve_start(_cfg(b, str(a_step2))).path == own
    from megatron_geo.training.validate import check_inputs, validate_config

    validate_config(_cfg(b, str(a_step2)), 1)  # the start-up checks accept the gone path: the run has its own
    check_inputs(_cfg(b, str(a_step2)), devices=False)
    with pytest.raises(ConfigError, match="is not a folder"):
        validate_config(_cfg(tmp_path / "G", str(a_step2)), 1)
    # an own checkpoint of another timeline also wins: a run folder never restarts from somewhere else
    c_own = _fake_checkpoint(tmp_path / "C/checkpoints", 3)
    other = _fake_checkpoint(tmp_path / "D/checkpoints", 9)
    sp = resolve_start(_cfg(tmp_path / "C", str(other)))
    assert (sp.kind, sp.path) == ("resume", c_own) and "new train.run_dir" in sp.reason
    # auto / latest / none
    assert resolve_start(_cfg(b, "auto")).path == own
    assert resolve_start(_cfg(tmp_path / "E", "auto")).kind == "fresh"
    assert resolve_start(_cfg(b, "none")).kind == "fresh"
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_start(_cfg(tmp_path / "F", str(tmp_path / "nowhere")))


def test_a_roll_back_happens_once(tmp_path):
    root = tmp_path / "R/checkpoints"
    s2 = _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4)
    s6 = _fake_checkpoint(root, 6)
    sp = resolve_start(_cfg(tmp_path / "R", str(s2)))
    assert (sp.kind, sp.path) == ("rollback", s2)
    # pointing at the newest own checkpoint is a plain resume
    assert resolve_start(_cfg(tmp_path / "R", str(s6))).kind == "resume"
    # after the roll-back the new timeline saved step 4 (its 'from' is step 2): the same command resumes it
    shutil.rmtree(root / "step_00000004")
    shutil.rmtree(s6)
    new4 = _fake_checkpoint(root, 4, {"start": "rollback", "from": str(s2.resolve()), "from_step": 2})
    sp = resolve_start(_cfg(tmp_path / "R", str(s2)))
    assert (sp.kind, sp.path) == ("resume", new4)


def test_a_damaged_own_checkpoint_is_never_started_over_from_an_explicit_one(tmp_path):
    a = _fake_checkpoint(tmp_path / "A/checkpoints", 2)
    root = tmp_path / "B/checkpoints"
    root.mkdir(parents=True)
    (root / "latest").write_text("step_00000004\n")  # names a folder that is not complete
    with pytest.raises(ConfigError, match="would silently start its timeline over"):
        resolve_start(_cfg(tmp_path / "B", str(a)))


def _saved_by(run_dir: Path) -> dict:
    """What a checkpoint of today records of its run folder (meta.json ``run_dir``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return {"run_dir": {"path": str(run_dir.resolve()), "inode": run_dir.stat().st_ino}}


def test_a_shared_checkpoint_dir_never_continues_another_run_folder(tmp_path):
    shared = tmp_path / "shared"
    a, b = tmp_path / "A", tmp_path / "B"
    s2 = _fake_checkpoint(shared, 2, **_saved_by(a))

    def start(run_dir, load):
        return resolve_start(
            load_config([], [f"train.run_dir={run_dir}", f"checkpoint.dir={shared}", f"checkpoint.load={load}"])
        )

    # run A (its own checkpoint) resumes; run B is refused whatever checkpoint.load says: resuming would train A's
    # timeline on, none would move A's checkpoints aside, a roll-back would cut A's timeline
    assert (start(a, "auto").kind, start(a, "auto").path) == ("resume", s2)
    for load in ("auto", "latest", "none", str(s2)):
        with pytest.raises(ConfigError) as e:
            start(b, load)
        msg = str(e.value)
        assert msg.startswith(f"checkpoint.dir={shared} holds step_00000002, saved by the run folder {a.resolve()},")
        assert f"train.run_dir={b.resolve()}" in msg and "its own checkpoint.dir" in msg, msg
        assert f"checkpoint.load={s2}" in msg, msg
    # a checkpoint of an earlier version names its folder by the config's train.run_dir
    legacy = tmp_path / "legacy"
    _fake_checkpoint(legacy, 3, config={"train": {"run_dir": str(a)}})
    with pytest.raises(ConfigError, match=f"saved by the run folder {a.resolve()}"):
        resolve_start(load_config([], [f"train.run_dir={b}", f"checkpoint.dir={legacy}"]))
    assert resolve_start(load_config([], [f"train.run_dir={a}", f"checkpoint.dir={legacy}"])).kind == "resume"
    # a run folder moved within its file system (same inode) keeps its outside checkpoint.dir
    moved = tmp_path / "A-moved"
    a.rename(moved)
    assert start(moved, "auto").path == s2


def test_a_moved_run_folder_resumes_its_own_checkpoints(tmp_path):
    old = tmp_path / "old"
    own = _fake_checkpoint(old / "checkpoints", 4, **_saved_by(old))
    new = tmp_path / "elsewhere" / "new"
    new.parent.mkdir()
    shutil.copytree(old, new)  # a copy (another inode) and a path the checkpoint does not name
    shutil.rmtree(old)
    sp = resolve_start(_cfg(new, "auto"))
    assert (sp.kind, sp.path) == ("resume", new / "checkpoints" / own.name)
    # an explicit checkpoint.dir inside the run folder is the folder's own as well
    cfg = load_config([], [f"train.run_dir={new}", f"checkpoint.dir={new}/checkpoints", "checkpoint.load=auto"])
    assert resolve_start(cfg).kind == "resume"


def test_an_explicit_checkpoint_that_does_not_exist_is_an_error_also_beside_own_checkpoints(tmp_path):
    root = tmp_path / "R/checkpoints"
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4)
    typo = root / "step_0000002"  # a digit short
    with pytest.raises(ConfigError) as e:
        resolve_start(_cfg(tmp_path / "R", str(typo)))
    msg = str(e.value)
    assert msg.startswith(f"checkpoint.load={str(typo)!r} does not exist; {root} holds step_00000002, step_00000004")
    assert "checkpoint.load=auto to resume this run's newest checkpoint" in msg, msg
    # the same in a folder without checkpoints, naming those next to the path
    with pytest.raises(ConfigError, match=f"does not exist; {root} holds step_00000002, step_00000004.*start fresh"):
        resolve_start(_cfg(tmp_path / "S", str(typo)))
    # a folder that exists but holds no complete checkpoint is refused too
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a complete checkpoint"):
        resolve_start(_cfg(tmp_path / "R", str(tmp_path / "empty")))
    # a roll-back whose source was pruned since: the new timeline began there, so a requeue resumes it
    s2 = root / "step_00000002"
    shutil.rmtree(root / "step_00000004")
    new6 = _fake_checkpoint(root, 6, {"start": "rollback", "from": str(s2.resolve()), "from_step": 2})
    shutil.rmtree(s2)
    sp = resolve_start(_cfg(tmp_path / "R", str(s2)))
    assert (sp.kind, sp.path) == ("resume", new6) and "its timeline started from it" in sp.reason


def _main_error(args, capsys, monkeypatch) -> tuple[int, list[str]]:
    """``pretrain_llama.py ARGS`` in this process: (exit code, stderr lines); starting a process group fails."""
    from megatron_geo.training import cli

    trap_process_group(monkeypatch)
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    return rc, [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def test_a_launch_on_another_runs_checkpoints_or_a_missing_path_exits_2_before_starting(tmp_path, capsys, monkeypatch):
    data = golden_corpus_data()
    shared, a, b = tmp_path / "shared", tmp_path / "A", tmp_path / "B"
    _fake_checkpoint(shared, 2, config={"train": {"run_dir": str(a)}})
    b.mkdir()
    (b / "config.yaml").write_text("kept: true\n")
    rc, lines = _main_error(
        tiny_train_overrides(b, data, "train.steps=4", "comm.dtype=bf16", f"checkpoint.dir={shared}"),
        capsys,
        monkeypatch,
    )
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: checkpoint.dir={shared} holds step_00000002")
    assert str(a.resolve()) in lines[0] and str(b.resolve()) in lines[0]
    assert (b / "config.yaml").read_text() == "kept: true\n" and sorted(p.name for p in shared.iterdir()) == [
        "latest",
        "step_00000002",
    ]
    # a typo in checkpoint.load beside the run's own checkpoints
    own = _fake_checkpoint(b / "checkpoints", 2)
    typo = f"{b}/checkpoints/step_0000002"
    rc, lines = _main_error(
        tiny_train_overrides(b, data, "train.steps=4", f"checkpoint.load={typo}"), capsys, monkeypatch
    )
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"error: checkpoint.load={typo!r} does not exist")
    assert f"{b / 'checkpoints'} holds {own.name}" in lines[0]


# ---- end to end: a requeued run continues its own timeline ----------------------------------------------


def _jobs_worker(rank, world, jobs):
    from helpers import pctx_for
    from megatron_geo.config import load_config
    from megatron_geo.training.trainer import train
    from megatron_geo.training.validate import validate_config

    out = []
    for overrides in jobs:
        cfg = load_config([], overrides)
        try:
            validate_config(cfg, world)
            s = train(cfg, pctx_for(1))
            out.append({"start_step": s.get("start_step", 0), "steps": s["steps"]})
        except ConfigError as e:
            out.append({"error": str(e)})
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if r.get("loss") is not None}


def test_a_requeued_run_from_an_explicit_checkpoint_gets_past_its_first_preemption(tmp_path):
    data = make_corpus(tmp_path / "data")
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    first = tiny_train_overrides(a, data, "train.steps=2", "train.log_interval=1")
    load = f"checkpoint.load={a}/checkpoints/step_00000002"
    requeued = tiny_train_overrides(
        b, data, "train.steps=6", load, "checkpoint.interval=2", "train.exit_interval=4", "train.log_interval=1"
    )
    straight = tiny_train_overrides(c, data, "train.steps=6", load, "train.log_interval=1")
    out = run_distributed(_jobs_worker, 1, [first, requeued, requeued, requeued, straight])[0]
    assert [o.get("start_step") for o in out] == [0, 2, 4, 6, 2], out
    assert not (b / "checkpoints/abandoned").exists()
    # the independent reference: one launch from A's step 2 to step 6 without preemption
    lb, lc = _losses(b), _losses(c)
    assert sorted(lb) == [3, 4, 5, 6] and all(lb[s] == lc[s] for s in lb), (lb, lc)
    tl = json.loads((b / "checkpoints/step_00000006/meta.json").read_text())["timeline"]
    assert tl == {"start": "init", "from": str((a / "checkpoints/step_00000002").resolve()), "from_step": 2}


def _lr(step0: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """Linear warmup then cosine to min_lr at the last step (written out, independent of the schedule module)."""
    if step0 < warmup:
        return lr * (step0 + 1) / warmup
    t = min(max((step0 - warmup) / (total - 1 - warmup), 0.0), 1.0)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * t))


def test_a_resume_refuses_a_new_seed_batch_or_schedule_unless_allowed(tmp_path):
    data = make_corpus(tmp_path / "data")
    r = tmp_path / "R"
    base = tiny_train_overrides(r, data, "optimizer.lr=3e-3", "optimizer.min_lr=3e-4", "train.log_interval=1")
    jobs = [
        base + ["train.steps=6"],
        base + ["train.steps=12"],  # extending a finished cosine run
        base + ["train.steps=12", "train.seed=7"],  # and a new data order
        base + ["train.steps=6", "train.global_batch_size=16"],  # nothing to train, but refused first
        base + ["train.steps=12", "checkpoint.allow_changes=train.steps"],
    ]
    out = run_distributed(_jobs_worker, 1, jobs)[0]
    assert out[0]["steps"] == 6
    e = out[1]["error"]
    want7 = _lr(6, 3e-3, 3e-4, 2, 12)
    assert "train.steps 6 -> 12" in e and f"step 7 becomes {want7:.3e}" in e and f"gives {3e-4:.3e}" in e, e
    assert "checkpoint.allow_changes=train.steps" in e
    e = out[2]["error"]
    assert "train.seed changed on resume: '1234' -> '7'" in e or "train.seed changed on resume: 1234 -> 7" in e, e
    assert "checkpoint.allow_changes=train.seed,train.steps" in e, e
    assert "train.global_batch_size changed on resume: 8 -> 16" in out[3]["error"]
    assert out[4] == {"start_step": 6, "steps": 12}
    recs = {x["step"]: x for x in map(json.loads, (r / "metrics.jsonl").read_text().splitlines())}
    assert recs[7]["lr"] == pytest.approx(want7, rel=1e-12)
    # the permission is for that launch only: neither config.yaml nor the checkpoint records it
    assert load_config([str(r / "config.yaml")]).checkpoint.allow_changes == ""
    meta = json.loads((r / "checkpoints/step_00000012/meta.json").read_text())
    assert meta["config"]["checkpoint"]["allow_changes"] == "" and meta["config"]["train"]["steps"] == 12
    assert recs[6]["lr"] == pytest.approx(3e-4, rel=1e-12)  # the first launch's last step, kept


def test_extending_a_run_inside_its_warmup_is_no_change(tmp_path):
    from megatron_geo.checkpoint.resume_changes import check_resume_changes
    from megatron_geo.config import config_to_dict

    saved = config_to_dict(load_config([], ["train.steps=4", "train.warmup_steps=20"]))
    notes = check_resume_changes(saved, load_config([], ["train.steps=8", "train.warmup_steps=20"]), 4, "resume")
    assert notes and "unchanged" in notes[0]
    with pytest.raises(ConfigError, match="train.warmup_steps 20 -> 10"):
        check_resume_changes(saved, load_config([], ["train.steps=8", "train.warmup_steps=10"]), 4, "resume")
    # a run started from another checkpoint starts a new trajectory: reported, not refused
    notes = check_resume_changes(saved, load_config([], ["train.steps=8", "train.seed=9"]), 4, "init")
    assert any(n.startswith("train.seed changed") for n in notes)
    notes = check_resume_changes(
        saved, load_config([], ["train.steps=4", "train.warmup_steps=20", "optimizer.weight_decay=0.3"]), 4, "resume"
    )
    assert notes == ["optimizer.weight_decay changed on resume: 0.1 -> 0.3"]
    with pytest.raises(ConfigError, match="never refuses"):
        check_resume_changes(saved, load_config([], ["checkpoint.allow_changes=train.micro_batch_size"]), 4, "resume")


def test_a_fresh_start_moves_the_folders_earlier_checkpoints_aside(tmp_path):
    data = make_corpus(tmp_path / "data")
    r = tmp_path / "R"
    base = tiny_train_overrides(r, data, "train.steps=2")
    out = run_distributed(
        _jobs_worker,
        1,
        [
            base,
            base + ["checkpoint.load=none", "train.steps=1"],
            base + ["train.steps=1"],
            base + ["train.global_batch_size=1000000"],
        ],
    )[0]
    assert [o.get("start_step") for o in out[:3]] == [0, 0, 1]
    # a global batch larger than the whole training set is refused before any step (it used to allocate it)
    assert "train.global_batch_size=1000000 is larger than the whole training set" in out[3]["error"]
    ck = r / "checkpoints"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000001"]
    assert [p.name.split("-")[0] for p in (ck / "abandoned").iterdir()] == ["step_00000002"]


# ---- wandb run identity --------------------------------------------------------------------------------


def test_a_copied_run_folder_gets_a_new_wandb_run_id(tmp_path):
    from megatron_geo.training.metrics import MetricsLogger, WandbSpec, choose_wandb_id, read_wandb_id

    a = tmp_path / "A"
    a.mkdir()
    spec = WandbSpec("offline", "megatron-geo-test", "g", "n")
    m = MetricsLogger(str(a), True, spec, resume_step=0)
    m.log({"step": 1, "loss": 1.0})
    m.close()
    run_id, _ = read_wandb_id(a)
    assert run_id and list((a / "wandb").glob(f"offline-run-*-{run_id}"))
    assert choose_wandb_id(a, 1)[0] == run_id  # a relaunch in the folder continues the run
    assert choose_wandb_id(a, 0)[0] != run_id  # a fresh run in it is a new run
    b = tmp_path / "B"
    shutil.copytree(a, b)
    new, why = choose_wandb_id(b, 1)
    assert new != run_id and "copy of" in why and str(a.resolve()) in why
    assert choose_wandb_id(b, 1, "must")[0] == run_id
    assert choose_wandb_id(a, 1, "never")[0] != run_id
    moved = tmp_path / "A-moved"
    a.rename(moved)  # moved, not copied: the same run
    assert choose_wandb_id(moved, 1)[0] == run_id
    m = MetricsLogger(str(b), True, spec, resume_step=1)
    m.close()
    assert read_wandb_id(b)[0] not in (None, run_id) and read_wandb_id(moved)[0] == run_id
    # the one-line file of earlier versions is still read (it names no folder: treated as this one)
    (b / "wandb_run_id").write_text("abc123\n")
    assert choose_wandb_id(b, 1)[0] == "abc123"
    with pytest.raises(ConfigError, match="wandb_resume=must"):
        choose_wandb_id(tmp_path, 1, "must")


def test_a_complete_checkpoint_newer_than_latest_is_resumed_not_abandoned(tmp_path):
    # a save published (verified, renamed) but stopped before the pointer was rewritten
    root = tmp_path / "R/checkpoints"
    _fake_checkpoint(root, 4)
    s5 = _fake_checkpoint(root, 5)
    (root / "latest").write_text("step_00000004\n")
    assert resolve_start(_cfg(tmp_path / "R", "auto")).path == s5
    assert resolve_start(_cfg(tmp_path / "R", "latest")).path == s5


def test_start_up_values_that_used_to_crash_later_are_config_errors(tmp_path):
    from megatron_geo.training.checkpointing import resume_hint
    from megatron_geo.training.metrics import read_wandb_id
    from megatron_geo.training.validate import validate_config

    for seed in ("-1", str(2**70)):  # torch.manual_seed / the sampler failed with a traceback
        with pytest.raises(ConfigError, match=r"train.seed=.* must be in \[0, 2\*\*63\)"):
            validate_config(load_config([], [f"train.seed={seed}"]), 1)
    f = tmp_path / "c.yaml"
    f.write_bytes("train:\n  steps: 5\n".encode("utf-16"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config([str(f)])
    (tmp_path / "wandb_run_id").write_text("garbage{\n")  # a damaged id file is never used as an id
    assert read_wandb_id(tmp_path) == (None, None)
    assert "checkpoint.load=auto" in resume_hint(load_config([], ["checkpoint.load=none"]))
    assert "same train.run_dir" in resume_hint(load_config([], []))


def test_a_roll_back_logs_into_a_new_wandb_run(tmp_path):
    from megatron_geo.training.metrics import read_wandb_id

    data = make_corpus(tmp_path / "data")
    r = tmp_path / "R"
    base = tiny_train_overrides(r, data, "train.steps=4", "checkpoint.interval=2", "logging.wandb=offline")
    first = run_distributed(_jobs_worker, 1, [base])[0]
    assert first == [{"start_step": 0, "steps": 4}]
    kept = read_wandb_id(r)[0]
    again = run_distributed(_jobs_worker, 1, [base + [f"checkpoint.load={r}/checkpoints/step_00000002"]])[0]
    assert again == [{"start_step": 2, "steps": 4}]
    forked = read_wandb_id(r)[0]
    assert forked != kept and forked.startswith(f"{kept}-s2-"), (kept, forked)
    assert list((r / "wandb").glob(f"offline-run-*-{kept}")) and list((r / "wandb").glob(f"offline-run-*-{forked}"))
