"""The run's accumulators (losses, throughput, step times, bytes, skipped steps) and the summary printed at the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import Config
from .checkpointing import resume_hint

if TYPE_CHECKING:
    from .step import StepResult


@dataclass
class RunStats:
    """What one launch accumulates over its steps (the same on every rank).

    ``skipped_in_a_row``: non-finite steps skipped in a row (restored from the checkpoint); ``skipped_total``:
    skipped in this launch; ``first_loss``: the loss of this launch's first step (nats); ``last`` / ``last_res``:
    the last step's metrics record and :class:`~.step.StepResult`; ``val_loss``: the latest evaluation;
    ``tokens_per_sec`` and ``step_times`` (s): per step after this launch's first; ``comm_bytes`` /
    ``gather_bytes``: per step, bytes this rank sent in the gradient reduction / the parameter gather;
    ``saves_logged``: periodic saves already reported in a metrics record;
    ``refresh_logged``: a GeoFP8 refresh line was printed.
    """

    start_step: int
    skipped_in_a_row: int = 0
    skipped_total: int = 0
    first_loss: float | None = None
    last: dict | None = None
    last_res: StepResult | None = None
    val_loss: float | None = None
    tokens_per_sec: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    comm_bytes: list[float] = field(default_factory=list)
    gather_bytes: list[float] = field(default_factory=list)
    saves_logged: int = 0
    refresh_logged: bool = False

    def count_skip(self, skipped: bool) -> int:
        """Update and return ``skipped_in_a_row`` after a step (``skipped``: its update was skipped)."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        return self.skipped_in_a_row

    def unlogged_saves(self, save_times: list[float]) -> dict:
        """``checkpoint_time_s`` (s) and ``checkpoints_saved`` of the periodic saves (``save_times``, all of this
        launch) that no metrics record reported yet; empty when there are none."""
        new = save_times[self.saves_logged :]
        return {"checkpoint_time_s": sum(new), "checkpoints_saved": len(new)} if new else {}

    def add(self, step: int, record: dict, res) -> None:
        """Account step ``step`` (0-based) with its metrics ``record`` and :class:`~.step.StepResult` ``res``."""
        self.first_loss = res.loss if self.first_loss is None else self.first_loss
        self.last, self.last_res = record, res
        if step > self.start_step:
            self.tokens_per_sec.append(record["tokens_per_sec"])
            self.step_times.append(record["step_time_s"])
        self.skipped_total += int(res.skipped)
        self.comm_bytes.append(record["comm_bytes"])
        self.gather_bytes.append(record.get("comm_gather_bytes", 0))

    def summary(self, n_params: int, run_dir: str, checkpoint: str | None, comm: str) -> dict:
        """The run's summary dict (``steps``, losses in nats, ``tokens_per_sec`` global, ``comm_bytes_per_step`` and
        ``comm_gather_bytes_per_step`` per rank (gradient reduction, parameter gather), ``run_dir``, ``checkpoint``:
        the last one saved or None)."""
        tps = self.tokens_per_sec
        # called after at least one add (a launch with no step to run uses nothing_to_do)
        assert self.last is not None and self.last_res is not None
        return {
            "parameters": n_params,
            "steps": self.last["step"],
            "start_loss": self.first_loss,
            "final_loss": self.last_res.loss,
            "val_loss": self.val_loss,
            "tokens_per_sec": sum(tps) / len(tps) if tps else self.last["tokens_per_sec"],
            "comm_bytes_per_step": sum(self.comm_bytes) / len(self.comm_bytes),
            "comm_gather_bytes_per_step": sum(self.gather_bytes) / len(self.gather_bytes),
            "run_dir": run_dir,
            "checkpoint": checkpoint,
            "comm": comm,
            "start_step": self.start_step,
        }


def nothing_to_do(n_params: int, start_step: int, run_dir: str) -> dict:
    """The summary of a launch whose checkpoint is already at ``train.steps``."""
    return {
        "parameters": n_params,
        "steps": start_step,
        "start_loss": None,
        "final_loss": None,
        "val_loss": None,
        "tokens_per_sec": 0.0,
        "comm_bytes_per_step": 0.0,
        "comm_gather_bytes_per_step": 0.0,
        "run_dir": run_dir,
        "checkpoint": None,
        "start_step": start_step,
    }


def format_summary(s: dict, cfg: Config) -> str:
    """The summary block rank 0 prints at the end of a run (``s``: :meth:`RunStats.summary`)."""
    val = f"{s['val_loss']:.4f}" if s["val_loss"] is not None else "n/a"
    return "\n".join(
        [
            "=" * 72,
            f"summary: {s['steps']} step{'' if s['steps'] == 1 else 's'}"
            f"{'' if s['steps'] == cfg.train.steps else f' of train.steps={cfg.train.steps}'}, "
            f"{s['parameters']:,} parameters, comm={cfg.comm.label} (comm.dtype={cfg.comm.dtype})",
            f"  train loss      {s['start_loss']:.4f} (step {s.get('start_step', 0) + 1}"
            f"{', first of this run' if s.get('start_step') else ', first step'}) -> {s['final_loss']:.4f} (last step)",
            f"  validation loss {val}",
            f"  throughput      {s['tokens_per_sec']:,.1f} tokens/s (global"
            f"{', excluding the first step' if s['steps'] > 1 else ''})",
            f"  DP grad comm    {s['comm_bytes_per_step']:,.0f} bytes sent per step per rank",
            f"  DP param gather {s.get('comm_gather_bytes_per_step', 0.0):,.0f} bytes sent per step per rank"
            f" (comm.param_gather={cfg.comm.param_gather})",
            f"  outputs         {s['run_dir']}/ (config.yaml, metrics.jsonl"
            f"{', wandb/' if cfg.logging.wandb != 'disabled' else ''})",
            *([f"  checkpoint      {s['checkpoint']} ({resume_hint(cfg)})"] if s.get("checkpoint") else []),
            "=" * 72,
        ]
    )
