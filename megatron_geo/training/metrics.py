"""Metric sinks: stdout, ``metrics.jsonl`` and wandb (offline by default). Only rank 0 writes."""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path


class MetricsLogger:
    """Append one JSON object per logged step to ``run_dir/metrics.jsonl`` and mirror it to wandb.

    A fresh run (``resume_step=0``) starts a new file; a run resumed from the checkpoint of step
    ``resume_step`` keeps the records up to that step and continues the same wandb run (its id is kept
    in ``run_dir/wandb_run_id``).

    ``wandb_mode``: offline | online | disabled. The wandb group defaults to the comm settings, so runs of
    different comm modes line up in one project.
    """

    def __init__(self, run_dir: str, enabled: bool, wandb_mode: str, project: str, group: str, name: str,
                 tags: list[str], config: dict, resume_step: int = 0):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        kept = []
        if resume_step > 0 and self.path.is_file():  # a resumed run keeps the records up to its checkpoint
            for line in self.path.read_text().splitlines():
                try:
                    if json.loads(line).get("step", 0) <= resume_step:
                        kept.append(line)
                except ValueError:
                    break  # a line cut by a crash: drop it and what follows
        # a new run starts a new file; a resumed one rewrites the kept records first (atomically, so a kill
        # at any point loses nothing that was written) and then appends
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)
        if wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            id_file = Path(run_dir) / "wandb_run_id"
            if resume_step > 0 and id_file.is_file():
                run_id = id_file.read_text().strip()
            else:
                run_id = uuid.uuid4().hex[:12]  # wandb accepts any [a-z0-9] id; its generate_id moved in 0.31
                id_file.write_text(run_id + "\n")
            self._wandb = wandb.init(project=project, group=group or None, name=name or None, tags=tags,
                                     config=config, dir=run_dir, mode=wandb_mode, reinit=True, id=run_id,
                                     resume="allow")

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
