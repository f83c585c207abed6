"""Build the train/valid datasets from the config (preparing the embedded corpus on first use)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config, ConfigError
from ..data import GPTDataset, IndexedDataset, Tokenizer, collate, dp_batch_indices, prepare_default_corpus
from ..parallel import ParallelContext
from ..parallel import collectives as C


@dataclass
class DataBundle:
    train: GPTDataset
    valid: GPTDataset | None
    tokenizer_model: str


def build_data(cfg: Config, pctx: ParallelContext) -> DataBundle:
    """Datasets for ``data.source``. With ``shakespeare`` rank 0 prepares (or finds cached) the corpus
    first while the others wait at a barrier; then every rank opens the memory-mapped files.

    Raises:
        ConfigError: missing files, or a tokenizer whose vocab differs from ``model.vocab_size``.
    """
    d, m = cfg.data, cfg.model
    if d.source == "shakespeare":
        cache = d.cache_dir  # expanded when the config was loaded
        if pctx.rank == 0:
            prepare_default_corpus(cache, m.vocab_size)
        C.barrier(pctx.world_group)
        paths = prepare_default_corpus(cache, m.vocab_size)
        tok_path, train_prefix, valid_prefix = paths.tokenizer_model, paths.train_prefix, paths.valid_prefix
    else:
        tok_path, train_prefix, valid_prefix = d.tokenizer_model, d.train_prefix, d.valid_prefix
    tok = Tokenizer(tok_path)
    if tok.vocab_size != m.vocab_size:
        raise ConfigError(
            f"tokenizer {tok_path} has vocab {tok.vocab_size} but model.vocab_size={m.vocab_size}; "
            f"set model.vocab_size={tok.vocab_size} or use a matching tokenizer"
        )
    seed = cfg.train.seed
    prefixes = {"train": train_prefix, "valid": valid_prefix}
    sets = {"train": IndexedDataset(train_prefix)}
    if valid_prefix:
        sets["valid"] = IndexedDataset(valid_prefix)
    for split, ds in sets.items():
        if ds.vocab_size != tok.vocab_size:
            raise ConfigError(
                f"the {split} dataset {prefixes[split]} was tokenized with a "
                f"{ds.vocab_size}-token vocab but the tokenizer {tok_path} has {tok.vocab_size}; rebuild it "
                f"with tools/preprocess_data.py --tokenizer-model {tok_path}"
            )
    try:
        train = GPTDataset(sets["train"], m.seq_length, seed, eod_id=tok.eod_id)
        valid = GPTDataset(sets["valid"], m.seq_length, seed + 1, eod_id=tok.eod_id) if valid_prefix else None
    except ValueError as e:  # documents without the tokenizer's end-of-document token, a bad seed
        raise ConfigError(f"data: {e}") from None
    if cfg.train.global_batch_size > len(train):
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is larger than the whole training "
            f"set ({len(train):,} samples of model.seq_length={m.seq_length} tokens in {train_prefix}); "
            f"lower train.global_batch_size or use more data"
        )
    return DataBundle(train, valid, tok_path)


def train_micro_batches(ds: GPTDataset, consumed: int, cfg: Config, pctx: ParallelContext) -> list[dict]:
    """This DP rank's micro-batches of the step that starts at global sample ``consumed``."""
    t = cfg.train
    ids = dp_batch_indices(consumed, t.global_batch_size, t.micro_batch_size, pctx.dp_rank, pctx.dp_size)
    return [collate([ds[ds.sample_index(i)] for i in mb]) for mb in ids]


def train_global_tokens(ds: GPTDataset, consumed: int, cfg: Config) -> int:
    """Valid (loss-bearing) tokens of the whole global batch that starts at global sample ``consumed``, from
    the sampler on the host: the same number on every rank, with no collective (the train step's loss
    normalisation needs it before the forward, when a DP all-reduce would queue behind the parameter
    all-gathers still in flight)."""
    t = cfg.train
    return ds.valid_tokens(range(consumed, consumed + t.global_batch_size))


def valid_micro_batches(ds: GPTDataset, cfg: Config, pctx: ParallelContext) -> list[dict]:
    """``train.eval_batches`` micro-batches per DP rank: the same fixed validation samples at every eval."""
    t = cfg.train
    n = t.eval_batches * t.micro_batch_size * pctx.dp_size
    ids = dp_batch_indices(0, n, t.micro_batch_size, pctx.dp_rank, pctx.dp_size)
    return [collate([ds[ds.sample_index(i % len(ds))] for i in mb]) for mb in ids]
