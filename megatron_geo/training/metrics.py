"""Metric sinks: stdout, ``metrics.jsonl`` and wandb (offline by default). Only rank 0 writes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


class MetricsLogger:
    """Append one JSON object per logged step to ``run_dir/metrics.jsonl`` and mirror it to wandb.

    ``wandb_mode``: offline | online | disabled. The wandb group defaults to the comm settings, so runs of
    different comm modes line up in one project.
    """

    def __init__(self, run_dir: str, enabled: bool, wandb_mode: str, project: str, group: str, name: str,
                 tags: list[str], config: dict):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        self._file = open(self.path, "w", buffering=1)  # a new run starts a new file
        if wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(project=project, group=group or None, name=name or None, tags=tags,
                                     config=config, dir=run_dir, mode=wandb_mode, reinit=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        # strict JSON: non-finite floats (a skipped step's norm) are written as null
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
