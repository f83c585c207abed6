"""tools/dry_run.py prints only figures that do not depend on other ranks' data, and those are right; after a
step the parameters are this rank's update on its own range and untouched elsewhere, for AdamW (even plans)
and Muon (whole-parameter plans) alike.

The reference is an independent single-process run (gloo, DP = 1) of the trainer's step on the same global
batch (rank 0's micro-batches of the dry run), with clipping off (the dry run's norm covers its own range
only). Everything runs in one fresh spawned process: the fake and the gloo process groups are its own."""

import contextlib
import io
import json
import multiprocessing as mp
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DP = 4
TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_length=16",
    "model.vocab_size=131",
    "model.make_vocab_size_divisible_by=1",
    "parallel.bucket_size=3000",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "optimizer.lr=1e-2",
    "optimizer.min_lr=1e-2",
    "train.warmup_steps=0",
    "optimizer.clip_grad=0",
    "logging.wandb=disabled",
    "train.device=cpu",
]


def _params(model) -> dict[str, np.ndarray]:
    return {n: p.detach().double().reshape(-1).numpy().copy() for n, p in model.named_parameters()}


def _both(opt_name: str, json_path: str) -> dict:
    """In a fresh process: the dry run's step-1 state and printout, then the single-process reference."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(ROOT / "tools"))
    import dry_run

    from megatron_geo.config import load_config
    from megatron_geo.parallel import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    torch.set_num_threads(1)
    over = TINY + [f"optimizer.name={opt_name}"]
    cfg = load_config([], over)
    out = {}
    # 1. the command line, two steps (it sets up and tears down its own fake process group)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rc = dry_run.main(
            [
                "--config",
                str(ROOT / "configs/tiny.yaml"),
                "--dp",
                str(DP),
                "--steps",
                "2",
                "--exact-init",
                "--json",
                json_path,
                *over,
            ]
        )
    out.update(rc=rc, stdout=text.getvalue())
    # 2. the dry run's own steps (one step), on the fake process group
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=DP)
    try:
        recs, state = dry_run.run_steps(cfg, build_groups(0, DP, 1, torch.device("cpu"), "fake"), DP, 1)
        owned = {n: np.zeros(p.numel(), dtype=bool) for n, p in state["model"].named_parameters()}
        for m in state["optimizer"].mains:
            owned[m.name][m.param_start : m.param_start + m.main.numel()] = True
        out.update(
            dry_loss=recs[0]["loss"],
            dry_params=_params(state["model"]),
            owned=owned,
            uneven=sum(1 for b in state["buckets"] if not b.plan.even),
        )
    except Exception as e:  # noqa: BLE001 - reported by the test that needs it
        out["steps_error"] = repr(e)
    finally:
        dist.destroy_process_group()
    # 3. the reference: one process, the same global batch (rank 0's micro-batches of the dry run: its seeded
    # draws of micro_batch_size sequences, global_batch_size / (DP * micro_batch_size) of them)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pctx = build_groups(0, 1, 1, torch.device("cpu"), "gloo")
    torch.manual_seed(cfg.train.seed)
    model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
    out["init_params"] = _params(model)
    g = torch.Generator().manual_seed(cfg.train.seed)
    micro, seq, v = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    mbs = []
    for _ in range(cfg.train.global_batch_size // (DP * micro)):
        data = torch.randint(0, v, (micro, seq + 1), generator=g)
        mbs.append({"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": torch.ones(micro, seq)})
    res = train_step(StepContext(model, sync, opt, pctx, 0.0, cfg.train.autocast_dtype), 0, mbs)
    opt.wait_param_gather()
    out.update(ref_loss=res.loss, ref_params=_params(model))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dry")
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        res = {o: ex.submit(_both, o, str(d / f"{o}.json")).result(timeout=600) for o in ("adamw", "muon")}
    for o in res:
        res[o]["json"] = json.loads((d / f"{o}.json").read_text())
    return res


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_step1_loss_is_rank0s_loss_of_the_single_process_run(runs, opt_name):
    r = runs[opt_name]
    assert r["rc"] == 0, r["stdout"]
    line1 = next(ln for ln in r["stdout"].splitlines() if ln.startswith("step 1:"))
    assert f"rank 0 loss {r['ref_loss']:.4f}" in line1, line1
    assert r["json"].get("rank0_step1_loss") == pytest.approx(r["ref_loss"], rel=1e-6), r["json"]
    assert r.get("dry_loss") == pytest.approx(r["ref_loss"], rel=1e-6), r.get("steps_error")


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_figures_that_depend_on_other_ranks_are_not_printed(runs, opt_name):
    r = runs[opt_name]
    line2 = next(ln for ln in r["stdout"].splitlines() if ln.startswith("step 2:"))
    assert "loss" not in line2 and "grad" not in line2 and "norm" not in r["stdout"].split("step 1:")[1], line2
    assert all(set(s) == {"step", "time_s", "updated"} for s in r["json"]["steps"]), r["json"]["steps"]
    assert r["json"]["optimizer_steps"] == 2


@pytest.mark.parametrize("opt_name", ["adamw", "muon"])
def test_after_a_step_own_ranges_hold_the_update_and_other_ranges_are_untouched(runs, opt_name):
    r = runs[opt_name]
    assert "steps_error" not in r, r.get("steps_error")
    if opt_name == "muon":
        assert r["uneven"] > 0  # Muon matrices are owned whole: the whole-parameter plan
    n_own = n_other = 0
    for name, own in r["owned"].items():
        got, init, ref = r["dry_params"][name], r["init_params"][name], r["ref_params"][name]
        np.testing.assert_allclose(got[own], ref[own], rtol=1e-5, atol=1e-7, err_msg=name)
        np.testing.assert_array_equal(got[~own], init[~own], err_msg=name)
        n_own, n_other = n_own + own.sum(), n_other + (~own).sum()
    assert n_own > 0 and n_other > 0
    # the update moved the owned elements (the comparison above is not of unchanged values)
    moved = sum(int((r["ref_params"][n][o] != r["init_params"][n][o]).sum()) for n, o in r["owned"].items())
    assert moved > 0.5 * n_own
