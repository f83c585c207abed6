"""Behaviour recorded from an earlier version of the code (``tests/golden.py``; its docstring says how to
regenerate): every comm preset hands the collectives the same bytes, and a checkpoint that version wrote
resumes to the same losses and gradient norms, bitwise. Bitwise against the records of this host's kernel family where
there are some (``host_kernels.json``; for the GeoFP8 presets also its LAPACK family's, ``host_lapack.json``), else
against the committed records; a host of an unrecorded family that rounds differently is compared by its calls and
losses, with a warning (``tests/golden.py`` says why and how to add a family)."""

from __future__ import annotations

import functools
import json
import warnings

import pytest

from cpu_pin import pinned_env
from dist_harness import run_distributed
from golden import (
    CHECKPOINTS,
    GOLDEN,
    RUNS,
    host_records,
    kernel_records,
    pinned_fingerprint,
    record_wire,
    resume_committed,
    uses_eigh,
)

RECORDED = json.loads((GOLDEN / "wire_codes.json").read_text())


@functools.lru_cache(maxsize=1)
def _host() -> dict | None:
    """The GeoFP8 presets' records made on a host of this one's LAPACK family (golden.py's docstring), or None;
    looked up when a test needs it (a fresh interpreter computes the fingerprint), not at collection."""
    return host_records()


@functools.lru_cache(maxsize=1)
def _family() -> dict | None:
    """Every preset's records made on a host of this one's kernel family (golden.py's docstring), or None."""
    return kernel_records()


def _expected(name: str) -> tuple[dict, str]:
    """``(records, how)`` for preset ``name``: ``exact`` (this host's family has records, or its LAPACK family for a
    GeoFP8 preset), ``loose`` (a GeoFP8 preset on an unrecorded LAPACK family) or ``exact_or_warn`` (the committed
    records on an unrecorded kernel family)."""
    family = _family()
    if family is not None and name in family["wire"]:
        return family["wire"][name], "exact"
    if uses_eigh(RUNS[name][0]):
        host = _host()
        if host is not None and name in host["wire"]:
            return host["wire"][name], "exact"
        return RECORDED[name], "loose"
    return RECORDED[name], "exact_or_warn"


# losses and gradient norms of a GeoFP8 preset on a host whose LAPACK family has no records: another family's
# transforms move the tiny model's gradient norm by up to 8e-8 (relative) in 4 steps (muon_geofp8, AMD EPYC)
REL = 1e-6


def _record_many(rank, world, corpus, root, names):
    return {n: record_wire(rank, world, corpus, f"{root}/{n}", RUNS[n][0], RUNS[n][1]) for n in names}


# control traffic (start-up agreement on config and paths: int64; timings: float64) differs between launches
WIRE_DTYPES = {"uint8", "bfloat16", "float32"}


def _wire(calls: list) -> list:
    return [c for c in calls if c[1] in WIRE_DTYPES]


@pytest.fixture(autouse=True)
def _one_kernel_family(monkeypatch):
    """The ranks (fresh interpreters: ``run_distributed(..., start="spawn")``) run the recorded kernel family."""
    for k, v in pinned_env().items():
        monkeypatch.setenv(k, v)


def _close(want: list, got: list) -> bool:
    """``[[step, loss, grad norm], ...]`` equal in steps and within :data:`REL` in values."""
    return len(want) == len(got) and all(
        w[0] == g[0] and all(abs(a - b) <= REL * abs(a) for a, b in zip(w[1:], g[1:])) for w, g in zip(want, got)
    )


def test_close_tells_a_changed_loss_from_host_rounding():
    rec = [[3, 5.064915299415588, 0.7046017204214827]]
    assert _close(rec, [[3, 5.064915299415588, 0.7046017204214843]])  # the last bits of another CPU family
    assert not _close(rec, [[3, 5.064915299415588, 0.70459]])
    assert not _close(rec, [[4, 5.064915299415588, 0.7046017204214827]])


def _first_difference(want: list, got: list) -> str:
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return f"call {i}: recorded {a}, now {b}"
    return f"{len(want)} calls recorded, {len(got)} now"


@pytest.mark.parametrize("group", [0, 1, 2])
def test_every_preset_hands_the_collectives_the_recorded_bytes(tmp_path, group):
    assert sorted(RECORDED) == sorted(RUNS), "a preset without records: python tests/golden.py --add-preset NAME"
    names = sorted(RUNS)[group::3]
    out = run_distributed(_record_many, 2, str(GOLDEN / "corpus"), str(tmp_path), names, start="spawn")
    for name in names:
        records, how = _expected(name)
        for rank in range(2):
            want, got = records["ranks"][rank], out[rank][name]
            w, g = _wire(want["calls"]), _wire(got["calls"])
            if how == "exact_or_warn" and (g != w or got["losses"] != want["losses"]):
                warnings.warn(
                    f"{name}: this host's kernel family ({pinned_fingerprint('kernel')}) has no golden records and "
                    f"rounds differently from the committed ones; compared by calls and losses. Record it with "
                    f"python tests/golden.py --host-variant",
                    stacklevel=1,
                )
                how = "loose"
            if how != "loose":
                assert g == w, f"{name} rank {rank}: {_first_difference(w, g)}"
                assert got["losses"] == want["losses"], name
            else:  # another family: the same calls, the same losses up to rounding
                assert [c[:3] for c in g] == [c[:3] for c in w], f"{name} rank {rank}: {_first_difference(w, g)}"
                assert _close(want["losses"], got["losses"]), (name, want["losses"], got["losses"])


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_a_checkpoint_written_by_the_recorded_version_resumes_bitwise(tmp_path, name):
    recorded = json.loads((GOLDEN / "resume.json").read_text())[name]
    out = resume_committed(run_distributed, (GOLDEN / "corpus").resolve(), tmp_path / "run", name)
    resumed = out[0]["losses"]
    assert [s for s, *_ in resumed] == [3, 4]  # it resumed from step 2
    assert out[1]["losses"] == resumed
    host = _family() if _family() is not None else _host()
    if host is not None:
        assert resumed == host["resume"][name]
    else:  # the refresh at step 3 runs this host's LAPACK: equal up to its rounding
        assert _close([r for r in recorded["losses"] if r[0] > 2], resumed), (recorded["losses"], resumed)
    # the losses before the refresh do not depend on LAPACK: bitwise on every host
    assert resumed[0][1] == [r for r in recorded["losses"] if r[0] == 3][0][1]
