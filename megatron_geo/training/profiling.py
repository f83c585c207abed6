"""``profiling.steps``: a ``torch.profiler`` window over some optimizer steps, exported as a Chrome / Perfetto trace
per rank, and with ``profiling.memory_snapshot`` a CUDA memory snapshot over the same steps.

The reduction path names its phases (:data:`megatron_geo.parallel.trace.RANGE_NAMES`: ``encode``, ``collective``,
``decode``, ``transform``, ``optimizer``) and every profiled step is one ``step N`` range (N as in the log), so a
trace shows where a step's time goes for each ``comm.dtype``. Files, in ``<train.run_dir>/profile/``, named by the
steps they hold (a launch resumed inside the window writes the rest of it next to the first part; a name that
exists already, the same steps profiled by an earlier launch, gets ``.1``, ``.2``, ... before its extension):

- ``trace_rank{R}_steps{A}-{B}.json``: the Chrome trace of global rank R over steps A..B (open it in
  https://ui.perfetto.dev or ``chrome://tracing``); :func:`summarise_trace` counts and sums its named ranges;
- ``memory_snapshot_rank{R}_steps{A}-{B}.pickle``: ``torch.cuda.memory._dump_snapshot`` of the window (CUDA only;
  open it in https://pytorch.org/memory_viz).

The same idea as torchtitan's ``profiling.enable_profiling`` and Megatron-LM's ``--profile --profile-step-start
--profile-step-end`` (own implementation).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..config import Config, ConfigError
from ..config.checks import InertRule
from ..config.schema import ProfilingConfig
from ..parallel import ParallelContext
from ..parallel.trace import RANGE_NAMES

_EXAMPLE = "profiling.steps=5:8 profiles steps 5, 6 and 7"
_MEMORY_ENTRIES = 100_000  # allocation events kept by the CUDA memory history (the oldest are dropped)


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """``profiling.steps`` -> ``(start, end)``: profile the optimizer steps ``start .. end - 1`` (1-based step
    numbers as the log prints them; half-open like a Python slice), or None when ``text`` is empty (off).

    Args:
        text: ``""`` or ``"START:END"`` with integers ``1 <= START < END`` (spaces around them are ignored).

    Raises:
        ConfigError: anything else, naming ``profiling.steps``, the value and an example.
    """
    s = str(text).strip()
    if not s:
        return None
    parts = s.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start, end = int(parts[0]), int(parts[1])
    except ValueError:
        raise ConfigError(
            f"profiling.steps={text!r} is not START:END with integer step numbers ({_EXAMPLE}; empty: off)"
        ) from None
    if start < 1 or end <= start:
        raise ConfigError(
            f"profiling.steps={text!r} must have 1 <= START < END (steps are numbered from 1 and END is not "
            f"profiled: {_EXAMPLE})"
        )
    return start, end


def profiling_inert_keys(p: ProfilingConfig) -> list[InertRule]:
    """``profiling.memory_snapshot`` without a profiling window (``profiling.steps`` empty) has no effect."""
    if p.steps.strip():
        return []
    return [
        (("profiling.memory_snapshot",), "profiling.steps empty (no profiling window)", "set profiling.steps=START:END")
    ]


class StepProfiler:
    """The ``profiling`` window of one rank's training loop.

    The loop calls :meth:`step_begin` / :meth:`step_end` with each step's 1-based number around the step, and
    :meth:`close` in a ``finally``. Off (``profiling.steps`` empty) both are trivial and no ``torch.profiler``
    object is ever made. On, for the window ``START:END`` (:func:`parse_profile_steps`):

    - at the beginning of the first step in ``[START, END)`` that runs (START, or the first step after a resume
      inside the window) a ``torch.profiler.profile`` (CPU, and CUDA on a CUDA device; no shapes, no stacks)
      starts, and with ``profiling.memory_snapshot`` on CUDA the memory history
      (``torch.cuda.memory._record_memory_history`` with the Python stack of every allocation, no C++ frames);
    - every profiled step is a ``record_function("step N")`` range;
    - after step ``END - 1``, or at :meth:`close` when training ends inside the window, the profiler stops and
      the trace goes to ``<run_dir>/profile/trace_rank{R}_steps{A}-{B}.json`` (R: global rank, A..B the steps it
      holds; never over an existing file; written to a temporary file and renamed, so a reader never sees half a
      trace), the snapshot to ``memory_snapshot_rank{R}_steps{A}-{B}.pickle``, and rank 0 prints one line naming
      the folder, the steps and the file.

    At construction rank 0 warns when this launch profiles nothing: the window starts after ``train.steps`` (it
    would run only if the run is extended) or ends before ``start_step + 1``.

    Args:
        cfg: the run's config (``profiling.steps``, ``profiling.memory_snapshot``, ``train.steps``).
        pctx: this rank's parallel context (``rank``, ``device``, ``is_main``).
        run_dir: the run folder (``train.run_dir``).
        log: prints a line on rank 0 (default: ``print`` on the main rank).
        start_step: the steps done before this launch (its first step is ``start_step + 1``).

    Raises:
        ConfigError: a malformed ``profiling.steps`` (:func:`parse_profile_steps`).
    """

    def __init__(self, cfg: Config, pctx: ParallelContext, run_dir, log=None, start_step: int = 0):
        self.window = parse_profile_steps(cfg.profiling.steps)
        self.rank = pctx.rank
        self.cuda = pctx.device.type == "cuda"
        self.folder = Path(run_dir) / "profile"
        self._log = log if log is not None else (lambda m: print(m, flush=True)) if pctx.is_main else (lambda m: None)
        if self.window is not None:
            start, end = self.window
            if start > cfg.train.steps:
                self._log(
                    f"warning: profiling.steps={start}:{end} starts after the last step (train.steps="
                    f"{cfg.train.steps}): nothing is profiled unless the run is extended past step {start - 1}"
                )
            elif end - 1 <= start_step:
                self._log(
                    f"profiling: profiling.steps={start}:{end} ended before step {start_step + 1}, where this launch "
                    f"resumes: nothing is profiled in it (an earlier launch's traces are in {self.folder})"
                )
        self._memory = bool(cfg.profiling.memory_snapshot) and self.window is not None
        if self._memory and not self.cuda:
            self._log("profiling.memory_snapshot needs CUDA; no snapshot written")
            self._memory = False
        self._prof: torch.profiler.profile | None = None
        self._step_range: torch.autograd.profiler.record_function | None = None
        self._first = self._last = 0  # the steps profiled so far
        self._done = False

    def step_begin(self, step: int) -> None:
        """Step ``step`` (1-based) begins: start the window at its first step, open the step's range."""
        if self.window is None or self._done or not self.window[0] <= step < self.window[1]:
            return
        if self._prof is None:
            self._start(step)
        r = self._step_range = torch.autograd.profiler.record_function(f"step {step}")
        r.__enter__()
        self._last = step

    def step_end(self, step: int) -> None:
        """Step ``step`` (1-based) ended: close its range; after the window's last step, stop and export."""
        if self._prof is None:
            return
        self._close_step_range()
        assert self.window is not None  # a profiler runs only with a window
        if step >= self.window[1] - 1:
            self._stop()

    def close(self) -> None:
        """End of training (call it in a ``finally``): stop a window still open and export what it recorded.

        Raises:
            OSError / RuntimeError: the export failed and no other exception is propagating; while one is (the loop
            failed), a failed export is only printed, so that the original error is the one reported.
        """
        if self._prof is None:
            return
        failing = sys.exc_info()[1]  # in the loop's finally: the error ending training, if any
        try:
            self._close_step_range()
            self._stop()
        except Exception as e:
            if failing is None:
                raise
            print(f"rank {self.rank}: the profile of steps {self._first}-{self._last} was not written: {e}", flush=True)

    # -- internals --------------------------------------------------------------------------------------------
    def _start(self, step: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self._memory:
            # Python stacks only: C++ unwinding at every allocation slows the profiled steps many times over
            torch.cuda.memory._record_memory_history(stacks="python", max_entries=_MEMORY_ENTRIES)
        prof = self._prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        prof.start()
        self._first = step

    def _close_step_range(self) -> None:
        r, self._step_range = self._step_range, None
        if r is not None:
            r.__exit__(None, None, None)

    def _stop(self) -> None:
        prof, self._prof, self._done = self._prof, None, True
        assert prof is not None and self.window is not None
        held = f"steps{self._first}-{self._last}"
        trace = _free_name(self.folder, f"trace_rank{self.rank}_{held}", ".json")
        try:
            prof.stop()
            _write_atomically(trace, prof.export_chrome_trace)
        finally:
            if self._memory:  # the history is switched off even when the trace could not be written
                try:
                    snap = _free_name(self.folder, f"memory_snapshot_rank{self.rank}_{held}", ".pickle")
                    _write_atomically(snap, torch.cuda.memory._dump_snapshot)
                finally:
                    torch.cuda.memory._record_memory_history(enabled=None)
        start, end = self.window
        cut = "" if self._last == end - 1 else f" (training ended after step {self._last})"
        steps = f"step {self._first}" if self._first == self._last else f"steps {self._first}-{self._last}"
        files = trace.name.replace(f"rank{self.rank}_", "rank{R}_") + (
            " and its memory snapshot" if self._memory else ""
        )
        self._log(
            f"profiling: {steps} of profiling.steps={start}:{end}{cut} written to {self.folder} ({files} per "
            f"rank R; open the traces in https://ui.perfetto.dev)"
        )


def _free_name(folder: Path, stem: str, ext: str) -> Path:
    """``folder/stem+ext``, or with ``.1``, ``.2``, ... before ``ext`` when that file exists (nothing is
    overwritten)."""
    path, n = folder / f"{stem}{ext}", 0
    while path.exists():
        n += 1
        path = folder / f"{stem}.{n}{ext}"
    return path


def _write_atomically(path: Path, write) -> None:
    """``write(temporary path)`` in ``path``'s folder, then rename onto ``path`` (readers never see a partial file)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def summarise_trace(path) -> dict[str, tuple[int, float]]:
    """Count and total duration of the named ranges in a Chrome trace written by :class:`StepProfiler`.

    Reads ``traceEvents`` with ``ph == "X"`` (complete events: ``ts`` and ``dur`` in microseconds, Chrome Trace
    Event Format) whose name is one of :data:`~megatron_geo.parallel.trace.RANGE_NAMES` or ``step N``, on the host
    side only (``gpu_user_annotation`` events, the same ranges on a GPU's timeline, are left out). A range nested in
    one of the same name on the same thread (e.g. a re-based residual inside the refresh's ``transform``) is not
    counted again. A range of another name nested inside (a ``collective`` inside ``encode`` for
    ``comm.scale_sync=max``) counts in both.

    Args:
        path: a ``trace_rank{R}_steps{A}-{B}.json`` file.

    Returns:
        ``{name: (events, total microseconds)}`` for the five range names (``(0, 0.0)`` when absent) and every
        ``step N`` present.

    Raises:
        OSError / json.JSONDecodeError: the file cannot be read as JSON.
    """
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    spans: dict[tuple, list[tuple[float, float]]] = {}
    for e in events:
        name = e.get("name")
        if e.get("ph") != "X" or not isinstance(name, str) or "gpu" in str(e.get("cat", "")):
            continue
        if name in RANGE_NAMES or _is_step_name(name):
            spans.setdefault((name, e.get("pid"), e.get("tid")), []).append((float(e["ts"]), float(e.get("dur", 0))))
    out: dict[str, tuple[int, float]] = {n: (0, 0.0) for n in RANGE_NAMES}
    for (name, _, _), items in spans.items():
        count, total, end = out.get(name, (0, 0.0)) + (float("-inf"),)
        for ts, dur in sorted(items, key=lambda t: (t[0], -t[1])):
            if ts < end:  # inside the previous range of this name
                continue
            count, total, end = count + 1, total + dur, ts + dur
        out[name] = (count, total)
    return out


def _is_step_name(name: str) -> bool:
    head, _, num = name.partition(" ")
    return head == "step" and num.isdigit()
