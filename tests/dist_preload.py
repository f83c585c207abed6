"""Imported once by the fork server of ``dist_harness``: what every distributed test's ranks need.

A module that fails to import here (the package mid-edit, an optional dependency missing) is skipped;
the forked rank then imports it itself and reports the error with its own traceback.
"""

import importlib

for _name in ("torch", "torch.distributed", "torch.distributed.checkpoint", "megatron_geo.training.trainer"):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - never take the fork server down
        pass
