"""Train steps of the users' configuration on an indexed fake accelerator (``fakegpu:0``, see
:mod:`fake_device`) and torch's fake process group at DP = 2 and DP = 64 (rank 0): Muon with whole-matrix owners,
the distributed optimizer, GeoFP8 with a refresh at every step, and overlapped parameter gathers.

Every tensor the stack builds (parameters, gradient buffers, main params, optimizer state, codec workspaces, GeoFP8
factors and transforms) must be on the device with its index, with the dtype the design says (FP32 main params,
gradients, factors and transforms); shapes follow the shard plan.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_device import run_in_subprocess  # noqa: E402


def fake_run(world: int) -> dict:
    import torch

    import fake_device as fd
    import megatron_geo.model.llama as llama
    from helpers import tiny_cfg
    from megatron_geo.geometry import transform
    from megatron_geo.parallel.context import build_groups
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    dev = fd.register()
    fd.no_weight_init(llama)
    transform.LowRankTransform.checksum = lambda self: "0" * 16  # fake tensors hold no bytes to hash
    cfg = tiny_cfg(
        "optimizer.name=muon",
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "geo.rank=4",
        "geo.layers=layers.*.mlp.down_proj.weight",
        "geo.refresh_interval=1",
        "parallel.overlap_param_gather=true",
        f"train.global_batch_size={2 * world}",
    )
    out = {"wrong_device": [], "wrong_dtype": [], "steps": 0}
    with fd.fake_world(world), fd.fake_tensors() as reads:
        pctx = build_groups(0, world, 1, dev, "fake")
        model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
        geo = reducer.geo
        ctx = StepContext(model, sync, opt, pctx, 1.0, geo=geo)
        s, v = cfg.model.seq_length, cfg.model.vocab_size
        for step in range(2):
            mbs = [
                {
                    "tokens": torch.randint(0, v, (2, s)),
                    "labels": torch.randint(0, v, (2, s)),
                    "loss_mask": torch.ones(2, s),
                }
            ]
            train_step(ctx, step, mbs, global_tokens=2 * s * world)
            out["steps"] += 1
        opt.wait_param_gather()

        def check(what, t, dtype=None):
            if t.device != dev:
                out["wrong_device"].append(f"{what}: {t.device}")
            if dtype is not None and t.dtype != dtype:
                out["wrong_dtype"].append(f"{what}: {t.dtype}")

        for n, p in model.named_parameters():
            check(f"param {n}", p)
        for b in buckets:
            check(f"bucket {b.index} grads", b.grad_data, torch.float32)
            check(f"bucket {b.index} params", b.param_data)
        for m in opt.mains:
            check(f"main {m.name}", m.main, torch.float32)
            for k, st in opt.optimizer_of(m).state[m.main].items():
                if isinstance(st, torch.Tensor) and k != "step":
                    check(f"state {m.name}/{k}", st, torch.float32)
        for n, t in geo.transforms.items():
            check(f"transform {n} U", t.U, torch.float32)
            check(f"transform {n} d", t.d, torch.float32)
        out["transforms"] = len(geo.transforms)
        out["host_reads"] = sorted(set(reads.devices))
    return out


@pytest.mark.parametrize("world", [2, 64])
def test_train_steps_keep_every_tensor_on_the_indexed_device_in_its_dtype(world):
    res = run_in_subprocess("test_fake_device_step", str(world))
    assert res["steps"] == 2
    assert res["wrong_device"] == [], res["wrong_device"][:10]
    assert res["wrong_dtype"] == [], res["wrong_dtype"][:10]
    assert res["transforms"] >= 2  # one per selected down_proj


def test_a_device_named_without_index_gets_the_current_one(monkeypatch):
    """``cuda`` names no index while every CUDA tensor has one; the parallel context always holds the indexed
    device (torch's own rule: tensors made on ``cuda`` land on the current device)."""
    import torch

    from megatron_geo.parallel import indexed_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device("cuda") == torch.device("cuda", 3) != torch.device("cuda")
    assert indexed_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")


def test_build_groups_keeps_the_device_index(monkeypatch):
    res = run_in_subprocess("test_fake_device_step", "groups")
    assert res == {"device": "cuda:0", "index": 0}


def _groups() -> dict:
    import torch

    import fake_device as fd
    from megatron_geo.parallel import build_groups

    torch.cuda.current_device = lambda: 0  # no CUDA here: the index torch would pick
    with fd.fake_world(2):
        pctx = build_groups(0, 2, 1, "cuda", "fake")
        return {"device": str(pctx.device), "index": pctx.device.index}


if __name__ == "__main__":
    import json

    print(json.dumps(_groups() if sys.argv[1] == "groups" else fake_run(int(sys.argv[1]))))
