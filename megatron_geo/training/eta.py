#!/usr/bin/env python
"""ETA and throughput lines for long runs (pure Python: no torch import, so a log watcher starts fast).

In the trainer::

    from .eta import eta_line
    line = eta_line(step + 1, t.steps, recent_step_times, tokens_per_step)   # e.g. every log_interval

From a job script (what ``scripts/slurm/pretrain.sbatch`` does), reading ``<run_dir>/metrics.jsonl``::

    python megatron_geo/training/eta.py --run-dir runs/x --interval 60     # a line every 60 s
    python megatron_geo/training/eta.py --run-dir runs/x --once            # one line and exit
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


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


def eta_line(step: int, total_steps: int, recent_step_times: list[float], tokens_per_step: float,
             now: float | None = None) -> str:
    """One log line: progress, mean step time of ``recent_step_times`` (seconds; pass the last ~20 steps,
    excluding the first step's warm-up), global tokens/s and the remaining time with the wall-clock
    finish time (local time; ``now`` = epoch seconds, default ``time.time()``).

    ``tokens_per_step`` is the global batch in tokens (``global_batch_size * seq_length``).
    Example: ``step 120/20000 (0.6%) | 1.250 s/step | 1,677,722 tok/s | ETA 6h54m (finish 2025-05-02 03:14)``.

    Raises:
        ValueError: as :func:`eta_seconds`, or an empty ``recent_step_times``.
    """
    if not recent_step_times:
        raise ValueError("recent_step_times is empty; pass the durations (s) of the last steps")
    spt = sum(recent_step_times) / len(recent_step_times)
    left = eta_seconds(step, total_steps, spt)
    now = time.time() if now is None else now
    finish = time.strftime("%Y-%m-%d %H:%M", time.localtime(now + left))
    tps = tokens_per_step / spt if spt > 0 else float("inf")
    return (f"step {step}/{total_steps} ({100.0 * step / total_steps:.1f}%) | {spt:.3f} s/step | "
            f"{tps:,.0f} tok/s | ETA {format_duration(left)} (finish {finish})")


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


def _total_steps(run_dir: str) -> int | None:
    try:
        import yaml

        with open(os.path.join(run_dir, "config.yaml")) as f:
            return int(yaml.safe_load(f)["train"]["steps"])
    except (OSError, KeyError, TypeError, ValueError, ImportError):
        return None


def metrics_eta_line(records: list[dict], total_steps: int, window: int = 20, now: float | None = None) -> str | None:
    """:func:`eta_line` from ``metrics.jsonl`` records (``step``, ``step_time_s``, ``tokens_per_sec``):
    the mean over the last ``window`` logged steps (the first step is left out when others exist).
    None when there is no record yet."""
    recs = [r for r in records if isinstance(r.get("step_time_s"), (int, float)) and r.get("step")]
    if not recs:
        return None
    tail = recs[1:] if len(recs) > 1 and recs[0]["step"] == 1 else recs
    tail = tail[-window:]
    times = [float(r["step_time_s"]) for r in tail]
    tokens = [float(r["tokens_per_sec"]) * float(r["step_time_s"]) for r in tail
              if isinstance(r.get("tokens_per_sec"), (int, float))]
    tokens_per_step = sum(tokens) / len(tokens) if tokens else 0.0
    step = min(int(recs[-1]["step"]), total_steps)
    return eta_line(step, total_steps, times, tokens_per_step, now=now)


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
                line = metrics_eta_line(recs, total)
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
