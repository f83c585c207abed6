"""Every collective gets tensors on its process group's device.

On CPU the NCCL rule cannot fail by itself, so the run is made under ``strict_devices``: a tensor factory called
from the package without ``device=`` creates a ``meta`` tensor, which the collectives module rejects (as NCCL
rejects a CPU tensor) and which no op can mix with real data.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckpt_helpers import make_corpus, tiny_train_overrides
from dist_harness import run_distributed
from megatron_geo.parallel import collectives as C

ROOT = Path(__file__).resolve().parent.parent


def test_guard_rejects_wrong_device_and_names_the_fix(world):
    with pytest.raises(C.CollectiveDeviceError, match=r"all_reduce: tensor 0 .* is on meta .*device=pctx.device"):
        C.all_reduce(torch.zeros(3, device="meta"), world)
    with C.strict_devices():
        made_here = torch.zeros(2)  # this test module is not the package: real CPU tensor
    assert made_here.device.type == "cpu"
    t = torch.ones(4)
    C.all_reduce(t, world)  # a CPU tensor with gloo is fine
    assert t.tolist() == [1.0] * 4


def test_strict_mode_turns_implicit_factories_of_the_package_into_meta():
    from megatron_geo.comm.hadamard import hadamard_signs
    from megatron_geo.geometry.transform import identity_transform

    with C.strict_devices():
        # hadamard_signs draws on the host on purpose and names device="cpu" (the reducer moves the signs to
        # its device: the fp8-hadamard case below multiplies them with the gradients under this mode)
        assert hadamard_signs(8, 0).device.type == "cpu"
        assert identity_transform(4, torch.device("cpu")).U.device.type == "cpu"
        implicit = C._ImplicitToMeta(("test_device_guard",))
    with implicit:
        assert torch.zeros(2).device.type == "meta" and torch.zeros(2, device="cpu").device.type == "cpu"


def _train_strict(rank, world, overrides):
    from megatron_geo.config import load_config
    from megatron_geo.parallel import build_groups
    from megatron_geo.training.trainer import train

    cfg = load_config([], overrides)
    pctx = build_groups(rank, world, 1, torch.device("cpu"), "gloo")
    with C.strict_devices(STRICT_PACKAGES):
        summary = train(cfg, pctx)
    return summary["steps"], summary["checkpoint"]


# the reduction and control path (the model and data packages build on the host on purpose, then move)
STRICT_PACKAGES = (
    "megatron_geo.comm",
    "megatron_geo.geometry",
    "megatron_geo.checkpoint",
    "megatron_geo.distributed",
    "megatron_geo.training.step",
    "megatron_geo.training.signals",
    "megatron_geo.training.trainer",
    "megatron_geo.parallel",
    "megatron_geo.tensor_parallel",
    "megatron_geo.optim",
)

CASES = {
    "geofp8-auto-search": [
        "comm.dtype=fp8_e4m3",
        "comm.transform=geo",
        "comm.error_feedback=true",
        "geo.layers=layers.*.mlp.*_proj.weight",
        "geo.select=auto",
        "geo.num_layers=2",
        "geo.profile_steps=2",
        "geo.refresh_interval=2",
        "geo.rank=4",
        "geo.power_search=[0.5,0.25,0]",
    ],
    "fp8-hadamard": ["comm.dtype=fp8_e4m3", "comm.transform=hadamard", "comm.hadamard_block=16"],
    "nvfp4-muon": ["comm.dtype=nvfp4", "optimizer.name=muon"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_dp2_training_and_checkpoint_under_strict_devices(tmp_path, name):
    data = make_corpus(tmp_path / "data")
    ov = tiny_train_overrides(tmp_path / "run", data, "train.steps=5", "checkpoint.interval=5", *CASES[name])
    out = run_distributed(_train_strict, 2, ov)
    assert all(steps == 5 and ckpt for steps, ckpt in out), out
