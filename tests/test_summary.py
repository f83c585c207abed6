"""The end-of-run summary block: counts read as English, the figures as given."""

from pathlib import Path

from megatron_geo.config import load_config
from megatron_geo.training.summary import format_summary

ROOT = Path(__file__).resolve().parent.parent


def _summary(steps: int) -> dict:
    return {
        "parameters": 1234,
        "steps": steps,
        "start_loss": 8.0,
        "final_loss": 7.5,
        "val_loss": None,
        "tokens_per_sec": 10.0,
        "comm_bytes_per_step": 100.0,
        "comm_gather_bytes_per_step": 0.0,
        "run_dir": "runs/x",
        "checkpoint": None,
        "start_step": 0,
    }


def test_one_step_is_singular_and_more_are_plural():
    cfg = load_config([str(ROOT / "configs/tiny.yaml")], ["train.steps=1"])
    one = format_summary(_summary(1), cfg).splitlines()[1]
    assert one.startswith("summary: 1 step, 1,234 parameters")
    cfg = load_config([str(ROOT / "configs/tiny.yaml")], ["train.steps=6"])
    six = format_summary(_summary(6), cfg).splitlines()[1]
    assert six.startswith("summary: 6 steps, 1,234 parameters")
    assert format_summary(_summary(2), cfg).splitlines()[1].startswith("summary: 2 steps of train.steps=6, ")
