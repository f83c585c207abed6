"""Run identity and readable logs (issue: comparisons that answer "which communication precision?").

- the ``comm`` label: a preset's name, a compact label of the changed keys, an explicit label; stacking two
  presets is an error (it used to merge them silently);
- a non-terminal stdout gets one Megatron-style line per ``train.log_interval`` steps (no ``\\r``), and the
  start-up line, the summary and ``config.yaml`` carry the label;
- the paper configs checkpoint every 500 steps.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_geo.config import ConfigError, load_config
from megatron_geo.config.label import derive_label
from megatron_geo.training.log_line import log_line, use_progress_bar

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs/tiny.yaml")
P = lambda name: str(ROOT / "configs/comm" / f"{name}.yaml")  # noqa: E731


@pytest.mark.parametrize(
    "files,overrides,label",
    [
        ([TINY], [], "fp32"),
        ([TINY, P("fp8")], [], "fp8"),
        ([TINY, P("fp8_ef")], [], "fp8_ef"),
        ([TINY, P("geofp8_search")], [], "geofp8_search"),
        ([TINY, P("fp8")], ["comm.error_feedback=true"], "fp8_ef"),  # equal settings, one name
        ([TINY, P("fp8")], ["comm.scale_sync=max"], "fp8_shared_scale"),
        ([TINY, P("fp8")], ["geo.rank=16"], "fp8"),  # geo keys count only with geo
        ([TINY], ["comm.dtype=fp8_e4m3"], "fp8"),
        ([TINY, P("fp8")], ["comm.rounding=stochastic"], "fp8_e4m3+sr"),
        (
            [TINY, P("geofp8_tensor")],
            ["geo.refresh_interval=10"],
            "fp8_e4m3+ef+geo(r32,p=auto,layers=layers.*.attn.*_proj.weight,layers.*.mlp.*_proj.weight,output.weight,refresh=10)",
        ),
        (
            [TINY, P("geofp8_tensor")],
            ["geo.damping=0.1", "geo.statistics=sketch"],
            "fp8_e4m3+ef+geo(r32,p=auto,layers=layers.*.attn.*_proj.weight,layers.*.mlp.*_proj.weight,output.weight,damp=0.1,stats=sketch)",
        ),
        ([TINY, P("fp8")], ["comm.compile=true", "train.steps=3"], "fp8"),  # how it runs, not what it sends
        ([TINY, P("geofp8_search")], ["comm.telemetry_interval=20", "logging.wandb=disabled"], "geofp8_search"),
        (
            [TINY, P("geofp8_tensor")],
            ["geo.rank=16"],
            "fp8_e4m3+ef+geo(r16,p=auto,layers=layers.*.attn.*_proj.weight,layers.*.mlp.*_proj.weight,output.weight)",
        ),
        (
            [TINY],
            ["comm.dtype=fp8_e4m3", "comm.transform=geo", "comm.error_feedback=true", "geo.power_search=0.5,0.25"],
            "fp8_e4m3+ef+geo(r32,p=search)",
        ),
        (
            [TINY],
            [
                "comm.dtype=fp8_e4m3",
                "comm.scaling=block",
                "comm.block_size=64",
                "comm.rounding=stochastic",
                "comm.scale_sync=max",
            ],
            "fp8_e4m3+block64+sr+shared",
        ),
        ([TINY, P("fp8")], ["comm.label=my-run"], "my-run"),
    ],
)
def test_comm_label(files, overrides, label):
    assert load_config(files, overrides).comm.label == label


def test_every_preset_gets_a_distinct_label_and_its_keys_alone():
    presets = sorted(p.stem for p in (ROOT / "configs/comm").glob("*.yaml"))
    labels = [load_config([TINY, P(p)]).comm.label for p in presets]
    assert labels == presets
    derived = {derive_label(load_config([TINY, P(p)])) for p in presets}
    assert len(derived) == len(presets), "the derived labels also tell every preset apart"


def test_a_reloaded_config_yaml_keeps_its_label_only_while_its_settings_hold(tmp_path):
    from megatron_geo.config import dump_config

    f = tmp_path / "config.yaml"
    f.write_text(dump_config(load_config([TINY, P("fp8")], ["comm.label=mine"])))
    assert load_config([str(f)]).comm.label == "mine"
    assert load_config([str(f)], ["train.steps=3", "comm.compile=true"]).comm.label == "mine"
    assert load_config([str(f)], ["comm.error_feedback=true"]).comm.label == "fp8_ef"
    assert load_config([str(f)], ["comm.dtype=bf16"]).comm.label == "bf16"


def test_different_geo_settings_get_different_labels():
    keys = [
        "geo.refresh_interval=10",
        "geo.damping=0.1",
        "geo.layers=layers.*.mlp.up_proj.weight",
        "geo.statistics=sketch",
        "geo.ef_on_refresh=reset",
        "geo.sketch_size=16",
        "geo.select=auto",
    ]
    labels = [load_config([TINY, P("geofp8")], [k]).comm.label for k in keys]
    assert len(set(labels)) == len(keys) and "geofp8" not in labels


def test_stacking_two_presets_is_an_error_and_a_preset_replaces_comm():
    with pytest.raises(ConfigError, match="both comm presets"):
        load_config([TINY, P("geofp8"), P("fp8")])
    cfg = load_config([TINY, P("fp8")])
    assert cfg.comm.transform == "none" and not cfg.comm.error_feedback
    with pytest.raises(ConfigError, match="after the comm preset .*pass the preset last"):
        load_config([P("fp8"), TINY])  # tiny.yaml's comm.dtype=fp32 would silently replace the preset


def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert use_progress_bar(True, Tty()) and not use_progress_bar(True, io.StringIO())
    assert not use_progress_bar(False, Tty())


def test_log_line_fields():
    rec = {
        "step": 120,
        "loss": 3.45214,
        "lr": 2.99e-4,
        "grad_norm": 0.8123,
        "tokens_per_sec": 1677722.0,
        "step_time_s": 1.25,
        "comm_bytes": 45_200_000,
        "val_loss": 3.5,
    }
    line = log_line(rec, 20000, [1.25, 1.25], 3)
    assert line == (
        "step 120/20000 | loss 3.4521 | val loss 3.5000 | lr 2.990e-04 | grad norm 0.812 | "
        "1,677,722 tok/s | 1.250 s/step | comm 45.2 MB/rank | skipped 3 | ETA 6h54m"
    )


def test_non_terminal_run_prints_one_line_per_log_interval_with_the_label(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "pretrain_llama.py"),
            "--config",
            TINY,
            "--config",
            P("fp8_ef"),
            "train.steps=6",
            "train.log_interval=2",
            f"train.run_dir={tmp_path / 'run'}",
            "train.global_batch_size=4",
            "train.eval_batches=1",
            "model.seq_length=32",
            "logging.wandb=disabled",
            "checkpoint.save_at_end=false",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stdout + r.stderr
    steps = re.findall(
        r"^step (\d+)/6 \| loss [\d.]+ \|.* \| grad norm [\d.]+ \| [\d,]+ tok/s \| [\d.]+ s/step \| "
        r"comm [\d.,]+ MB/rank \| skipped 0 \| ETA \S+$",
        r.stdout,
        re.M,
    )
    assert steps == ["2", "4", "6"], r.stdout
    assert "comm=fp8_ef (comm.dtype=fp8_e4m3)" in r.stdout
    assert re.search(r"^summary: 6 steps, .* comm=fp8_ef", r.stdout, re.M)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["comm"]["label"] == "fp8_ef"


def test_paper_configs_checkpoint_every_500_steps():
    for m in ("llama_300m", "llama_600m"):
        c = load_config([str(ROOT / "configs" / f"{m}.yaml")]).checkpoint
        assert (c.interval, c.keep_latest) == (500, 2)


def test_print_config_outside_a_launcher_checks_the_smallest_fitting_world():
    r = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_llama.py"), "--config", TINY, "parallel.tensor=2", "--print-config"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={
            k: v
            for k, v in __import__("os").environ.items()
            if k not in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")
        },
    )
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["parallel"]["tensor"] == 2


def test_a_renamed_preset_is_named_with_its_new_name(tmp_path):
    """The block-scaled GeoFP8 preset was folded into geofp8: the old file name says so where it is refused."""
    from megatron_geo.config.renamed import RENAMED_PRESETS

    assert set(RENAMED_PRESETS).isdisjoint(p.stem for p in (ROOT / "configs/comm").glob("*.yaml"))
    with pytest.raises(ConfigError, match=r"not found .*; preset geofp8_block is now geofp8 "):
        load_config([TINY, str(ROOT / "configs/comm/geofp8_block.yaml")])
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools/run_comparison.py"), "--config", TINY, "--presets", "geofp8_block"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2 and "unknown comm preset 'geofp8_block'; preset geofp8_block is now geofp8" in r.stderr
