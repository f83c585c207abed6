"""Build the train/valid datasets from the config (preparing the embedded corpus on first use).

One training source is a prefix or a weighted blend of prefixes (``data.train_blend``, Megatron-LM's
``--data-path``); ``data.split`` cuts every training prefix into train / validation / test sequence ranges (the
validation parts are blended with the same weights; the test part is held out). A component is a
:class:`~megatron_geo.data.GPTDataset` in ``data.sample_order``; several make a
:class:`~megatron_geo.data.blending.BlendedDataset` (Megatron's greedy blending index).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..config import Config, ConfigError
from ..data import GPTDataset, HFTokenizer, IndexedDataset, Tokenizer, dp_batch_indices, prepare_default_corpus
from ..data.blending import BlendedDataset
from ..data.gpt_dataset import SampleDataset
from ..data.hf_tokenizer import load_tokenizer
from ..data.identity import dataset_identity
from ..data.splits import split_ranges
from ..parallel import ParallelContext
from ..parallel import collectives as C
from .data_config import split_weights, train_sources, valid_sources

# tokens of each MMIDIDX file scanned at start-up for ids outside the tokenizer's vocabulary (the index records no
# vocabulary); every sample is checked again when it is read
VOCAB_SCAN_TOKENS = 1 << 24


@dataclass
class DataBundle:
    """The run's datasets: ``train`` / ``valid`` follow the ``SampleDataset`` protocol (addressed by the global
    consumed-sample counter); ``files`` identifies the training files for the checkpoints
    (:func:`megatron_geo.data.identity.dataset_identity`); ``lines`` are the start-up facts."""

    train: SampleDataset
    valid: SampleDataset | None
    tokenizer_model: str
    files: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def _open(prefix: str, tok: Tokenizer | HFTokenizer, tok_path: str, what: str) -> IndexedDataset:
    """The indexed dataset at ``prefix``, its ids checked against the tokenizer's vocabulary.

    Raises:
        ConfigError: an MGEOIDX index made with another vocabulary, or ids outside it in the scanned tokens.
    """
    ds = IndexedDataset(prefix)
    hf = " --tokenizer-type HuggingFaceTokenizer" if isinstance(tok, HFTokenizer) else ""
    fix = f"rebuild it with tools/preprocess_data.py{hf} --tokenizer-model {tok_path}"
    if ds.vocab_size is not None and ds.vocab_size != tok.vocab_size:
        raise ConfigError(
            f"the {what} dataset {prefix} was tokenized with a {ds.vocab_size}-token vocab but the tokenizer "
            f"{tok_path} has {tok.vocab_size}; {fix}"
        )
    if ds.vocab_size is None:
        head = np.asarray(ds.tokens[: min(VOCAB_SCAN_TOKENS, ds.num_tokens)])
        if head.size:
            bad = np.flatnonzero((head < 0) | (head >= tok.vocab_size))
            if bad.size:
                pos = int(bad[0])
                seq = int(np.searchsorted(ds.offsets, pos, side="right")) - 1
                raise ConfigError(
                    f"the {what} dataset {prefix} holds token id {head[pos]} (sequence {seq}), outside the "
                    f"{tok.vocab_size}-id vocab of the tokenizer {tok_path}; {fix}"
                )
    return ds


def _combine(parts: list[SampleDataset], weights: list[float | None], names: list[str]) -> SampleDataset:
    """One dataset alone, or the blend of several (weights None: each part's sample count)."""
    if len(parts) == 1:
        return parts[0]
    w = None if any(x is None for x in weights) else weights
    return BlendedDataset(parts, w, names=names)


def build_data(cfg: Config, pctx: ParallelContext) -> DataBundle:
    """Datasets for ``data.source``. With ``shakespeare`` rank 0 prepares (or finds cached) the corpus
    first while the others wait at a barrier; then every rank opens the memory-mapped files.

    Raises:
        ConfigError: missing or bad files, a tokenizer whose vocab differs from ``model.vocab_size`` or from the
            data's ids, a split part or blend component too small for one sample, or a training set smaller
            than one global batch.
    """
    d, m = cfg.data, cfg.model
    split = split_weights(d.split)

    def check_vocab(tok: Tokenizer | HFTokenizer, tok_path: str) -> None:
        if tok.vocab_size != m.vocab_size:
            size = "len(tokenizer) " if isinstance(tok, HFTokenizer) else ""
            raise ConfigError(
                f"tokenizer {tok_path} has vocab {size}{tok.vocab_size} but model.vocab_size={m.vocab_size}; "
                f"set model.vocab_size={tok.vocab_size} or use a matching tokenizer"
            )

    hf = None
    if d.tokenizer_type == "huggingface":  # checked before the embedded corpus is tokenized with it
        hf = HFTokenizer(d.tokenizer_model, "data.tokenizer_model")
        check_vocab(hf, d.tokenizer_model)
        _ = hf.eod_id  # a tokenizer without an EOS token: one error line naming the folder
    if d.source == "shakespeare":
        cache = d.cache_dir  # expanded when the config was loaded
        if pctx.rank == 0:
            prepare_default_corpus(cache, m.vocab_size, tokenizer=hf)
        C.barrier(pctx.world_group)
        paths = prepare_default_corpus(cache, m.vocab_size, tokenizer=hf)
        tok_path = paths.tokenizer_model
        train_entries: list[tuple[float | None, str]] = [(None, paths.train_prefix)]
        valid_entries: list[tuple[float | None, str]] = [(None, paths.valid_prefix)]
    else:
        tok_path = d.tokenizer_model
        train_entries, valid_entries = train_sources(d)[1], valid_sources(d)[1]
    tok = hf if hf is not None else load_tokenizer(d.tokenizer_type, tok_path, "data.tokenizer_model")
    check_vocab(tok, tok_path)
    seed = cfg.train.seed
    # the stream order keeps its earlier validation seed (seed + 1); Megatron's order uses one seed for every split
    valid_seed = seed + 1 if d.sample_order == "stream" else seed

    def dataset(ix: IndexedDataset, s: int, part: tuple[int, int] | None, what: str) -> GPTDataset:
        try:
            return GPTDataset(
                ix,
                m.seq_length,
                s,
                eod_id=tok.eod_id,
                sample_order=d.sample_order,
                sequences=part,
                eod_mask_loss=d.eod_mask_loss,
                reset_position_ids=d.reset_position_ids,
                reset_attention_mask=d.reset_attention_mask,
                vocab_size=tok.vocab_size,
            )
        except ValueError as e:  # too few tokens, no end-of-document token with an option that needs it
            where = f" (data.split={d.split!r}, {what} part)" if part is not None else ""
            raise ConfigError(f"data: {e}{where}") from None

    train_parts: list[SampleDataset] = []
    valid_parts: list[SampleDataset] = []
    valid_weights: list[float | None] = []
    valid_names: list[str] = []
    names = [prefix for _, prefix in train_entries]
    for weight, prefix in train_entries:
        ix = _open(prefix, tok, tok_path, "training")
        if split is None:
            train_parts.append(dataset(ix, seed, None, "train"))
            continue
        tr, va, _test = split_ranges(len(ix), split)
        train_parts.append(dataset(ix, seed, tr, "train"))
        if va[1] > va[0]:  # a prefix too small to give the validation part a sequence adds none
            valid_parts.append(dataset(ix, valid_seed, va, "validation"))
            valid_weights.append(weight)
            valid_names.append(prefix)
    train = _combine(train_parts, [w for w, _ in train_entries], names)
    valid: SampleDataset | None = None
    if valid_parts:
        valid = _combine(valid_parts, valid_weights, valid_names)
    elif valid_entries:
        parts: list[SampleDataset] = [
            dataset(_open(p, tok, tok_path, "validation"), valid_seed, None, "valid") for _, p in valid_entries
        ]
        valid = _combine(parts, [w for w, _ in valid_entries], [p for _, p in valid_entries])
    if cfg.train.global_batch_size > len(train):
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is larger than the whole training "
            f"set ({len(train):,} samples of model.seq_length={m.seq_length} tokens in "
            f"{', '.join(names)}); lower train.global_batch_size or use more data"
        )
    lines = [f"train: {x}" for x in _describe(train, cfg.train.steps * cfg.train.global_batch_size)]
    if valid is not None:
        lines += [f"valid: {x}" for x in _describe(valid, None)]
    files = [dataset_identity(p) for p in names]
    return DataBundle(train, valid, tok_path, files, lines)


def _describe(ds: SampleDataset, consumed: int | None) -> list[str]:
    if isinstance(ds, BlendedDataset):
        return ds.describe(consumed)
    return ds.describe()


def train_micro_batches(ds: SampleDataset, consumed: int, cfg: Config, pctx: ParallelContext) -> list[dict]:
    """This DP rank's micro-batches of the step that starts at global sample ``consumed``."""
    t = cfg.train
    ids = dp_batch_indices(consumed, t.global_batch_size, t.micro_batch_size, pctx.dp_rank, pctx.dp_size)
    return [ds.micro_batch(mb) for mb in ids]


def train_global_tokens(ds: SampleDataset, consumed: int, cfg: Config) -> int:
    """Valid (loss-bearing) tokens of the whole global batch that starts at global sample ``consumed``, from
    the sampler on the host: the same number on every rank, with no collective (the train step's loss
    normalisation needs it before the forward, when a DP all-reduce would queue behind the parameter
    all-gathers still in flight). With ``data.eod_mask_loss`` this reads the global batch's tokens."""
    t = cfg.train
    return ds.valid_tokens(range(consumed, consumed + t.global_batch_size))


def valid_micro_batches(ds: SampleDataset, cfg: Config, pctx: ParallelContext) -> list[dict]:
    """This DP rank's micro-batches of the validation set: ``train.eval_batches`` global batches of
    ``train.global_batch_size`` samples (Megatron's ``--eval-iters``), the first samples of the validation order,
    the same at every evaluation and at every DP size (a resume at another DP size evaluates the same samples)."""
    t = cfg.train
    n = t.eval_batches * t.global_batch_size
    ids = dp_batch_indices(0, n, t.micro_batch_size, pctx.dp_rank, pctx.dp_size)
    return [ds.micro_batch([i % len(ds) for i in mb]) for mb in ids]
