"""metrics.jsonl and the wandb sink (offline, the default), including a resumed run."""

from __future__ import annotations

import json

from megatron_geo.training.metrics import MetricsLogger, WandbSpec


def test_offline_wandb_run_and_resume_keep_one_run_and_the_records(tmp_path):
    def logger(resume_step):
        spec = WandbSpec("offline", "megatron-geo-test", "g", "n", ("t",), {"a": 1})
        return MetricsLogger(str(tmp_path), True, spec, resume_step=resume_step)

    m = logger(0)
    for step in (1, 2, 3):
        m.log({"step": step, "loss": 5.0 - step, "grad_norm": float("nan") if step == 2 else 1.0})
    m.close()
    run_id = json.loads((tmp_path / "wandb_run_id").read_text())["id"]
    assert run_id and list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    m = logger(2)  # resumed from the checkpoint of step 2: record 3 is dropped, the wandb run continues
    m.log({"step": 3, "loss": 1.5})
    m.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[1]["grad_norm"] is None and recs[2]["loss"] == 1.5
    assert json.loads((tmp_path / "wandb_run_id").read_text())["id"] == run_id


def test_a_new_timeline_logs_a_new_wandb_run_forked_from_the_kept_one(tmp_path):
    from megatron_geo.training.metrics import fork_of, read_wandb_id

    def logger(resume_step, new_timeline=False, lines=None):
        return MetricsLogger(
            str(tmp_path),
            True,
            WandbSpec("offline", "megatron-geo-test", "g", "n", config={"a": 1}),
            resume_step=resume_step,
            log=None if lines is None else lines.append,
            new_timeline=new_timeline,
        )

    m = logger(0)
    for step in (1, 2, 3, 4):
        m.log({"step": step, "loss": 5.0 - step})
    m.close()
    first = read_wandb_id(tmp_path)[0]
    # rolled back to the checkpoint of step 2: wandb would drop steps 3 and 4 of the new timeline in the old run
    lines: list[str] = []
    m = logger(2, new_timeline=True, lines=lines)
    assert m._wandb.config["forked_from"] == {"run": first, "step": 2} and m._wandb.name == "n-from-step2"
    m.log({"step": 3, "loss": 0.5})
    m.close()
    forked = read_wandb_id(tmp_path)[0]
    assert forked != first and forked.startswith(f"{first}-s2-") and fork_of(forked) == (first, 2)
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{forked}")) and list((tmp_path / "wandb").glob(f"*-{first}"))
    assert f"wandb: new run {forked}: this launch starts a new timeline at step 2, and run {first} keeps" in lines[0]
    # metrics.jsonl holds the new timeline; the replaced records are kept aside
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in recs] == [(1, 4.0), (2, 3.0), (3, 0.5)]
    (aside,) = tmp_path.glob("metrics.abandoned-*.jsonl")
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [3, 4]
    # a requeue of the new timeline continues the forked run
    m = logger(3)
    m.close()
    assert read_wandb_id(tmp_path)[0] == forked and fork_of(first) is None


def _no_wandb_credentials(monkeypatch, home):
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config/wandb"))


def test_wandb_credentials_are_found_where_wandb_looks(tmp_path, monkeypatch):
    from megatron_geo.training.wandb_login import wandb_credentials

    home = tmp_path / "home"
    home.mkdir()
    _no_wandb_credentials(monkeypatch, home)
    run = tmp_path / "run"
    assert wandb_credentials(str(run)) is None
    (home / ".netrc").write_text("machine example.org login u password p\n")  # another host's entry
    assert wandb_credentials(str(run)) is None
    (home / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_credentials(str(run)) == f"{home / '.netrc'} (machine api.wandb.ai)"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")  # a private server: its own entry
    assert wandb_credentials(str(run)) is None
    monkeypatch.setenv("NETRC", str(tmp_path / "other-netrc"))
    (tmp_path / "other-netrc").write_text("machine wandb.example.org login user password x\n")
    assert wandb_credentials(str(run)).startswith(str(tmp_path / "other-netrc"))
    monkeypatch.delenv("NETRC")
    (home / ".config/wandb").mkdir(parents=True)
    (home / ".config/wandb/settings").write_text("[default]\napi_key = " + "k" * 40 + "\n")
    assert wandb_credentials(str(run)) == "the wandb settings file"
    (home / ".config/wandb/settings").unlink()
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_credentials(str(run)) == "WANDB_API_KEY"


def test_online_wandb_without_a_key_exits_2_before_anything_starts(tmp_path, monkeypatch, capsys):

    from ckpt_helpers import golden_corpus_data, tiny_train_overrides, trap_process_group
    from megatron_geo.training.cli import main

    home = tmp_path / "home"
    home.mkdir()
    _no_wandb_credentials(monkeypatch, home)
    data = golden_corpus_data()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("kept: true\n")  # an existing run's record
    trap_process_group(monkeypatch)
    capsys.readouterr()
    rc = main(tiny_train_overrides(run, data, "train.steps=1", "logging.wandb=online"))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: logging.wandb=online but no W&B API key is set up on this machine")
    for fix in ("`wandb login`", "WANDB_API_KEY", "logging.wandb=offline"):
        assert fix in lines[0], lines[0]
    assert (
        sorted(p.name for p in run.iterdir()) == ["config.yaml"] and (run / "config.yaml").read_text() == "kept: true\n"
    )


def test_a_long_comm_label_becomes_wandb_tags_and_group_wandb_accepts(tmp_path):
    from pathlib import Path

    from megatron_geo.config import load_config
    from megatron_geo.training.metrics import wandb_text

    preset = str(Path(__file__).resolve().parent.parent / "configs/comm/geofp8.yaml")
    # a GeoFP8 preset with one geo override is labelled by its whole description (> 100 characters)
    label = load_config([preset], ["geo.refresh_interval=10"]).comm.label
    assert len(f"comm={label}") > 64
    other = load_config([preset], ["geo.refresh_interval=11"]).comm.label
    tags = (f"comm={label}", f"comm={other}", "dp=2")
    m = MetricsLogger(str(tmp_path), True, WandbSpec("offline", "megatron-geo-test", label * 2, label, tags))
    m.log({"step": 1, "loss": 1.0})
    assert all(len(t) <= 64 for t in m._wandb.tags) and len(set(m._wandb.tags)) == 3 and "dp=2" in m._wandb.tags
    assert len(m._wandb.group) <= 128
    m.close()
    assert wandb_text("x" * 64, 64) == "x" * 64 and wandb_text("x" * 65, 64) == wandb_text("x" * 65, 64)
    assert len(wandb_text("x" * 65, 64)) == 64
