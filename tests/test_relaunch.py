"""Relaunches continue their own run: the start point (own checkpoint, an explicit one, a roll-back), the
settings a resume may not silently change (data order, global batch, learning-rate schedule), and the wandb
run id of a copied run folder."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from ckpt_helpers import make_corpus, tiny_train_overrides
from dist_harness import run_distributed
from megatron_geo.config import ConfigError, load_config


def _fake_checkpoint(root: Path, step: int, timeline: dict | None = None) -> Path:
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
    from megatron_geo.training.metrics import MetricsLogger, choose_wandb_id, read_wandb_id

    a = tmp_path / "A"
    a.mkdir()
    m = MetricsLogger(str(a), True, "offline", "megatron-geo-test", "g", "n", [], {}, resume_step=0)
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
    m = MetricsLogger(str(b), True, "offline", "megatron-geo-test", "g", "n", [], {}, resume_step=1)
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
