"""An indexed accelerator device for CPU tests: tensors on ``fakegpu:0`` that hold no data.

A CPU build of torch cannot make CUDA tensors, even fake ones: any Python indexing of a fake ``cuda:0`` tensor
asks for the CUDA device guard, which is not linked in. torch's PrivateUse1 slot, renamed ``fakegpu`` with a
Python device guard, gives a device *with an index* that every op accepts under ``FakeTensorMode``. Code that
drops the index (``t.device.type`` used as a placement, ``torch.device(dev.type)``, an equality between
``fakegpu`` and ``fakegpu:0``) fails here as it would on ``cuda:0``; shapes and dtypes propagate as on a GPU.

Registering the device is process-global and cannot be undone, so tests use it in a subprocess
(:func:`run_in_subprocess`). ``.item()`` on a fake tensor has no value: :class:`HostReads` answers it with
``1`` and records the device each read came from.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEVICE_TYPE = "fakegpu"
ROOT = Path(__file__).resolve().parent.parent


def register() -> torch.device:
    """Register the ``fakegpu`` device type once in this process; returns ``fakegpu:0``."""
    from torch.utils import backend_registration

    if not hasattr(torch, DEVICE_TYPE):
        backend_registration._setup_privateuseone_for_python_backend(DEVICE_TYPE)
        # a Python backend cannot make generators: the device's generators are CPU ones (fake tensors draw nothing)
        real = torch.Generator

        class Generator:
            def __new__(cls, device="cpu"):
                return real("cpu" if torch.device(device).type == DEVICE_TYPE else device)

        torch.Generator = Generator
        # torch.tensor(data, device=<non-CPU>) builds the tensor on the device below the dispatch modes, which
        # the Python backend cannot: build it on the host and copy it, as CUDA does
        real_tensor = torch.tensor

        def tensor(data, *args, device=None, **kwargs):
            t = real_tensor(data, *args, **kwargs)
            return t if device is None else t.to(device)

        torch.tensor = tensor
    return torch.device(DEVICE_TYPE, 0)


class HostReads(TorchDispatchMode):
    """Answers ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``) on fake tensors with 1 and
    records the device of each such read in :attr:`devices`."""

    def __init__(self):
        super().__init__()
        self.devices: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            self.devices.append(str(t.device))
            return 1.0 if t.dtype.is_floating_point else 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def fake_world(world: int):
    """torch's fake process group of ``world`` ranks, this process rank 0."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_tensors():
    """``FakeTensorMode`` (real CPU inputs allowed) with :class:`HostReads` on top; yields the HostReads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    reads = HostReads()
    with FakeTensorMode(allow_non_fake_inputs=True), reads:
        yield reads


def no_weight_init(monkey_module) -> None:
    """Skip the model's random initialisation (fake tensors hold no values; random ops on them are slow)."""
    monkey_module._init = lambda *a, **k: lambda t: None


def run_in_subprocess(module: str, *args: str, timeout: float = 600) -> dict:
    """Run ``python tests/<module>.py args...`` and return the JSON its last stdout line holds."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / f"{module}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if r.returncode != 0:
        raise AssertionError(f"tests/{module}.py {' '.join(args)} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])
