"""``profiling.steps`` / ``profiling.memory_snapshot``: the step window, the named ranges of the reduction path in the
exported Chrome trace, and nothing at all when profiling is off."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ckpt_helpers import golden_corpus_data, tiny_train_overrides
from dist_harness import run_distributed
from megatron_geo.config import ConfigError, load_config
from megatron_geo.parallel.trace import trace_range
from megatron_geo.training import profiling
from megatron_geo.training.profiling import StepProfiler, parse_profile_steps, summarise_trace

RANGES = ("encode", "collective", "decode", "transform", "optimizer")


# ---- the window's syntax -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "want"), [("", None), ("2:4", (2, 4)), ("1:2", (1, 2)), (" 5 : 8 ", (5, 8))])
def test_a_window_is_start_colon_end_or_empty(text, want):
    assert parse_profile_steps(text) == want


@pytest.mark.parametrize("text", ["0:2", "3:3", "5:4", "a:b", "5", "5:", ":5", "1:2:3", "-1:2"])
def test_a_bad_window_is_a_config_error_naming_the_key_the_value_and_an_example(text):
    with pytest.raises(ConfigError) as e:
        parse_profile_steps(text)
    msg = str(e.value)
    assert msg.startswith(f"profiling.steps={text!r} "), msg
    assert "profiling.steps=5:8 profiles steps 5, 6 and 7" in msg, msg


# ---- trace_range ---------------------------------------------------------------------------------------------


def _user_annotations(path: Path) -> list[dict]:
    """Host-side record_function events of a Chrome trace, read without the code under test."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"]


def test_a_range_is_one_shared_no_op_without_a_profiler_and_a_named_event_with_one(tmp_path):
    assert not torch.autograd._profiler_enabled()
    assert trace_range("encode") is trace_range("decode")  # the same object: nothing allocated per range
    with trace_range("encode"), trace_range("encode"):  # re-entrant
        pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, trace_range("decode"):
        torch.ones(4).sum()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    assert [e["name"] for e in _user_annotations(tmp_path / "t.json")] == ["decode"]


def test_the_summary_counts_outermost_ranges_per_name(tmp_path):
    # a hand-written trace: nested same-name ranges count once, other names nested inside count for themselves,
    # GPU-side copies and instant events are left out
    ev = [
        {"ph": "X", "cat": "user_annotation", "name": "step 2", "ts": 0.0, "dur": 100.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "transform", "ts": 10.0, "dur": 30.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "transform", "ts": 15.0, "dur": 5.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "collective", "ts": 20.0, "dur": 4.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "transform", "ts": 50.0, "dur": 7.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "transform", "ts": 50.0, "dur": 9.0, "pid": 0, "tid": 7},
        {"ph": "i", "cat": "user_annotation", "name": "encode", "ts": 60.0, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 11.0, "dur": 2.0, "pid": 1, "tid": 1},
    ]
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": ev}))
    got = summarise_trace(tmp_path / "t.json")
    assert got == {
        "encode": (0, 0.0),
        "collective": (1, 4.0),
        "decode": (0, 0.0),
        "transform": (2, 37.0),
        "optimizer": (0, 0.0),
        "step 2": (1, 100.0),
    }


# ---- StepProfiler in process ---------------------------------------------------------------------------------


def _pctx():
    return SimpleNamespace(rank=0, is_main=True, device=torch.device("cpu"))


def test_off_the_profiler_is_never_made(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("torch.profiler.profile constructed with profiling off")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    p = StepProfiler(load_config([], []), _pctx(), tmp_path)
    for s in range(1, 5):
        p.step_begin(s)
        p.step_end(s)
    p.close()
    assert not (tmp_path / "profile").exists()


def test_an_error_inside_the_window_is_not_hidden_by_a_failed_export(tmp_path, monkeypatch, capsys):
    cfg = load_config([], ["profiling.steps=1:3"])

    def broken(path, write):
        raise OSError("disk full")

    monkeypatch.setattr(profiling, "_write_atomically", broken)
    p = StepProfiler(cfg, _pctx(), tmp_path)
    with pytest.raises(RuntimeError, match="^boom$"):
        try:
            p.step_begin(1)
            raise RuntimeError("boom")
        finally:
            p.close()
    assert not torch.autograd._profiler_enabled()  # stopped all the same
    assert "the profile of steps 1-1 was not written: disk full" in capsys.readouterr().out
    # without an error in flight the failed export is the error
    p = StepProfiler(cfg, _pctx(), tmp_path)
    p.step_begin(1)
    with pytest.raises(OSError, match="disk full"):
        p.close()
    assert not torch.autograd._profiler_enabled()


def _profile_steps(cfg, tmp_path, steps, log=None):
    """A StepProfiler over ``steps`` (1-based) of a tiny CPU workload; returns the files of profile/ afterwards."""
    p = StepProfiler(cfg, _pctx(), tmp_path, log)
    for s in steps:
        p.step_begin(s)
        torch.ones(8).sum()
        p.step_end(s)
    p.close()
    return sorted(f.name for f in (tmp_path / "profile").iterdir())


def _step_names(path: Path) -> list[str]:
    return sorted(e["name"] for e in _user_annotations(path) if e["name"].startswith("step "))


def test_a_relaunch_inside_the_window_writes_the_rest_beside_the_first_part(tmp_path):
    cfg = load_config([], ["profiling.steps=3:7", "train.steps=8"])
    lines: list[str] = []
    _profile_steps(cfg, tmp_path, [1, 2, 3, 4], log=lines.append)  # stopped after step 4 (train.exit_interval=4)
    files = _profile_steps(cfg, tmp_path, [5, 6, 7, 8], log=lines.append)  # the relaunch resumes at step 4
    # both parts of the window are kept, each in a file named by the steps it holds
    held = {name: _step_names(tmp_path / "profile" / name) for name in files}
    assert held == {
        "trace_rank0_steps3-4.json": ["step 3", "step 4"],
        "trace_rank0_steps5-6.json": ["step 5", "step 6"],
    }, held
    assert "trace_rank{R}_steps3-4.json" in lines[0] and "trace_rank{R}_steps5-6.json" in lines[1], lines
    # the same steps profiled again (a roll-back, a fresh start over the folder) get a free name
    got = _profile_steps(cfg, tmp_path, [5, 6])
    assert got == ["trace_rank0_steps3-4.json", "trace_rank0_steps5-6.1.json", "trace_rank0_steps5-6.json"]


def test_a_window_this_launch_never_reaches_is_a_start_up_line(tmp_path):
    lines: list[str] = []
    cfg = load_config([], ["train.steps=4", "profiling.steps=10:12"])
    assert StepProfiler(cfg, _pctx(), tmp_path, lines.append).window == (10, 12)
    assert lines == [
        "warning: profiling.steps=10:12 starts after the last step (train.steps=4): nothing is profiled unless "
        "the run is extended past step 9"
    ]
    lines.clear()
    # a launch resumed after the window: said once, naming the folder of the earlier traces
    StepProfiler(load_config([], ["train.steps=20", "profiling.steps=3:5"]), _pctx(), tmp_path, lines.append, 6)
    assert len(lines) == 1 and "ended before step 7" in lines[0] and str(tmp_path / "profile") in lines[0], lines
    lines.clear()
    # windows the launch reaches, in full or in part, and no window at all: nothing at start-up
    for steps, start in (("3:5", 0), ("3:9", 0), ("3:5", 3), ("4:5", 3)):
        cfg = load_config([], ["train.steps=4", f"profiling.steps={steps}"])
        StepProfiler(cfg, _pctx(), tmp_path, lines.append, start)
    StepProfiler(load_config([], ["train.steps=4"]), _pctx(), tmp_path, lines.append)
    assert lines == [], lines


# ---- tiny training runs (2 DP ranks on CPU) ------------------------------------------------------------------


def _jobs(rank, world, jobs):
    from helpers import pctx_for
    from megatron_geo.config import load_config
    from megatron_geo.parallel import trace
    from megatron_geo.training.trainer import train
    from megatron_geo.training.validate import validate_config

    out = []
    for overrides, watch in jobs:
        cfg = load_config([], overrides)
        validate_config(cfg, world)
        calls = []
        saved = (torch.profiler.profile, torch.autograd.profiler.record_function)
        if watch:  # profiling off: no profiler may be made, and no range may call record_function

            def refuse(*a, **k):
                raise AssertionError("torch.profiler.profile constructed with profiling off")

            real = torch.autograd.profiler.record_function

            def counting(name, *a, **k):
                calls.append(name)
                return real(name, *a, **k)

            torch.profiler.profile = refuse
            torch.autograd.profiler.record_function = counting
        text = io.StringIO()
        try:
            with contextlib.redirect_stdout(text):
                train(cfg, pctx_for(1))
        finally:
            torch.profiler.profile, torch.autograd.profiler.record_function = saved
        run_dir = Path(cfg.train.run_dir) / "profile"
        out.append(
            {
                "log": text.getvalue(),
                "files": sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else [],
                "range_calls": [c for c in calls if c in trace.RANGE_NAMES],
                "enabled_after": torch.autograd._profiler_enabled(),
            }
        )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiling")
    data = golden_corpus_data()
    fp8 = ["comm.dtype=fp8_e4m3"]
    geo = [*fp8, "comm.transform=geo", "geo.rank=8", "geo.refresh_interval=2", "comm.error_feedback=true"]
    jobs = {
        "fp8": (tiny_train_overrides(root / "fp8", data, "train.steps=4", "profiling.steps=2:4", *fp8), False),
        # refreshes before steps 1 and 3 (every 2 steps from the first)
        "geo": (tiny_train_overrides(root / "geo", data, "train.steps=4", "profiling.steps=2:4", *geo), False),
        "off": (tiny_train_overrides(root / "off", data, "train.steps=3", *fp8), True),
        "memory": (
            tiny_train_overrides(
                root / "mem", data, "train.steps=2", "profiling.steps=1:2", "profiling.memory_snapshot=true", *fp8
            ),
            False,
        ),
        "before_resume": (tiny_train_overrides(root / "resume", data, "train.steps=2", *fp8), False),
        # resumed at step 2 of a 2:9 window that ends after train.steps: steps 3 and 4, written at the end
        "resumed": (
            tiny_train_overrides(
                root / "resume",
                data,
                "train.steps=4",
                "checkpoint.allow_changes=train.steps",
                "profiling.steps=2:9",
                *fp8,
            ),
            False,
        ),
    }
    out = run_distributed(_jobs, 2, list(jobs.values()), timeout=900.0)
    dirs = {"fp8": "fp8", "geo": "geo", "off": "off", "memory": "mem", "before_resume": "resume", "resumed": "resume"}
    return {
        name: {"ranks": [out[r][i] for r in range(2)], "dir": root / dirs[name] / "profile"}
        for i, name in enumerate(jobs)
    }


def _names(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in _user_annotations(path):
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    return counts


def _spans(path: Path, name: str) -> list[tuple[float, float]]:
    return [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in _user_annotations(path) if e["name"] == name]


def test_the_fp8_window_holds_the_named_ranges_of_its_steps_only(runs):
    run = runs["fp8"]
    assert run["ranks"][0]["files"] == ["trace_rank0_steps2-3.json", "trace_rank1_steps2-3.json"]
    for r in range(2):
        path = run["dir"] / f"trace_rank{r}_steps2-3.json"
        names = _names(path)
        steps = sorted(n for n in names if n.startswith("step "))
        assert steps == ["step 2", "step 3"] and names["step 2"] == names["step 3"] == 1, names
        for n in ("encode", "collective", "decode", "optimizer"):
            assert names.get(n, 0) >= 2, (r, n, names)  # at least once per profiled step
        assert "transform" not in names, names  # comm.transform=none: no coordinate change
        # every named range lies inside one of the profiled steps (nothing recorded outside the window's steps)
        windows = _spans(path, "step 2") + _spans(path, "step 3")
        for n in ("encode", "collective", "decode", "optimizer"):
            for lo, hi in _spans(path, n):
                assert any(a <= lo and hi <= b + 1.0 for a, b in windows), (n, lo, hi, windows)
        # the summary agrees with the plain walk on the counts of non-nested ranges
        summary = summarise_trace(path)
        assert summary["optimizer"][0] == names["optimizer"] and summary["decode"][0] == names["decode"]
        assert summary["step 2"][0] == 1 and summary["step 3"][0] == 1 and "step 1" not in summary
    log0, log1 = (run["ranks"][r]["log"] for r in range(2))
    lines = [ln for ln in log0.splitlines() if ln.startswith("profiling: ")]
    assert len(lines) == 1 and "steps 2-3 of profiling.steps=2:4" in lines[0], lines
    assert str(run["dir"]) in lines[0]
    assert "profiling: " not in log1
    assert not any(rk["enabled_after"] for rk in run["ranks"])


def test_the_geo_window_shows_the_transform_and_the_refresh_step(runs):
    run = runs["geo"]
    path = run["dir"] / "trace_rank0_steps2-3.json"
    names = _names(path)
    assert sorted(n for n in names if n.startswith("step ")) == ["step 2", "step 3"], names
    for n in RANGES:
        assert names.get(n, 0) >= 2, (n, names)
    # step 3 refreshes: its transform ranges include the residuals' re-basing, so it has more than step 2
    (a2, b2), (a3, b3) = _spans(path, "step 2")[0], _spans(path, "step 3")[0]
    t = _spans(path, "transform")
    in2, in3 = (sum(1 for lo, hi in t if a <= lo and hi <= b) for a, b in ((a2, b2), (a3, b3)))
    assert in3 > in2 > 0, (in2, in3)


def test_off_by_default_no_profiler_and_no_record_function_call(runs):
    for rk in runs["off"]["ranks"]:
        assert rk["range_calls"] == [] and rk["files"] == []
        assert "profiling: " not in rk["log"]


def test_a_memory_snapshot_on_cpu_is_a_note_and_the_run_goes_on(runs):
    run = runs["memory"]
    log0 = run["ranks"][0]["log"]
    assert log0.count("profiling.memory_snapshot needs CUDA; no snapshot written") == 1, log0
    assert "profiling.memory_snapshot" not in run["ranks"][1]["log"]
    assert run["ranks"][0]["files"] == ["trace_rank0_steps1-1.json", "trace_rank1_steps1-1.json"]  # no pickle
    assert sorted(n for n in _names(run["dir"] / "trace_rank0_steps1-1.json") if n.startswith("step ")) == ["step 1"]


def test_a_resume_inside_the_window_profiles_the_rest_and_the_end_of_training_closes_it(runs):
    assert runs["before_resume"]["ranks"][0]["files"] == []
    run = runs["resumed"]
    names = _names(run["dir"] / "trace_rank1_steps3-4.json")
    assert sorted(n for n in names if n.startswith("step ")) == ["step 3", "step 4"], names
    lines = [ln for ln in run["ranks"][0]["log"].splitlines() if ln.startswith("profiling: ")]
    assert len(lines) == 1 and "steps 3-4 of profiling.steps=2:9 (training ended after step 4)" in lines[0], lines
