"""Imported before torch by the suite (conftest.py) and by tests/golden.py."""

import os


def pin_cpu_kernels() -> None:
    """One kernel family on every x86 host that has AVX2: PyTorch's vectorised kernels (``ATEN_CPU_CAPABILITY``)
    and MKL's BLAS/LAPACK code path (``MKL_CBWR``, MKL's conditional numerical reproducibility) would otherwise
    follow the host's widest vector unit, and an AVX-512 machine rounds some sums differently from an AVX2 one.
    The recorded wire bytes (tests/golden.py) are compared bitwise, so the suite pins both, before torch loads;
    an explicit setting in the environment wins."""
    try:
        with open("/proc/cpuinfo") as f:
            has_avx2 = " avx2" in f.read()
    except OSError:
        return
    if has_avx2:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("MKL_CBWR", "AVX2")


pin_cpu_kernels()
