"""Build the train/valid datasets from the config (preparing the embedded corpus on first use), and carry their
position across a resume.

One training source is a prefix or a weighted blend of prefixes (``data.train_blend``, Megatron-LM's
``--data-path``); ``data.split`` cuts every training prefix into train / validation / test sequence ranges (the
validation parts are blended with the same weights; the test part is held out). A component is a
:class:`~megatron_geo.data.GPTDataset` in ``data.sample_order``; several make a
:class:`~megatron_geo.data.blending.BlendedDataset` (Megatron's greedy blending index).

Index rule: a fresh run follows megatron-core 0.19 (``"megatron_core"``): its split bounds
(:func:`~megatron_geo.data.splits.split_ranges`), its two normalisations of blend weights and its 0.5% surplus plan
of each weighted blend component (:mod:`megatron_geo.data.blending`). Every checkpoint records the rule and the
training blend's position (:attr:`DataBundle.record`, ``meta.json`` ``data``); :func:`resume_data` keeps them on a
resume: a checkpoint without the record (saved by an earlier release) keeps the ``"legacy"`` rule it ran with, and a
blend whose prefixes or weights changed (``checkpoint.allow_changes=data.train_blend``) continues every component
from the samples it had given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..config import Config, ConfigError, config_to_dict
from ..data import (
    GPTDataset,
    GPTDatasetConfig,
    HFTokenizer,
    IndexedDataset,
    Tokenizer,
    dp_batch_indices,
    prepare_default_corpus,
)
from ..data.blending import BlendedDataset, greedy_counts, greedy_weights, samples_needed
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
# how sequences and samples are indexed (split bounds, blend weights, component plans): megatron-core 0.19's for a
# fresh run; "legacy" (this package's earlier rule) for runs resumed from checkpoints saved before it was recorded
INDEX_RULES = ("megatron_core", "legacy")  # the rules of data/splits.py and data/blending.py


@dataclass
class DataBundle:
    """The run's datasets: ``train`` / ``valid`` follow the ``SampleDataset`` protocol (addressed by the global
    consumed-sample counter); ``files`` / ``valid_files`` identify the training and the separate validation files
    for the checkpoints (:func:`megatron_geo.data.identity.dataset_identity`; validation split off the training
    files is identified by those); ``lines`` are the start-up facts; ``rule`` is the index rule (:data:`INDEX_RULES`);
    ``train_prefixes`` the training prefixes in component order; ``record`` what every checkpoint stores as ``data``
    (:func:`train_record`)."""

    train: SampleDataset
    valid: SampleDataset | None
    tokenizer_model: str
    files: list[dict] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    valid_files: list[dict] = field(default_factory=list)
    rule: str = "megatron_core"
    train_prefixes: list[str] = field(default_factory=list)
    record: dict = field(default_factory=dict)


def _open(prefix: str, tok: Tokenizer | HFTokenizer, tok_path: str, what: str) -> IndexedDataset:
    """The indexed dataset at ``prefix``, its ids checked against the tokenizer's vocabulary (the index records
    none: the first :data:`VOCAB_SCAN_TOKENS` tokens are scanned).

    Raises:
        ConfigError: ids outside the vocabulary in the scanned tokens.
    """
    ds = IndexedDataset(prefix)
    hf = " --tokenizer-type HuggingFaceTokenizer" if isinstance(tok, HFTokenizer) else ""
    fix = f"rebuild it with tools/preprocess_data.py{hf} --tokenizer-model {tok_path}"
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


def _combine(parts: list[SampleDataset], weights: list[float | None], names: list[str], rule: str) -> SampleDataset:
    """One dataset alone, or the blend of several (weights None: each part's sample count)."""
    if len(parts) == 1:
        return parts[0]
    w = None if any(x is None for x in weights) else weights
    return BlendedDataset(parts, w, names=names, rule=rule)


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expandvars(os.path.expanduser(str(path))))


def train_record(train: SampleDataset, rule: str, prefixes: list[str]) -> dict:
    """What a checkpoint records of the training data (``meta.json`` ``data``), JSON types only:

    ``index_rule`` (:data:`INDEX_RULES`) and ``train``: ``prefixes`` (absolute, component order), ``greedy_weights``
    (float64 values the blending index runs with; ``[1.0]`` for one dataset), ``start`` (the blended counter the
    index continues from) and ``start_counts`` (samples each component had given before it), ``planned_samples``
    (megatron-core's plan of each component, or None).
    """
    if isinstance(train, BlendedDataset):
        comps, weights = train.datasets, [float(x) for x in train.weights]
        start, counts = train.index.start, [int(c) for c in train.index.start_counts]
    else:
        comps, weights, start, counts = [train], [1.0], 0, [0]
    return {
        "index_rule": rule,
        "train": {
            "prefixes": [_abs(p) for p in prefixes],
            "greedy_weights": weights,
            "start": int(start),
            "start_counts": counts,
            "planned_samples": [getattr(c, "planned_samples", None) for c in comps],
        },
    }


def build_data(cfg: Config, pctx: ParallelContext, rule: str = "megatron_core") -> DataBundle:
    """Datasets for ``data.source``. With ``shakespeare`` rank 0 prepares (or finds cached) the corpus
    first while the others wait at a barrier; then every rank opens the memory-mapped files.

    ``rule`` (:data:`INDEX_RULES`): ``"megatron_core"`` (a fresh run) takes megatron-core 0.19's split bounds, blend
    weights and, for each component of a weighted training blend, its plan of ``samples_needed(weights, N)``
    samples for the run's ``N = train.steps * train.global_batch_size``; ``"legacy"`` this package's earlier rule
    (no plans). :func:`resume_data` applies a checkpoint's rule and position.

    Raises:
        ConfigError: missing or bad files, a tokenizer whose vocab differs from ``model.vocab_size`` or from the
            data's ids, a split part or blend component too small for one sample, or a training set smaller
            than one global batch.
        ValueError: another ``rule``.
    """
    if rule not in INDEX_RULES:
        raise ValueError(f"index rule {rule!r}: expected one of {', '.join(INDEX_RULES)}.")
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
        try:  # tok.eod_id included: a SentencePiece model without an EOS piece raises ValueError
            ds_cfg = GPTDatasetConfig(
                m.seq_length,
                s,
                eod_id=tok.eod_id,
                sample_order=d.sample_order,
                eod_mask_loss=d.eod_mask_loss,
                reset_position_ids=d.reset_position_ids,
                reset_attention_mask=d.reset_attention_mask,
                vocab_size=tok.vocab_size,
            )
            return GPTDataset(ix, ds_cfg, sequences=part)
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
        tr, va, _test = split_ranges(len(ix), split, rule)
        train_parts.append(dataset(ix, seed, tr, "train"))
        if va[1] > va[0]:  # a prefix too small to give the validation part a sequence adds none
            valid_parts.append(dataset(ix, valid_seed, va, "validation"))
            valid_weights.append(weight)
            valid_names.append(prefix)
    train_weights = [w for w, _ in train_entries]
    train = _combine(train_parts, train_weights, names, rule)
    planned = cfg.train.steps * cfg.train.global_batch_size
    if rule == "megatron_core" and isinstance(train, BlendedDataset) and all(w is not None for w in train_weights):
        for part, n in zip(train_parts, samples_needed(train_weights, planned)):
            if isinstance(part, GPTDataset):
                part.set_planned_samples(n)
    valid: SampleDataset | None = None
    if valid_parts:
        valid = _combine(valid_parts, valid_weights, valid_names, rule)
    elif valid_entries:
        parts: list[SampleDataset] = [
            dataset(_open(p, tok, tok_path, "validation"), valid_seed, None, "valid") for _, p in valid_entries
        ]
        valid = _combine(parts, [w for w, _ in valid_entries], [p for _, p in valid_entries], rule)
    if cfg.train.global_batch_size > len(train):
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is larger than the whole training "
            f"set ({len(train):,} samples of model.seq_length={m.seq_length} tokens in "
            f"{', '.join(names)}); lower train.global_batch_size or use more data"
        )
    lines = [f"train: {x}" for x in _describe(train, planned)]
    if valid is not None:
        lines += [f"valid: {x}" for x in _describe(valid, None)]
    if _rule_matters(cfg):
        lines.append(
            "split bounds and blend weights follow megatron-core 0.19"
            if rule == "megatron_core"
            else "split bounds and blend weights follow this package's legacy rule (a run resumed from before it was "
            "recorded)"
        )
    files = [dataset_identity(p) for p in names]
    valid_files = [dataset_identity(p) for _, p in valid_entries] if valid is not None and not valid_parts else []
    return DataBundle(
        train,
        valid,
        tok_path,
        files,
        lines,
        valid_files,
        rule=rule,
        train_prefixes=list(names),
        record=train_record(train, rule, names),
    )


def _rule_matters(cfg: Config) -> bool:
    """Whether the index rules can differ for this config: a split or a blend (else both build the same data)."""
    d = cfg.data
    return bool(d.split.strip() or d.train_blend.strip() or d.valid_blend.strip())


def _source_key(config: dict) -> tuple:
    """The training source of a config mapping, compared by meaning (weights as numbers, prefixes absolute)."""
    d = config.get("data", {})
    blend = str(d.get("train_blend") or "")
    tokens = tuple(str(float(t)) if _number(t) else _abs(t) for t in blend.split())
    prefix = str(d.get("train_prefix") or "")
    return (d.get("source"), tokens, _abs(prefix) if prefix and not tokens else "")


def _number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _saved_train(meta: dict, rule: str, bundle: DataBundle) -> dict | None:
    """The training position a checkpoint ran with (:func:`train_record`'s ``train``): recorded, or derived from
    its config for a checkpoint without the record (index 0, its rule's weights); None when it cannot be told (an
    unweighted blend of prefixes that are no longer read)."""
    rec = meta.get("data")
    if isinstance(rec, dict) and isinstance(rec.get("train"), dict):
        return rec["train"]
    d = meta["config"].get("data", {})
    blend = str(d.get("train_blend") or "").split()
    if not blend:
        prefix = d.get("train_prefix") if d.get("source") != "shakespeare" else None
        prefixes = [_abs(prefix) if prefix else (bundle.train_prefixes[0] if len(bundle.train_prefixes) == 1 else "")]
        return {"prefixes": prefixes, "greedy_weights": [1.0], "start": 0, "start_counts": [0]}
    if _number(blend[0]):
        prefixes = [_abs(p) for p in blend[1::2]]
        weights = [float(greedy_weights([float(w) for w in blend[0::2]], rule)[k]) for k in range(len(prefixes))]
    else:  # prefixes alone: their lengths, known from the components read now
        prefixes = [_abs(p) for p in blend]
        comps = bundle.train.datasets if isinstance(bundle.train, BlendedDataset) else [bundle.train]
        lengths = dict(zip([_abs(p) for p in bundle.train_prefixes], (len(c) for c in comps)))
        if not all(p in lengths for p in prefixes):
            return None
        total = np.asarray([lengths[p] for p in prefixes], dtype=np.float64)
        weights = (total / np.sum(total)).tolist()
    return {"prefixes": prefixes, "greedy_weights": weights, "start": 0, "start_counts": [0] * len(prefixes)}


def _file_key(identity) -> tuple | None:
    """The files of a :func:`~megatron_geo.data.identity.dataset_identity` record, wherever they are (None: not
    recorded)."""
    if not isinstance(identity, dict) or "idx_sha256" not in identity:
        return None
    return ("files", identity.get("idx_sha256"), identity.get("idx_bytes"), identity.get("bin_bytes"))


def _bad_record(meta: dict, what: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {meta.get('path', '?')}: meta.json data record {what}; the folder is damaged: load an older "
        f"checkpoint (checkpoint.load=PATH) or start fresh (checkpoint.load=none)"
    )


def resume_data(
    bundle: DataBundle, cfg: Config, pctx: ParallelContext, meta: dict | None, consumed: int
) -> tuple[DataBundle, list[str]]:
    """Give the datasets built for a fresh run the rule and position of the checkpoint ``meta`` resumes at
    ``consumed`` samples (None: a fresh start, ``bundle`` as it is). Collective only where :func:`build_data` is.

    - Rule: the checkpoint's ``data.index_rule``; a checkpoint without the record ran this package's legacy rule,
      so a run with a split or blend is rebuilt with it (:func:`build_data`) and continues on the same samples (a
      checkpoint without the record at 0 consumed samples leaves ``bundle`` as it is).
    - Unchanged training source (``data.source``, ``data.train_prefix``, ``data.train_blend``): the recorded
      position (a blend continued after an earlier change) and component plans (a plan made for the run's first
      ``train.steps``, kept when they change).
    - Changed source (``checkpoint.allow_changes=data.train_blend`` or ``data.train_prefix``): the samples each
      old component had given at ``consumed`` (recomputed from the checkpoint's weights and position) become the
      start of the new blend's components of the same prefix (others start at 0); from ``consumed`` on the new
      weights' greedy rule runs afresh: no sample of a continuing component is skipped or replayed.

    Returns:
        The bundle (with ``record`` for the next checkpoints) and start-up lines (per component on a change).

    Raises:
        ConfigError: a malformed ``data`` record in the checkpoint (names the fix).
    """
    if meta is None:
        return bundle, []
    rec = meta.get("data")
    if rec is not None and not isinstance(rec, dict):
        raise _bad_record(meta, "is not a mapping")
    rule = rec.get("index_rule") if rec else "legacy"
    if rule not in INDEX_RULES:
        raise _bad_record(meta, f"has index_rule={rule!r}, not one of {', '.join(INDEX_RULES)}")
    if consumed == 0 and rec is None:
        return bundle, []  # nothing was consumed under the checkpoint's rule: this launch's rule and position
    notes: list[str] = []
    if rule != bundle.rule:
        if _rule_matters(cfg):
            bundle = build_data(cfg, pctx, rule)
            why = "records no data index rule (an earlier release)" if rec is None else "ran the legacy index rule"
            notes.append(
                f"checkpoint {meta.get('path', '')} {why}: this run keeps the legacy split bounds and blend weights "
                f"it ran with, so it continues on the same samples (a new run follows megatron-core 0.19's); the "
                f"datasets rebuilt:"
            )
            notes += bundle.lines
        else:
            bundle.rule = rule
    saved = _saved_train(meta, rule, bundle)
    train = bundle.train
    comps = train.datasets if isinstance(train, BlendedDataset) else [train]
    now = [_abs(p) for p in bundle.train_prefixes]
    try:
        same = _source_key(meta["config"]) == _source_key(config_to_dict(cfg))
        if saved is not None:
            old_prefixes = [str(p) for p in saved["prefixes"]]
            old_weights = [float(w) for w in saved["greedy_weights"]]
            start, start_counts = int(saved["start"]), [int(c) for c in saved["start_counts"]]
            plans = list(saved.get("planned_samples") or [None] * len(old_prefixes))
            if not (len(old_prefixes) == len(old_weights) == len(start_counts) == len(plans)) or start > consumed:
                raise ValueError("inconsistent lengths or start")
    except (KeyError, TypeError, ValueError):
        raise _bad_record(meta, "is malformed") from None
    if same and saved is not None and len(old_prefixes) == len(comps):
        for comp, plan in zip(comps, plans):
            if hasattr(comp, "set_planned_samples") and plan != getattr(comp, "planned_samples", None):
                comp.set_planned_samples(plan)  # the plan the run started with
        if isinstance(train, BlendedDataset) and (start or any(start_counts)):
            train.continue_from(start, start_counts)
        elif not isinstance(train, BlendedDataset) and start_counts != [start]:  # (start 0: the plain order)
            train = BlendedDataset([train], [1.0], names=bundle.train_prefixes, rule=bundle.rule)
            train.continue_from(start, start_counts)
    elif not same:
        if saved is None:
            notes.append(
                f"the training source changed at {consumed:,} consumed samples; the old blend's position per "
                f"component cannot be told (prefixes alone, no longer read), so every component starts at its "
                f"first sample"
            )
            starts = [0] * len(comps)
            parts = [f"{p} starts at its first sample" for p in now]
        else:
            local = greedy_counts(old_weights, consumed - start)
            old_files = meta.get("data_files")
            if not (isinstance(old_files, list) and len(old_files) == len(old_prefixes)):
                old_files = [{} for _ in old_prefixes]
            # a component of the same files (moved to another path), else of the same prefix, goes on from the
            # samples it had given; a prefix listed twice read the same samples: the further count
            had: dict[tuple, int] = {}
            old_plans: dict[tuple, int | None] = {}
            for p, f, c0, c, plan in zip(old_prefixes, old_files, start_counts, local, plans):
                for key in (_file_key(f), ("prefix", p)):
                    if key is not None:
                        had[key] = max(had.get(key, 0), c0 + c)
                        old_plans.setdefault(key, plan)
            new_files = bundle.files if len(bundle.files) == len(now) else [{} for _ in now]
            keys = [next((k for k in (_file_key(f), ("prefix", p)) if k in had), None) for p, f in zip(now, new_files)]
            if len(keys) == len(old_prefixes) == 1 and keys[0] is None:  # one prefix for another: moved files
                keys[0] = ("prefix", old_prefixes[0])
            starts = [had.get(k, 0) if k is not None else 0 for k in keys]
            for comp, k in zip(comps, keys):
                if k is not None and hasattr(comp, "set_planned_samples"):
                    comp.set_planned_samples(old_plans[k])  # the plan the component started with
            used = {k for k in keys if k is not None}
            parts = [
                f"{p} continues at its sample {c:,}" if k is not None else f"{p} is new, from its first sample"
                for p, c, k in zip(now, starts, keys)
            ]
            parts += [
                f"{p} is dropped after {c0 + c:,} samples"
                for p, f, c0, c in zip(old_prefixes, old_files, start_counts, local)
                if _file_key(f) not in used and ("prefix", p) not in used
            ]
        if isinstance(train, BlendedDataset):
            train.continue_from(consumed, starts)
            parts = [f"{x} (weight {w:.6g})" for x, w in zip(parts[: len(comps)], train.weights)] + parts[len(comps) :]
        elif starts != [consumed]:  # one dataset at another position than the counter
            train = BlendedDataset([train], [1.0], names=bundle.train_prefixes, rule=bundle.rule)
            train.continue_from(consumed, starts)
        notes.append(
            f"the training source changed at {consumed:,} consumed samples: no sample of a continuing component is "
            f"skipped or replayed; each goes on from the samples it had given, with the new weights from here: "
            + "; ".join(parts)
        )
    bundle.train = train
    bundle.record = train_record(train, bundle.rule, bundle.train_prefixes)
    return bundle, notes


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
