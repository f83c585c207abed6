import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("WANDB_MODE", "disabled")

import pytest  # noqa: E402

from markers import marks_for  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Mark every test ``dist`` / ``slurm`` / ``gpu`` / ``slow`` by the rules of tests/markers.py."""
    for item in items:
        for name in marks_for(item):
            item.add_marker(getattr(pytest.mark, name))


@pytest.fixture(scope="module")
def world():
    """A one-process gloo world (for tests that call collectives in the test process itself)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread (several OpenMP threads on shared cores only spin against each other)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
