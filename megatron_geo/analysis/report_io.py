"""Small helpers of the fidelity reports: number formatting, means over finite values, strict JSON.

Part of :mod:`megatron_geo.analysis`: the training path never imports it.
"""

from __future__ import annotations

import json
import math
import os


def finite_mean(vals):
    """Mean of the finite values of ``vals`` (None and non-finite skipped); None if there are none."""
    vals = [v for v in vals if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def fmt_value(v, fmt: str) -> str:
    """``format(v, fmt)``, ``-`` for None, ``inf`` for infinity."""
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return format(v, fmt)


def _json_safe(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: str, obj: dict) -> None:
    """Write ``obj`` as strict JSON (non-finite floats as null), creating parent folders."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(_json_safe(obj), f, indent=1, allow_nan=False)
        f.write("\n")
