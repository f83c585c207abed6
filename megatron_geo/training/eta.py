#!/usr/bin/env python
"""ETA and throughput lines for long runs (pure Python: no torch import, so a log watcher starts fast).

The remaining time is the optimizer steps still to come times the mean recent step time, plus the
evaluations still to come (``train.eval_interval`` and the last step) times the mean measured evaluation,
plus the checkpoint saves still to come (``checkpoint.interval``, and ``checkpoint.save_at_end``) times the
mean measured save. A kind with saves or evaluations still to come but none measured yet is left out, and
the line says so (``excludes evaluations (none timed yet)``).

In the trainer::

    timer = RunTimer(t.steps, start_step, t.eval_interval, cfg.checkpoint.interval, cfg.checkpoint.save_at_end)
    with timer.timing("eval"):
        evaluate(...)
    line = eta_line(step + 1, t.steps, recent_step_times, tokens_per_step, phases=timer.phases())

From a job script (what ``scripts/slurm/pretrain.sbatch`` does), reading ``<run_dir>/metrics.jsonl``::

    python megatron_geo/training/eta.py --run-dir runs/x --interval 60     # a line every 60 s
    python megatron_geo/training/eta.py --run-dir runs/x --once            # one line and exit
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass


def format_duration(seconds: float) -> str:
    """``seconds`` (>= 0, finite) as ``1d02h03m``, ``2h03m``, ``3m04s`` or ``5s``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def eta_seconds(step: int, total_steps: int, seconds_per_step: float) -> float:
    """Seconds left after ``step`` of ``total_steps`` optimizer steps at ``seconds_per_step``.

    Raises:
        ValueError: ``total_steps`` < 1, ``step`` outside ``[0, total_steps]`` or a negative/non-finite
            ``seconds_per_step``.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if not 0 <= step <= total_steps:
        raise ValueError(f"step={step} must be in [0, total_steps={total_steps}]")
    if not (math.isfinite(seconds_per_step) and seconds_per_step >= 0):
        raise ValueError(f"seconds_per_step={seconds_per_step} must be a finite number >= 0")
    return (total_steps - step) * seconds_per_step


def planned_evals(start_step: int, total_steps: int, interval: int) -> int:
    """Evaluations the trainer runs after steps ``start_step + 1 .. total_steps``: every multiple of
    ``interval`` and the last step (``interval <= 0``: none, the run has no validation data)."""
    if interval <= 0 or start_step >= total_steps:
        return 0
    return total_steps // interval - start_step // interval + (1 if total_steps % interval else 0)


def planned_saves(start_step: int, total_steps: int, interval: int, save_at_end: bool) -> int:
    """Checkpoint saves after steps ``start_step + 1 .. total_steps``: every multiple of ``interval`` (``0``:
    none) and, with ``save_at_end``, the last step (one save when it is also a multiple)."""
    if start_step >= total_steps:
        return 0
    n = total_steps // interval - start_step // interval if interval > 0 else 0
    if save_at_end and not (interval > 0 and total_steps % interval == 0):
        n += 1
    return n


@dataclass
class PhaseTimes:
    """Evaluations and checkpoint saves of a run: mean measured duration (seconds; None before the first
    one is measured) and how many are still to come."""

    eval_mean_s: float | None = None
    evals_left: int = 0
    save_mean_s: float | None = None
    saves_left: int = 0

    def seconds(self) -> float:
        """Seconds of the evaluations and saves still to come, the unmeasured kinds left out."""
        evals = self.eval_mean_s * self.evals_left if self.eval_mean_s is not None else 0.0
        saves = self.save_mean_s * self.saves_left if self.save_mean_s is not None else 0.0
        return evals + saves

    def excluded(self) -> list[str]:
        """The kinds still to come whose duration is not known yet (``evaluations``, ``checkpoint saves``)."""
        out = []
        if self.evals_left and self.eval_mean_s is None:
            out.append("evaluations")
        if self.saves_left and self.save_mean_s is None:
            out.append("checkpoint saves")
        return out


class RunTimer:
    """The measured evaluations and checkpoint saves of one training process, for the ETA.

    ``clock``: seconds, monotonic (default ``time.perf_counter``; a test passes its own).
    """

    KINDS = ("eval", "save")

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        eval_interval: int = 0,
        checkpoint_interval: int = 0,
        save_at_end: bool = False,
        clock=time.perf_counter,
    ):
        self.clock = clock
        self.planned = {
            "eval": planned_evals(start_step, total_steps, eval_interval),
            "save": planned_saves(start_step, total_steps, checkpoint_interval, save_at_end),
        }
        self.durations: dict[str, list[float]] = {k: [] for k in self.KINDS}

    def add(self, kind: str, seconds: float) -> None:
        """Record one evaluation (``kind="eval"``) or checkpoint save (``"save"``) of ``seconds``.

        Raises:
            ValueError: another ``kind``.
        """
        if kind not in self.KINDS:
            raise ValueError(f"kind={kind!r}; choose eval or save")
        self.durations[kind].append(float(seconds))

    @contextlib.contextmanager
    def timing(self, kind: str):
        """Time the block with ``clock`` and :meth:`add` it as ``kind`` (also when it raises)."""
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(kind, self.clock() - t0)

    def last(self, kind: str) -> float | None:
        """Seconds of the latest ``kind`` measured, None before the first."""
        d = self.durations[kind]
        return d[-1] if d else None

    def phases(self) -> PhaseTimes:
        """Means so far and the counts still to come (planned minus done, never below 0)."""

        def mean(d):
            return sum(d) / len(d) if d else None

        ev, sv = self.durations["eval"], self.durations["save"]
        return PhaseTimes(
            mean(ev), max(0, self.planned["eval"] - len(ev)), mean(sv), max(0, self.planned["save"] - len(sv))
        )


def remaining_seconds(step: int, total_steps: int, seconds_per_step: float, phases: PhaseTimes | None = None) -> float:
    """:func:`eta_seconds` plus the evaluations and checkpoint saves still to come (:class:`PhaseTimes`)."""
    return eta_seconds(step, total_steps, seconds_per_step) + (phases.seconds() if phases is not None else 0.0)


SHORT = {"evaluations": "evals", "checkpoint saves": "saves"}


def eta_text(step: int, total_steps: int, seconds_per_step: float, phases: PhaseTimes | None = None) -> str:
    """The remaining time as one token: ``6h54m``, with ``+evals`` / ``+saves`` appended for evaluations /
    checkpoint saves still to come that are not timed yet and so not included (``6h54m+evals+saves``)."""
    text = format_duration(remaining_seconds(step, total_steps, seconds_per_step, phases))
    return text + "".join(f"+{SHORT[k]}" for k in (phases.excluded() if phases is not None else []))


def eta_line(
    step: int,
    total_steps: int,
    recent_step_times: list[float],
    tokens_per_step: float,
    now: float | None = None,
    phases: PhaseTimes | None = None,
) -> str:
    """One log line: progress, mean step time of ``recent_step_times`` (seconds; pass the last ~20 steps,
    excluding the first step's warm-up), global tokens/s and the remaining time (steps, and with ``phases``
    the evaluations and checkpoint saves still to come) with the wall-clock finish time (local time;
    ``now`` = epoch seconds, default ``time.time()``).

    ``tokens_per_step`` is the global batch in tokens (``global_batch_size * seq_length``).
    Example: ``step 120/20000 (0.6%) | 1.250 s/step | 1,677,722 tok/s | ETA 6h54m (finish 2025-05-02 03:14)``.

    Raises:
        ValueError: as :func:`eta_seconds`, or an empty ``recent_step_times``.
    """
    if not recent_step_times:
        raise ValueError("recent_step_times is empty; pass the durations (s) of the last steps")
    spt = sum(recent_step_times) / len(recent_step_times)
    left = remaining_seconds(step, total_steps, spt, phases)
    now = time.time() if now is None else now
    finish = time.strftime("%Y-%m-%d %H:%M", time.localtime(now + left))
    tps = tokens_per_step / spt if spt > 0 else float("inf")
    missing = phases.excluded() if phases is not None else []
    return (
        f"step {step}/{total_steps} ({100.0 * step / total_steps:.1f}%) | {spt:.3f} s/step | "
        f"{tps:,.0f} tok/s | ETA {format_duration(left)} (finish {finish}"
        + (f"; excludes {' and '.join(missing)}, none timed yet" if missing else "")
        + ")"
    )


def read_metrics(path: str) -> list[dict]:
    """The complete JSON lines of ``metrics.jsonl`` (a half-written last line is ignored); [] if missing."""
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return []
    out = []
    for ln in lines[:-1] if lines and lines[-1] else lines:  # the part after the last newline may be partial
        ln = ln.strip()
        if ln:
            try:
                out.append(json.loads(ln))
            except json.JSONDecodeError:
                continue
    return out


def _run_config(run_dir: str) -> dict:
    try:
        import yaml

        with open(os.path.join(run_dir, "config.yaml")) as f:
            cfg = yaml.safe_load(f)
        return cfg if isinstance(cfg, dict) else {}
    except (OSError, ValueError, ImportError):
        return {}


def _total_steps(run_dir: str) -> int | None:
    try:
        return int(_run_config(run_dir)["train"]["steps"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class Schedule:
    """What a run evaluates and saves: ``train.eval_interval`` (0: no evaluations), ``checkpoint.interval``,
    ``checkpoint.save_at_end``."""

    eval_interval: int = 0
    checkpoint_interval: int = 0
    save_at_end: bool = False


def read_schedule(run_dir: str) -> Schedule:
    """:class:`Schedule` from ``<run_dir>/config.yaml`` (the trainer's defaults for missing keys: eval every 50
    steps with ``train.eval_batches`` > 0, no periodic saves, a save at the end)."""
    cfg = _run_config(run_dir)
    train, ckpt = cfg.get("train") or {}, cfg.get("checkpoint") or {}
    try:
        evals = int(train.get("eval_interval", 50)) if int(train.get("eval_batches", 4)) > 0 else 0
        return Schedule(evals, int(ckpt.get("interval", 0)), bool(ckpt.get("save_at_end", True)))
    except (TypeError, ValueError):
        return Schedule()


def phases_from_records(records: list[dict], total_steps: int, schedule: Schedule) -> PhaseTimes:
    """:class:`PhaseTimes` from ``metrics.jsonl`` records: evaluations done = records with ``val_loss`` (timed by
    ``eval_time_s``), saves done and their seconds = the sums of ``checkpoints_saved`` / ``checkpoint_time_s``
    (a save is logged with the next logged step), against the counts the schedule plans from step 0."""
    done_evals = sum(1 for r in records if "val_loss" in r)
    eval_s = [float(r["eval_time_s"]) for r in records if isinstance(r.get("eval_time_s"), (int, float))]
    saves = sum(int(r["checkpoints_saved"]) for r in records if isinstance(r.get("checkpoints_saved"), int))
    save_s = sum(
        float(r["checkpoint_time_s"])
        for r in records
        if isinstance(r.get("checkpoint_time_s"), (int, float)) and isinstance(r.get("checkpoints_saved"), int)
    )
    evals_left = max(0, planned_evals(0, total_steps, schedule.eval_interval) - done_evals)
    saves_left = max(0, planned_saves(0, total_steps, schedule.checkpoint_interval, schedule.save_at_end) - saves)
    return PhaseTimes(
        sum(eval_s) / len(eval_s) if eval_s else None, evals_left, save_s / saves if saves else None, saves_left
    )


def metrics_eta_line(
    records: list[dict], total_steps: int, window: int = 20, now: float | None = None, schedule: Schedule | None = None
) -> str | None:
    """:func:`eta_line` from ``metrics.jsonl`` records (``step``, ``step_time_s``, ``tokens_per_sec``):
    the mean over the last ``window`` logged steps (the first step is left out when others exist), and with
    ``schedule`` the evaluations and saves still to come (:func:`phases_from_records`; without it the line
    covers the optimizer steps only and says so). None when there is no record yet."""
    recs = [r for r in records if isinstance(r.get("step_time_s"), (int, float)) and r.get("step")]
    if not recs:
        return None
    tail = recs[1:] if len(recs) > 1 and recs[0]["step"] == 1 else recs
    tail = tail[-window:]
    times = [float(r["step_time_s"]) for r in tail]
    tokens = [
        float(r["tokens_per_sec"]) * float(r["step_time_s"])
        for r in tail
        if isinstance(r.get("tokens_per_sec"), (int, float))
    ]
    tokens_per_step = sum(tokens) / len(tokens) if tokens else 0.0
    step = min(int(recs[-1]["step"]), total_steps)
    if schedule is None:
        return eta_line(step, total_steps, times, tokens_per_step, now=now) + " [optimizer steps only]"
    return eta_line(
        step, total_steps, times, tokens_per_step, now=now, phases=phases_from_records(records, total_steps, schedule)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Print ETA / throughput lines from <run_dir>/metrics.jsonl.")
    p.add_argument("--run-dir", required=True, help="the run's train.run_dir")
    p.add_argument("--total-steps", type=int, default=0, help="default: train.steps from <run_dir>/config.yaml")
    p.add_argument("--interval", type=float, default=60.0, help="seconds between lines (default 60)")
    p.add_argument("--once", action="store_true", help="print one line (or why there is none) and exit")
    p.add_argument("--prefix", default="[eta]")
    args = p.parse_args(argv)
    if args.interval <= 0:
        p.error(f"--interval {args.interval} must be > 0")
    path = os.path.join(args.run_dir, "metrics.jsonl")
    last_step = None
    while True:
        total = args.total_steps or _total_steps(args.run_dir)
        line = None
        if total:
            recs = read_metrics(path)
            step = recs[-1].get("step") if recs else None
            if step != last_step or args.once:
                line = metrics_eta_line(recs, total, schedule=read_schedule(args.run_dir))
                last_step = step
        if line:
            print(f"{args.prefix} {line}", flush=True)
        elif args.once:
            print(f"{args.prefix} no metrics yet in {path}", flush=True)
        if args.once:
            return 0
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
