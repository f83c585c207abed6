"""metrics.jsonl and the wandb sink (offline, the default), including a resumed run."""

from __future__ import annotations

import json

from megatron_geo.training.metrics import MetricsLogger


def test_offline_wandb_run_and_resume_keep_one_run_and_the_records(tmp_path):
    def logger(resume_step):
        return MetricsLogger(
            str(tmp_path), True, "offline", "megatron-geo-test", "g", "n", ["t"], {"a": 1}, resume_step=resume_step
        )

    m = logger(0)
    for step in (1, 2, 3):
        m.log({"step": step, "loss": 5.0 - step, "grad_norm": float("nan") if step == 2 else 1.0})
    m.close()
    run_id = json.loads((tmp_path / "wandb_run_id").read_text())["id"]
    assert run_id and list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    m = logger(2)  # resumed from the checkpoint of step 2: record 3 is dropped, the wandb run continues
    m.log({"step": 3, "loss": 1.5})
    m.close()
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3] and recs[1]["grad_norm"] is None and recs[2]["loss"] == 1.5
    assert json.loads((tmp_path / "wandb_run_id").read_text())["id"] == run_id
