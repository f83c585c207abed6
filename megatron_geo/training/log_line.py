"""Megatron-style progress lines for logs that are not a terminal (Slurm log files).

A tqdm bar writes ``\\r`` updates into one endless line of a log file, so the trainer uses it only when stdout
is a terminal and otherwise prints one line every ``train.log_interval`` steps::

    step 120/20000 | loss 3.4521 | lr 2.99e-04 | grad norm 0.812 | 1,677,722 tok/s | 1.250 s/step |
    comm 45.2 MB/rank | skipped 0 | ETA 6h54m

(one line in the log; wrapped here). The ETA counts the optimizer steps, evaluations and checkpoint saves still
to come (:mod:`.eta`); ``ETA 6h54m+evals+saves`` marks evaluations / saves still to come that have not been
timed yet and are not included.
"""

from __future__ import annotations

import math
import sys

from .eta import PhaseTimes, eta_text


def use_progress_bar(progress: bool, stream) -> bool:
    """tqdm only when ``train.progress`` is on and ``stream`` (stdout) is an interactive terminal."""
    isatty = getattr(stream, "isatty", None)
    return bool(progress) and callable(isatty) and bool(isatty())


def log_line(
    record: dict, total_steps: int, recent_step_times: list[float], skipped_total: int, phases: PhaseTimes | None = None
) -> str:
    """One line for the metrics ``record`` of a step (keys ``step``, ``loss``, ``lr``, ``grad_norm``,
    ``tokens_per_sec``, ``step_time_s``, ``comm_bytes``; ``val_loss`` when evaluated).

    ``recent_step_times``: durations (s) of the last steps for the ETA (empty: this step's time); ``phases``: the
    evaluations and checkpoint saves still to come, which the ETA adds (:func:`.eta.eta_text`; None: steps only);
    ``skipped_total``: non-finite steps skipped so far in this run. ``comm`` is the bytes this rank sent for
    the DP gradient reduction in this step, in MB (1e6 bytes).
    """
    times = recent_step_times or [record["step_time_s"]]
    spt = sum(times) / len(times)
    gn = record.get("grad_norm")
    parts = [
        f"step {record['step']}/{total_steps}",
        f"loss {record['loss']:.4f}",
        *([f"val loss {record['val_loss']:.4f}"] if record.get("val_loss") is not None else []),
        f"lr {record['lr']:.3e}",
        f"grad norm {gn:.3f}" if gn is not None and math.isfinite(gn) else f"grad norm {gn}",
        f"{record['tokens_per_sec']:,.0f} tok/s",
        f"{record['step_time_s']:.3f} s/step",
        f"comm {record['comm_bytes'] / 1e6:,.1f} MB/rank",
        f"skipped {skipped_total}",
        f"ETA {eta_text(record['step'], total_steps, spt, phases)}",
    ]
    return " | ".join(parts)


class StepOutput:
    """Rank 0's per-step progress on stdout: a tqdm bar (``train.progress`` on a terminal, the loss shown whenever
    a step read it) or else one :func:`log_line` on each log step. Other ranks print nothing.

    ``train``: the ``train`` config section (``steps``, ``progress``); ``start_step``: the step this launch starts
    at (0-based).
    """

    def __init__(self, train, start_step: int, is_main: bool):
        self.total, self.is_main, self.bar = train.steps, is_main, None
        if is_main and use_progress_bar(train.progress, sys.stdout):  # a log file gets lines, not \r updates
            from tqdm import tqdm

            self.bar = tqdm(
                total=train.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stdout
            )

    def step(self, record: dict, log_step: bool, stats, phases: PhaseTimes | None = None) -> None:
        """After a step: its metrics ``record`` (``loss`` present when it was read), ``log_step`` (a log-interval or
        the last step), ``stats`` (a :class:`~.summary.RunStats` that already counts this step) and the
        evaluations / saves still to come for the ETA."""
        if self.bar is None:
            if log_step and self.is_main:
                print(log_line(record, self.total, stats.step_times[-20:], stats.skipped_total, phases), flush=True)
            return
        self.bar.update(1)
        if "loss" in record:
            val = stats.val_loss
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", **({"val": f"{val:.3f}"} if val else {}))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
