"""The plan tools/plan_report.py shows is the plan the trainer builds: for every comm preset of configs/comm, with
Muon and AdamW, at DP = 8 and 64, the report's buckets (parameter names, offsets, DP-rank bounds, buffer elements)
equal the buckets ``build_model_and_optimizer`` lays out on rank 0 of a fake process group of that size (the dry
run's), with the live reducer's alignment. Tensor-scaled FP8 is the case that differed: its 16-element granule.

The model has ``hidden_size = 40`` (rows and matrices that are not multiples of 16) and small buckets, so the
alignment, the GeoFP8 rows and the whole-parameter plans all show in the layout."""

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted(p.stem for p in (ROOT / "configs/comm").glob("*.yaml"))
BASE = ["model.hidden_size=40", "parallel.bucket_size=30000", "train.device=cpu", "logging.wandb=disabled"]
CASES = [(preset, opt, dp) for preset in PRESETS for opt in ("muon", "adamw") for dp in (8, 64)]


def _cfg(preset: str, opt: str, extra=()):
    from megatron_geo.config import load_config

    return load_config(
        [str(ROOT / "configs/tiny.yaml"), str(ROOT / f"configs/comm/{preset}.yaml")],
        [*BASE, f"optimizer.name={opt}", *extra],
    )


def _layouts(cases, extra=()) -> dict:
    """In a fresh process: per case, the report's plan and the trainer's buckets as plain lists."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_geo.analysis.plan_report import meta_model_params, plan_figures, plan_layout
    from megatron_geo.parallel import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer

    torch.set_num_threads(1)
    out = {}
    for case in cases:  # the report first: it builds its meta model where no process group exists
        preset, opt, dp = case
        cfg = _cfg(preset, opt, extra)
        params = meta_model_params(cfg, 1)
        figs = plan_figures(cfg, dp, params)
        out[case] = {
            "report": [
                (names, list(pl.offsets), list(pl.bounds), pl.buffer_numel)
                for names, pl in plan_layout(cfg, dp, params)
            ],
            "report_buffer": figs["buffer_elements_per_rank"],
            # rank 0's reduce bytes by the report's count: S - own elements per bucket at the wire's bytes/element
            "report_rank0_bytes": sum(
                (pl.buffer_numel - (pl.bounds[1] - pl.bounds[0])) * figs["wire_bytes_per_element"]
                for _, pl in plan_layout(cfg, dp, params)
            ),
            "report_alignment": figs["alignment"],
        }
    for dp in sorted({c[2] for c in cases}):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
        try:
            pctx = build_groups(0, dp, 1, torch.device("cpu"), "fake")
            for case in (c for c in cases if c[2] == dp):
                cfg = _cfg(case[0], case[1], extra)
                _, buckets, reducer, _, _ = build_model_and_optimizer(cfg, pctx)
                if cfg.comm.scaling == "block":  # what rank 0's reducer hands the collectives for one reduction
                    before = reducer.bytes_sent
                    for b in buckets:
                        reducer.reduce_scatter(torch.zeros(b.plan.buffer_numel), b.reduction).wait()
                    out[case]["trainer_rank0_bytes"] = reducer.bytes_sent - before
                out[case].update(
                    trainer=[
                        (list(b.names), list(b.plan.offsets), list(b.plan.bounds), b.plan.buffer_numel) for b in buckets
                    ],
                    trainer_alignment=reducer.alignment(),
                )
        finally:
            dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def layouts():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        return ex.submit(_layouts, CASES).result(timeout=900)


@pytest.mark.parametrize("case", CASES, ids=[f"{p}-{o}-dp{d}" for p, o, d in CASES])
def test_the_report_shows_the_trainers_buckets(layouts, case):
    got = layouts[case]
    assert got["report_alignment"] == got["trainer_alignment"]
    assert got["report_buffer"] == sum(b[3] for b in got["trainer"])  # buffer elements per rank
    assert len(got["report"]) == len(got["trainer"])
    for i, (rep, tr) in enumerate(zip(got["report"], got["trainer"])):
        assert rep == tr, f"bucket {i}: report {rep[1:]} vs trainer {tr[1:]}"
        assert all(b % got["trainer_alignment"] == 0 for b in tr[2])  # every DP range is aligned


BLOCK_CASES = [c for c in CASES if c[0] in ("fp8_block", "geofp8")]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=[f"{p}-{o}-dp{d}" for p, o, d in BLOCK_CASES])
def test_block_scaled_reducers_send_the_bytes_the_report_counts(layouts, case):
    """Codes plus one FP32 scale per 128 elements of every other rank's range, also where the ranges are uneven
    (whole Muon matrices, GeoFP8 rows): the scales travel without padding to the longest range."""
    got = layouts[case]
    assert got["trainer_rank0_bytes"] == got["report_rank0_bytes"]


def test_tensor_scaled_fp8_is_laid_out_with_its_16_element_granule(layouts):
    """The example that differed: tiny config, hidden 40, Muon, fp8 (E4M3, tensor scaling), DP 8. The report said
    367,720 buffer elements per rank (alignment 1, no padding); the trainer has 367,792."""
    got = layouts[("fp8", "muon", 8)]
    assert got["trainer_alignment"] == 16 and got["report_alignment"] == 16
    assert sum(b[3] for b in got["trainer"]) == 367_792
    assert got["report_buffer"] == 367_792
