"""A resume never silently changes the documents: new data keys are compared with what an older checkpoint ran
with, and training files rewritten under the same prefix are refused."""

import copy
from pathlib import Path

import numpy as np
import pytest

from megatron_geo.checkpoint.resume_changes import check_data_files, check_resume_changes
from megatron_geo.config import ConfigError, config_to_dict, load_config
from megatron_geo.data import IndexedDatasetBuilder
from megatron_geo.data.identity import dataset_identity

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml")


def _cfg(*extra):
    return load_config([TINY], list(extra))


def _saved_before_the_new_keys(cfg) -> dict:
    """The config dict a checkpoint of the release before these keys would hold: without them."""
    d = copy.deepcopy(config_to_dict(cfg))
    for k in ("train_blend", "valid_blend", "split", "sample_order", "eod_mask_loss", "reset_position_ids"):
        d["data"].pop(k)
    d["data"].pop("reset_attention_mask")
    d.pop("profiling")
    return d


def test_an_old_checkpoint_ran_the_stream_order_and_the_new_default_is_refused():
    old = _saved_before_the_new_keys(_cfg())
    with pytest.raises(ConfigError, match=r"data.sample_order changed on resume: 'stream' -> 'megatron'"):
        check_resume_changes(old, _cfg(), 10, "resume")
    assert check_resume_changes(old, _cfg("data.sample_order=stream"), 10, "resume") == []
    notes = check_resume_changes(old, _cfg("checkpoint.allow_changes=data.sample_order"), 10, "resume")
    assert any("data.sample_order" in n and "allowed" in n for n in notes)
    with pytest.raises(ConfigError, match=r"data.eod_mask_loss changed on resume: False -> True"):
        check_resume_changes(old, _cfg("data.sample_order=stream", "data.eod_mask_loss=true"), 10, "resume")


def test_blend_paths_and_weights_compare_by_meaning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = config_to_dict(_cfg("data.train_blend=0.3 a 0.7 b"))
    assert check_resume_changes(saved, _cfg(f"data.train_blend=.30 {tmp_path}/a 0.70 ./b"), 5, "resume") == []
    with pytest.raises(ConfigError, match="data.train_blend changed on resume"):
        check_resume_changes(saved, _cfg("data.train_blend=0.4 a 0.6 b"), 5, "resume")


def _write(prefix, docs):
    with IndexedDatasetBuilder(str(prefix), vocab_size=100) as b:
        for d in docs:
            b.add_document(np.asarray(d))


def test_training_files_rewritten_under_the_same_prefix_are_refused(tmp_path):
    _write(tmp_path / "train", [[1, 2, 3, 0], [4, 5, 0]])
    saved = [dataset_identity(str(tmp_path / "train"))]
    assert check_data_files(saved, [dataset_identity(str(tmp_path / "train"))], _cfg(), "resume") == []
    _write(tmp_path / "train", [[4, 5, 0], [1, 2, 3, 0]])  # same tokens and sizes, other document order
    now = [dataset_identity(str(tmp_path / "train"))]
    assert now[0]["bin_bytes"] == saved[0]["bin_bytes"] and now[0]["idx_bytes"] == saved[0]["idx_bytes"]
    with pytest.raises(ConfigError, match=r"training files changed .*idx_sha256.*checkpoint.allow_changes=data.files"):
        check_data_files(saved, now, _cfg(), "resume")
    notes = check_data_files(saved, now, _cfg("checkpoint.allow_changes=data.files"), "resume")
    assert len(notes) == 1 and "allowed" in notes[0]
    assert check_data_files(saved, now, _cfg(), "init")  # a new trajectory: only logged
    assert check_data_files(None, now, _cfg(), "resume") == []  # a checkpoint that recorded no files


def test_negative_ids_are_refused_at_start_up_and_when_read(tmp_path):
    """An MMIDIDX file records no vocabulary: ids below 0 or >= vocab are found by the start-up scan (one error line)
    and by the per-sample check (a ConfigError, exit 2, not a traceback)."""
    from megatron_geo.config import ConfigError as CE
    from megatron_geo.data import GPTDataset, GPTDatasetConfig, IndexedDataset
    from megatron_geo.training.data_setup import _open

    with IndexedDatasetBuilder(str(tmp_path / "neg"), vocab_size=100, dtype=np.dtype("<i4")) as b:
        b.add_document(np.asarray([5, 6, 7, 0]))
        b.add_document(np.asarray([8, 0]))
    ix = IndexedDataset(str(tmp_path / "neg"))
    raw = np.memmap(str(tmp_path / "neg.bin"), dtype="<i4", mode="r+")
    raw[4] = -7  # first token of sequence 1
    raw.flush()
    del raw

    class Tok:
        vocab_size = 100

    with pytest.raises(CE, match=r"holds token id -7 \(sequence 1\), outside the 100-id vocab"):
        _open(str(tmp_path / "neg"), Tok(), "tok.model", "training")
    ds = GPTDataset(
        IndexedDataset(str(tmp_path / "neg")), GPTDatasetConfig(2, 0, vocab_size=100, sample_order="stream")
    )
    with pytest.raises(CE, match="sequence 1 holds token id -7"):
        for g in range(len(ds)):
            ds.sample(g)
    del ix


def test_the_validation_samples_do_not_depend_on_the_dp_size(tmp_path):
    """train.eval_batches global batches: the union of the DP ranks' validation samples is the same at DP 1, 2, 4
    (a resume at another DP size evaluates the same set), compared with the first samples of the order."""
    from types import SimpleNamespace

    import torch

    from megatron_geo.data import GPTDataset, GPTDatasetConfig, IndexedDataset
    from megatron_geo.training.data_setup import valid_micro_batches

    rng = np.random.default_rng(0)
    _write(tmp_path / "v", [list(rng.integers(1, 100, size=int(n))) + [0] for n in rng.integers(5, 40, size=60)])
    ds = GPTDataset(IndexedDataset(str(tmp_path / "v")), GPTDatasetConfig(8, 3, eod_id=0, sample_order="megatron"))
    cfg = _cfg("train.global_batch_size=8", "train.micro_batch_size=2", "train.eval_batches=3")
    expected = torch.stack([ds.sample(g % len(ds))["tokens"] for g in range(3 * 8)])
    for dp in (1, 2, 4):
        got = []
        for r in range(dp):
            mbs = valid_micro_batches(ds, cfg, SimpleNamespace(dp_rank=r, dp_size=dp))
            got += [mb["tokens"] for mb in mbs]
        assert torch.equal(torch.cat(got), expected), dp


def test_another_tokenizer_on_resume_is_refused(tmp_path, monkeypatch):
    """Other token ids for the same documents: the Shakespeare cache follows the tokenizer, so only the config
    keys can tell a switch of tokenizer (an older checkpoint without the key ran SentencePiece)."""
    monkeypatch.chdir(tmp_path)
    old = _saved_before_the_new_keys(_cfg())
    old["data"].pop("tokenizer_type")
    hf = ("data.tokenizer_type=huggingface", "data.tokenizer_model=hf_tok")
    saved = config_to_dict(_cfg(*hf))
    assert check_resume_changes(saved, _cfg(*hf), 10, "resume") == []
    with pytest.raises(ConfigError, match=r"data.tokenizer_type changed on resume: 'huggingface' -> 'sentencepiece'"):
        check_resume_changes(saved, _cfg("data.tokenizer_model=hf_tok"), 10, "resume")
    with pytest.raises(ConfigError, match=r"data.tokenizer_model changed on resume"):
        check_resume_changes(saved, _cfg("data.tokenizer_type=huggingface", "data.tokenizer_model=other"), 10, "resume")
    stream = _cfg("data.sample_order=stream")
    assert check_resume_changes(old, stream, 10, "resume") == []  # the key's legacy value is today's default
    with pytest.raises(ConfigError, match=r"data.tokenizer_type changed on resume: 'sentencepiece' -> 'huggingface'"):
        check_resume_changes(old, _cfg("data.sample_order=stream", *hf), 10, "resume")


def test_the_embedded_corpus_tokenized_by_a_changed_tokenizer_is_refused():
    """With data.source=shakespeare the corpus folder is named after the tokenizer's fingerprint: the same config
    keys with another folder mean the tokenizer's files changed (other ids); another cache root alone does not."""
    cfg = _cfg("data.tokenizer_type=huggingface", "data.tokenizer_model=hf_tok")

    def rec(root, name):
        return [{"prefix": f"{root}/{name}/train", "idx_bytes": 1, "bin_bytes": 2, "idx_sha256": "ab"}]

    saved = rec("/home/a/.cache/megatron_geo", "shakespeare_hf100_aaaa")
    assert check_data_files(saved, rec("/scratch/b/cache", "shakespeare_hf100_aaaa"), cfg, "resume") == []
    with pytest.raises(ConfigError, match="tokenized differently.*shakespeare_hf100_bbbb"):
        check_data_files(saved, rec("/home/a/.cache/megatron_geo", "shakespeare_hf100_bbbb"), cfg, "resume")
    notes = check_data_files(saved, rec("/x", "shakespeare_hf100_bbbb"), cfg, "init")
    assert len(notes) == 1 and "tokenized differently" in notes[0]
