"""One CPU kernel family for the recorded wire bytes (tests/golden.py, tests/test_golden.py).

PyTorch's vectorised kernels (``ATEN_CPU_CAPABILITY``) and MKL's BLAS/LAPACK code path (``MKL_CBWR``, MKL's
conditional numerical reproducibility) follow the host's widest vector unit, and an AVX-512 machine rounds some
sums differently from an AVX2 one. The golden records are compared bitwise, so their runs pin both to AVX2 on every
x86 host that has it. Only those runs: the rest of the suite runs the host's own kernels (Inductor's generated code
follows the host, and a test that compares it with eager should compare the same kernel family). An explicit
setting in the environment wins.
"""

import os


def pinned_env() -> dict[str, str]:
    """``{"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}`` on an x86 host with AVX2 (an explicit setting in the
    environment kept), else ``{}``."""
    try:
        with open("/proc/cpuinfo") as f:
            has_avx2 = " avx2" in f.read()
    except OSError:
        return {}
    if not has_avx2:
        return {}
    return {k: os.environ.get(k, v) for k, v in (("ATEN_CPU_CAPABILITY", "avx2"), ("MKL_CBWR", "AVX2"))}
