"""Behaviour recorded from an earlier version of the code (``tests/golden.py``; its docstring says how to
regenerate): every comm preset hands the collectives the same bytes, and a checkpoint that version wrote
resumes to the same losses and gradient norms, bitwise."""

from __future__ import annotations

import json
import shutil

import pytest

from dist_harness import run_distributed
from golden import CHECKPOINTS, CORPUS_TOKEN, GOLDEN, RUN_TOKEN, RUNS, record_wire

RECORDED = json.loads((GOLDEN / "wire_codes.json").read_text())


def _record_many(rank, world, corpus, root, names):
    return {n: record_wire(rank, world, corpus, f"{root}/{n}", RUNS[n][0], RUNS[n][1]) for n in names}


# control traffic (start-up agreement on config and paths: int64; timings: float64) differs between launches
WIRE_DTYPES = {"uint8", "bfloat16", "float32"}


def _wire(calls: list) -> list:
    return [c for c in calls if c[1] in WIRE_DTYPES]


def _first_difference(want: list, got: list) -> str:
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return f"call {i}: recorded {a}, now {b}"
    return f"{len(want)} calls recorded, {len(got)} now"


@pytest.mark.parametrize("group", [0, 1, 2])
def test_every_preset_hands_the_collectives_the_recorded_bytes(tmp_path, group):
    assert sorted(RECORDED) == sorted(RUNS), "a preset was added or removed: regenerate tests/data/golden"
    names = sorted(RUNS)[group::3]
    out = run_distributed(_record_many, 2, str(GOLDEN / "corpus"), str(tmp_path), names)
    for name in names:
        for rank in range(2):
            want, got = RECORDED[name]["ranks"][rank], out[rank][name]
            w, g = _wire(want["calls"]), _wire(got["calls"])
            assert g == w, f"{name} rank {rank}: {_first_difference(w, g)}"
            assert got["losses"] == want["losses"], name


def _resume(rank, world, corpus, run_dir, preset, extra):
    return record_wire(rank, world, corpus, run_dir, preset, extra)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_a_checkpoint_written_by_the_recorded_version_resumes_bitwise(tmp_path, name):
    recorded = json.loads((GOLDEN / "resume.json").read_text())[name]
    run = tmp_path / "run"
    shutil.copytree(GOLDEN / "ckpt" / name, run / "checkpoints")
    corpus = (GOLDEN / "corpus").resolve()
    for f in (run / "checkpoints" / "step_00000002").glob("*.json"):
        f.write_text(f.read_text().replace(CORPUS_TOKEN, str(corpus)).replace(RUN_TOKEN, str(run)))
    out = run_distributed(
        _resume,
        2,
        str(corpus),
        str(run),
        recorded["preset"],
        [*recorded["extra"], "checkpoint.interval=2", "checkpoint.keep_latest=0"],
    )
    resumed = out[0]["losses"]
    assert [s for s, *_ in resumed] == [3, 4]  # it resumed from step 2
    assert resumed == [r for r in recorded["losses"] if r[0] > 2]
    assert out[1]["losses"] == resumed
