"""pytest plugin of benchmarks/gpu_check.sh's ``cuda_tests`` phase: keep only the tests that need CUDA.

    python -m pytest -p gpu_check_pytest tests/test_gpu_path.py ...   (benchmarks/ on PYTHONPATH)

A test needs CUDA when it carries a ``skipif`` mark (its own or its module's) whose reason names CUDA, e.g.
``@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")``; every other test is deselected.
"""

from __future__ import annotations


def needs_cuda(item) -> bool:
    """True when one of ``item``'s skipif marks gives a reason that mentions CUDA."""
    for mark in item.iter_markers("skipif"):
        reasons = [mark.kwargs.get("reason", "")] + [a for a in mark.args if isinstance(a, str)]
        if any("cuda" in str(r).lower() for r in reasons):
            return True
    return False


def pytest_collection_modifyitems(session, config, items):
    keep = [it for it in items if needs_cuda(it)]
    drop = [it for it in items if not needs_cuda(it)]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
