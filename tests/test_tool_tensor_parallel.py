"""tools/dry_run.py and tools/plan_report.py plan for the tensor-parallel size of the config files and overrides
(``parallel.tensor``) unless ``--tp`` is given; ``--tp`` and a ``parallel.tensor=`` override that differ are one
error line."""

import json

import pytest

from ckpt_helpers import TINY_MODEL
from helpers import load_tool, one_error_line

TINY = [
    *TINY_MODEL,
    "model.vocab_size=131",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "logging.wandb=disabled",
    "train.device=cpu",
]


@pytest.fixture
def configs(tmp_path):
    """configs/tiny.yaml (parallel.tensor 1), then a file that sets parallel.tensor 2."""
    from pathlib import Path

    tp2 = tmp_path / "tp2.yaml"
    tp2.write_text("parallel:\n  tensor: 2\n")
    root = Path(__file__).resolve().parent.parent
    return ["--config", str(root / "configs/tiny.yaml"), "--config", str(tp2)]


@pytest.fixture
def dry_run(monkeypatch):
    import megatron_geo.model.llama as llama

    monkeypatch.setattr(llama, "_init", llama._init)  # the tool swaps in its fast initialisation; put it back
    return load_tool("dry_run")


def _dry(dry_run, capsys, tmp_path, *args) -> tuple[str, dict]:
    out = tmp_path / "dry.json"
    capsys.readouterr()
    assert dry_run.main([*args, "--dp", "2", "--steps", "1", "--json", str(out), *TINY]) == 0
    return capsys.readouterr().out.splitlines()[0], json.loads(out.read_text())


def test_dry_run_takes_the_tensor_parallel_size_of_the_config_files(dry_run, configs, capsys, tmp_path):
    header, figures = _dry(dry_run, capsys, tmp_path, *configs)
    assert header.startswith("dry run: rank 0 of DP=2 x TP=2 on cpu") and figures["tp"] == 2
    # the fake group skips the forward's tensor-parallel all-reduces: no loss is shown at TP > 1
    assert "no loss at TP > 1" in header and figures["rank0_step1_loss"] is None


def test_dry_run_tp_flag_wins_over_the_config_files(dry_run, configs, capsys, tmp_path):
    header, figures = _dry(dry_run, capsys, tmp_path, *configs, "--tp", "1")
    assert "DP=2 x TP=1 " in header and figures["tp"] == 1
    assert "rank 0's step-1 loss" in header and figures["rank0_step1_loss"] > 0


def test_plan_report_takes_the_same_size_from_the_same_files(configs, capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert load_tool("plan_report").main([*configs, "--dp", "2", "--json", str(out), *TINY]) == 0
    assert capsys.readouterr().out.startswith("DP=2 TP=2 ") and json.loads(out.read_text())["tp"] == 2


@pytest.mark.parametrize("tool", ["dry_run", "plan_report"])
@pytest.mark.parametrize("flag,override", [("1", "2"), ("2", "1")])
def test_tp_flag_and_a_different_override_are_one_error_line(tool, flag, override, configs, capsys):
    line = one_error_line(
        load_tool(tool), capsys, *configs, "--dp", "2", "--tp", flag, f"parallel.tensor={override}", *TINY
    )
    assert line == f"error: --tp {flag} and parallel.tensor={override} disagree; give one of them"


@pytest.mark.parametrize("tool", ["dry_run", "plan_report"])
def test_a_tensor_parallel_size_below_one_is_one_error_line(tool, configs, capsys):
    line = one_error_line(load_tool(tool), capsys, *configs, "--dp", "2", "--tp", "0", *TINY)
    assert line == "error: --tp 0: the tensor-parallel size must be >= 1"
