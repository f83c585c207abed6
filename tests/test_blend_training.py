"""Training on a weighted blend with a split and the end-of-document options: a resume is bitwise the
uninterrupted run, the checkpoint records the consumed samples and the training files, and files rewritten under
the same prefix stop the resume. Reference: the uninterrupted run of the same config."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ckpt_helpers import make_corpus, tiny_train_overrides
from ckpt_helpers import train_jobs as _train_jobs
from dist_harness import run_distributed


@pytest.fixture(scope="module")
def blend_data(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("blend")
    base = make_corpus(root)
    keep = [o for o in base if not o.startswith(("data.train_prefix", "data.valid_prefix"))]
    return [*keep, f"data.train_blend=0.7 {root}/train 0.3 {root}/valid", "data.split=90,10,0"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


OPTIONS = ["data.eod_mask_loss=true", "data.reset_position_ids=true", "data.reset_attention_mask=true"]


def test_blend_with_split_resumes_bitwise_and_records_its_files(tmp_path, blend_data):
    base = ["train.steps=6", "comm.dtype=fp8_e4m3", "train.eval_interval=3", *OPTIONS]
    straight = tiny_train_overrides(tmp_path / "straight", blend_data, *base)
    first = tiny_train_overrides(tmp_path / "resumed", blend_data, *base, "train.exit_interval=3")
    second = tiny_train_overrides(tmp_path / "resumed", blend_data, *base)
    run_distributed(_train_jobs, 2, [straight, first])
    run_distributed(_train_jobs, 2, [second])
    keys = ("step", "loss", "grad_norm", "val_loss", "consumed_samples", "tokens")
    a = [{k: r.get(k) for k in keys} for r in _records(tmp_path / "straight")]
    b = [{k: r.get(k) for k in keys} for r in _records(tmp_path / "resumed")]
    assert [r["step"] for r in b] == list(range(1, 7))
    assert b == a
    assert all(r["val_loss"] is None or np.isfinite(r["val_loss"]) for r in a)
    assert any(r["val_loss"] is not None for r in a)  # the split's validation parts are evaluated
    meta = json.loads((tmp_path / "resumed/checkpoints/step_00000003/meta.json").read_text())
    assert meta["consumed_samples"] == 3 * 8
    assert [Path(f["prefix"]).name for f in meta["data_files"]] == ["train", "valid"]
    assert meta["config"]["data"]["train_blend"].split()[0] == "0.7"


def test_blend_resume_with_rewritten_files_is_refused(tmp_path, blend_data):
    from megatron_geo.data import IndexedDataset, IndexedDatasetBuilder

    # a private copy of the corpus, so that rewriting it leaves the module's fixture alone
    src = Path(next(o for o in blend_data if o.startswith("data.train_blend")).split()[1]).parent
    root = tmp_path / "data"
    root.mkdir()
    for name in ("train", "valid"):
        ds = IndexedDataset(str(src / name))
        with IndexedDatasetBuilder(str(root / name), vocab_size=96) as b:
            for i in range(len(ds)):
                b.add_document(np.asarray(ds[i]))
    data = [
        o if not o.startswith("data.train_blend") else f"data.train_blend=0.7 {root}/train 0.3 {root}/valid"
        for o in blend_data
    ]
    base = ["train.steps=4", "train.eval_batches=0"]
    run_distributed(_train_jobs, 1, [tiny_train_overrides(tmp_path / "run", data, *base, "train.exit_interval=2")])
    ds = IndexedDataset(str(root / "train"))
    docs = [np.asarray(ds[i]).copy() for i in range(len(ds))]
    del ds
    with IndexedDatasetBuilder(str(root / "train"), vocab_size=96) as b:  # the same documents, reversed
        for d in reversed(docs):
            b.add_document(d)
    with pytest.raises(Exception, match=r"training files changed.*checkpoint.allow_changes=data.files"):
        run_distributed(_train_jobs, 1, [tiny_train_overrides(tmp_path / "run", data, *base)])
    allowed = tiny_train_overrides(tmp_path / "run", data, *base, "checkpoint.allow_changes=data.files")
    run_distributed(_train_jobs, 1, [allowed])
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2, 3, 4]
