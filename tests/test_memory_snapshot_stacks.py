"""``profiling.memory_snapshot``: the CUDA memory history records the Python stack of each allocation, never C++ frames
(C++ unwinding at every allocation slows the profiled steps many times over), and is switched off after the window.

No GPU needed: torch's CUDA memory-history calls and the profiler are replaced by recorders; the StepProfiler runs its
window as on a CUDA rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_geo.training.profiling import StepProfiler


class _FakeProfile:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def start(self):
        pass

    def stop(self):
        pass

    def export_chrome_trace(self, path):
        with open(path, "w") as f:
            f.write("{}")


def test_memory_history_records_python_stacks_and_is_switched_off_after_the_window(tmp_path, monkeypatch):
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))

    def dump(path):
        with open(path, "wb") as f:
            f.write(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    cfg = SimpleNamespace(profiling=SimpleNamespace(steps="2:4", memory_snapshot=True), train=SimpleNamespace(steps=4))
    pctx = SimpleNamespace(rank=3, device=torch.device("cuda", 0), is_main=True)
    lines = []
    prof = StepProfiler(cfg, pctx, tmp_path, log=lines.append)
    for step in range(1, 5):
        prof.step_begin(step)
        assert len(calls) == {1: 0, 2: 1, 3: 1, 4: 2}[step], step  # armed at step 2, once; off after step 3
        prof.step_end(step)
    prof.close()
    assert calls[0] == ((), {"stacks": "python", "max_entries": 100_000})
    assert calls[1:] == [((), {"enabled": None})]  # switched off after step 3
    (snap,) = (tmp_path / "profile").glob("memory_snapshot_rank3*.pickle")
    assert snap.read_bytes() == b"snapshot"
    assert len(lines) == 1 and "steps 2-3" in lines[0]
