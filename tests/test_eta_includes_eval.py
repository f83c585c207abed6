"""The ETA counts the evaluations and checkpoint saves still to come, at their measured durations, and says what it
leaves out before a kind has been timed. Durations come from an injected clock; expected ETAs are worked out by
hand in each test."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_helpers import make_corpus, tiny_train_overrides
from megatron_geo.training import eta as E
from megatron_geo.training.eta import eta_line, format_duration, metrics_eta_line
from megatron_geo.training.log_line import log_line

ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t

    def advance(self, seconds):
        self.t += seconds


def trainer_schedule(start, total, eval_interval, ckpt_interval, save_at_end):
    """Steps the trainer evaluates and saves at, by its own rules (eval: multiples and the last step; saves:
    multiples, then the end save unless the last step was just saved)."""
    evals = [k for k in range(start + 1, total + 1) if eval_interval and (k % eval_interval == 0 or k == total)]
    saves = [k for k in range(start + 1, total + 1) if ckpt_interval and k % ckpt_interval == 0]
    if save_at_end and total > start and (not saves or saves[-1] != total):
        saves.append(total)
    return evals, saves


@pytest.mark.parametrize(
    "start,total,ev,ck,end",
    [
        (0, 10, 2, 5, True),
        (0, 10, 3, 4, False),
        (3, 10, 3, 0, True),
        (0, 7, 50, 0, True),
        (0, 8, 4, 4, True),
        (8, 8, 2, 2, True),
        (0, 5, 0, 2, False),
    ],
)
def test_planned_counts_follow_the_trainers_rules(start, total, ev, ck, end):
    evals, saves = trainer_schedule(start, total, ev, ck, end)
    assert E.planned_evals(start, total, ev) == len(evals)
    assert E.planned_saves(start, total, ck, end) == len(saves)


def test_eta_with_eval_every_2_steps_and_a_save_every_5():
    """10 steps of 1 s, an evaluation after every 2nd step (steps 2..10: 5), saves after steps 5 and 10 (the end
    save is the step-10 one). Evaluations take 2 s then 3 s (mean 2.5 s), the save 4 s."""
    clock = FakeClock()
    timer = E.RunTimer(10, 0, eval_interval=2, checkpoint_interval=5, save_at_end=True, clock=clock)
    lines = {}
    for step in range(1, 6):
        clock.advance(1.0)  # the step itself (the trainer measures it apart)
        if step == 2:
            with timer.timing("eval"):
                clock.advance(2.0)
        if step == 4:
            with timer.timing("eval"):
                clock.advance(3.0)
        lines[step] = eta_line(step, 10, [1.0], 100.0, now=0.0, phases=timer.phases())
        if step == 5:
            with timer.timing("save"):
                clock.advance(4.0)
            lines["5 after save"] = eta_line(step, 10, [1.0], 100.0, now=0.0, phases=timer.phases())
    # step 1: nothing timed yet: 9 steps, evaluations and saves left out and named
    assert "ETA 9s (finish" in lines[1] and "excludes evaluations and checkpoint saves, none timed yet" in lines[1]
    # step 2: 8 steps + 4 evaluations (4, 6, 8, 10) x 2 s = 16 s; saves still untimed
    assert "ETA 16s (" in lines[2] and "excludes checkpoint saves, none timed yet" in lines[2]
    # step 4: 6 steps + 3 evaluations x 2.5 s = 13.5 s -> rounds to 14 s (format_duration rounds half to even)
    assert f"ETA {format_duration(6 + 3 * 2.5)} (" in lines[4] and format_duration(13.5) == "14s"
    # step 5 before its save: 5 steps + 3 x 2.5 s; the two saves (5 and 10) are still to come, untimed
    assert f"ETA {format_duration(5 + 7.5)} (" in lines[5] and "checkpoint saves" in lines[5]
    # after the step-5 save of 4 s: 5 steps + 3 x 2.5 s + 1 save x 4 s = 16.5 s, nothing left out
    assert f"ETA {format_duration(5 + 7.5 + 4)} (finish" in lines["5 after save"]
    assert "excludes" not in lines["5 after save"]
    ph = timer.phases()
    assert (ph.eval_mean_s, ph.evals_left, ph.save_mean_s, ph.saves_left) == (2.5, 3, 4.0, 1)


def test_eta_from_hours_long_evaluations_is_not_the_step_time_alone():
    """1000 steps of 10 s with an evaluation of 10 s every 2 steps: the old step-only ETA was half the time."""
    clock = FakeClock()
    timer = E.RunTimer(1000, 0, eval_interval=2, clock=clock)
    with timer.timing("eval"):
        clock.advance(10.0)
    left_steps = 998 * 10.0
    left_evals = 499 * 10.0  # evaluations after steps 4, 6, ..., 1000
    line = eta_line(2, 1000, [10.0], 1.0, now=0.0, phases=timer.phases())
    assert f"ETA {format_duration(left_steps + left_evals)} (" in line
    assert format_duration(left_steps + left_evals) != format_duration(left_steps)


def test_the_trainers_log_line_uses_the_same_eta():
    clock = FakeClock()
    timer = E.RunTimer(20, 0, eval_interval=5, checkpoint_interval=10, save_at_end=True, clock=clock)
    with timer.timing("eval"):
        clock.advance(30.0)
    rec = {
        "step": 5,
        "loss": 3.0,
        "lr": 1e-3,
        "grad_norm": 1.0,
        "tokens_per_sec": 10.0,
        "step_time_s": 2.0,
        "comm_bytes": 0,
        "val_loss": 3.1,
    }
    line = log_line(rec, 20, [2.0, 2.0], 0, timer.phases())
    # 15 steps x 2 s + 3 evaluations (10, 15, 20) x 30 s = 120 s; saves (10, 20) untimed
    assert line.endswith("ETA 2m00s+saves")


def test_the_metrics_watcher_adds_logged_eval_and_save_times(tmp_path):
    """Records as the trainer writes them: eval_time_s on evaluated steps, a save's seconds on the next logged
    step. 12 steps, evaluation every 3 steps, save every 4 steps and at the end (12: the same save)."""
    recs = []
    for step in range(1, 7):
        r = {"step": step, "step_time_s": 2.0, "tokens_per_sec": 50.0}
        if step % 3 == 0:
            r.update(val_loss=3.0, eval_time_s={3: 5.0, 6: 7.0}[step])
        if step == 5:
            r.update(checkpoint_time_s=9.0, checkpoints_saved=1)  # the save after step 4
        recs.append(r)
    # the config of the run folder gives the schedule; before any evaluation the line says it leaves them out
    (tmp_path / "config.yaml").write_text(
        "train:\n  steps: 12\n  eval_interval: 3\n  eval_batches: 1\ncheckpoint:\n  interval: 4\n  save_at_end: true\n"
    )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:2]))
    out = subprocess.run(
        [sys.executable, str(ROOT / "megatron_geo/training/eta.py"), "--run-dir", str(tmp_path), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    # 10 steps x 2 s; evaluations and saves still to come, none timed
    assert "ETA 20s (finish" in out.stdout and "excludes evaluations and checkpoint saves, none timed yet" in out.stdout
    # all six records: the measured durations are added
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = subprocess.run(
        [sys.executable, str(ROOT / "megatron_geo/training/eta.py"), "--run-dir", str(tmp_path), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # 6 steps x 2 s + 2 evaluations (9, 12) x 6 s + 2 saves (8, 12) x 9 s = 42 s
    assert f"ETA {format_duration(6 * 2.0 + 2 * 6.0 + 2 * 9.0)} (finish" in out.stdout, out.stdout
    line = metrics_eta_line(recs, 12, now=0.0, schedule=E.Schedule(3, 4, True))
    assert "| 2.000 s/step |" in line and f"ETA {format_duration(42.0)} (finish" in line and "excludes" not in line


def test_training_logs_eval_and_save_times_and_its_eta_names_what_is_untimed(tmp_path):
    """A real 6-step run (evaluation every 2 steps, save every 3): the records carry the measured durations and
    the log lines name what the ETA leaves out until each kind has been timed once."""
    data = make_corpus(tmp_path / "corpus")
    run = tmp_path / "run"
    args = tiny_train_overrides(
        run,
        data,
        "train.steps=6",
        "train.eval_interval=2",
        "checkpoint.interval=3",
        "checkpoint.save_at_end=false",
        "train.device=cpu",
    )
    r = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_llama.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    eta = {
        int(ln.split()[1].split("/")[0]): ln.split("| ETA ")[1]
        for ln in r.stdout.splitlines()
        if ln.startswith("step ") and "| ETA " in ln
    }
    assert eta[1].endswith("+evals+saves")
    assert eta[2].endswith("s+saves")
    assert eta[3].endswith("s+saves")  # the step-3 save comes after its line
    assert "+" not in eta[4] and "+" not in eta[5]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by = {x["step"]: x for x in recs}
    assert all(by[k]["eval_time_s"] > 0 for k in (2, 4, 6)) and "eval_time_s" not in by[3]
    assert by[4]["checkpoints_saved"] == 1 and by[4]["checkpoint_time_s"] > 0 and "checkpoints_saved" not in by[5]
