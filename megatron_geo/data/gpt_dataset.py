"""Fixed-length GPT training samples over an `IndexedDataset`, deterministic shuffling, and data-parallel batch
assignment by consumed-sample counter.

Every sample is ``S + 1`` tokens (``S = seq_length``) of a token stream; its inputs are the first ``S`` tokens,
its labels the last ``S``, so consecutive samples of a stream share one token. Two orders (``sample_order``):

``megatron`` (the semantics of Megatron-Core's ``GPTDataset``, ``megatron/core/datasets/gpt_dataset.py`` and the
sample index of ``helpers.cpp``): the unit of shuffling is the *sequence* of the indexed dataset (one per
document unless the data was sentence-split). Per epoch:

1. document index: the dataset's sequence ids (int32), shuffled in place with ``numpy.random.RandomState``;
2. sample index: sample ``i`` is tokens ``[i*S, i*S + S + 1)`` of the sequences concatenated in that order;
   an epoch of ``T`` tokens has ``(T - 1) // S`` samples (the leftover tokens are dropped);
3. shuffle index: ``arange(num_samples)`` (uint32; int64 from ``2**32 - 2`` samples on, as Megatron) shuffled
   with the same ``RandomState`` right after the document shuffle; sample ``g`` of the epoch is sample
   ``shuffle[g]``.

Difference from Megatron: Megatron sizes the whole run up front, repeats the document index over all the epochs
it needs and shuffles it once (and separates a short final epoch). Runs here are open-ended (a resume may extend
``train.steps``; the position is a consumed-sample counter), so every epoch is built on its own: epoch 0 uses
``RandomState(seed)`` (for ``seed < 2**32``; exactly Megatron's order for a run shorter than one epoch), epoch
``e >= 1`` (and epoch 0 of a seed ``>= 2**32``) uses ``RandomState([seed % 2**32, seed // 2**32, e])``, each
with its own document shuffle, sample index and sample shuffle; no sample crosses an epoch boundary.

Megatron's plan (``planned_samples``, the ``num_samples`` megatron-core builds for the dataset; :func:`megatron_plan`)
also shapes its first epoch. A blend component is planned with a 0.5% surplus, so one used at 99.5-100% of its
epoch is planned two epochs, the second one short and separate; megatron-core then shuffles the documents of both
epochs before it shuffles the samples of the first. With such a plan (two epochs, separate final epoch) epoch 0 here
does the same: a second document shuffle of the same length, then the sample shuffle, so that every sample of
epoch 0 is megatron-core's. Other plans leave epoch 0 as above.

``stream`` (this package's earlier order, bitwise unchanged): sample ``i`` is ``stream[i*S : i*S + S + 1]`` of
the sequences concatenated in file order, and epoch ``e`` visits the samples in the order
``numpy.random.default_rng(seed + e).permutation(num_samples)``.

Options (Megatron's ``_get_ltor_masks_and_position_ids``, needing the end-of-document id ``eod_id``):
``eod_mask_loss`` zeroes ``loss_mask`` where the input token is eod; ``reset_position_ids`` restarts
``position_ids`` at 0 after each eod (the eod keeps its position); ``reset_attention_mask`` adds
``segment_ids`` (eod tokens strictly before each position): a position attends causally only to positions of
equal segment id, i.e. nothing after an eod sees anything up to and including it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import torch

from ..config.checks import choices_of
from ..config.schema import DataConfig
from .indexed_dataset import IndexedDataset

SAMPLE_ORDERS = choices_of(DataConfig, "sample_order")  # data.sample_order, as the schema lists them
# megatron-core's GPTDataset keeps a final epoch out of the joint shuffle when it is below this fraction of an epoch
SEPARATE_FINAL_EPOCH_BELOW = 0.80
MAX_SEED = 2**63  # seeds are ints in [0, MAX_SEED)
EOD_CHECK_DOCUMENTS = 100_000  # documents whose last token the eod check reads, evenly spaced


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}.")
    return int(value)


@runtime_checkable
class SampleDataset(Protocol):
    """What the trainer reads from a dataset (a `GPTDataset` or a ``blending.BlendedDataset``).

    ``sample(g)`` takes the global consumed-sample counter ``g >= 0`` (it wraps into later epochs) and returns
    ``tokens``/``labels`` int64 [S], ``loss_mask`` float32 [S], plus ``position_ids`` int64 [S] when
    ``"position_ids" in sample_keys`` and ``segment_ids`` int64 [S] when ``"segment_ids" in sample_keys``.
    """

    seq_length: int
    sample_keys: tuple[str, ...]

    def __len__(self) -> int: ...
    def sample(self, g: int) -> dict[str, torch.Tensor]: ...
    def micro_batch(self, gs: list[int]) -> dict[str, torch.Tensor]: ...
    def valid_tokens(self, gs) -> int: ...
    def describe(self) -> list[str]: ...


def epoch_random_state(seed: int, epoch: int) -> np.random.RandomState:
    """The ``RandomState`` of one epoch of the megatron order (module docstring): ``RandomState(seed)`` for
    epoch 0 of a seed below ``2**32`` (Megatron-Core's), else ``RandomState([seed % 2**32, seed // 2**32, epoch])``.

    Raises:
        ValueError: ``seed`` outside ``[0, 2**63)`` or ``epoch < 0``.
    """
    seed = _check_int("seed", seed, 0)
    epoch = _check_int("epoch", epoch, 0)
    if seed >= MAX_SEED:
        raise ValueError(f"seed={seed} must be < 2**63.")
    if epoch == 0 and seed < 2**32:
        return np.random.RandomState(seed)
    return np.random.RandomState([seed % 2**32, seed // 2**32, epoch])


class MegatronPlan(NamedTuple):
    """How megatron-core lays out a dataset planned at ``num_samples``: ``num_epochs`` epochs of its sequences, and
    whether the final one is shuffled on its own (``separate_final_epoch``)."""

    num_epochs: int
    separate_final_epoch: bool


def megatron_plan(num_tokens: int, seq_length: int, planned_samples: int | None) -> MegatronPlan:
    """Megatron-core's epoch plan for ``planned_samples`` samples of ``seq_length`` tokens (+1) from ``num_tokens``
    tokens per epoch: the fewest epochs whose tokens reach ``planned_samples * seq_length + 1``, and a separate final
    epoch when the samples it must give are fewer than ``int(0.8 * samples_per_epoch)``.

    Rule: megatron-core 0.19 ``gpt_dataset.py``, ``GPTDataset._get_num_epochs`` and
    ``_build_document_sample_shuffle_indices`` (its ``separate_final_epoch``). ``None`` (no plan: megatron-core's
    one-epoch build of an unweighted blend component) is one epoch.

    Raises:
        ValueError: ``num_tokens < seq_length + 1``, ``seq_length < 1`` or ``planned_samples < 0``.
    """
    seq_length = _check_int("seq_length", seq_length, 1)
    num_tokens = _check_int("num_tokens", num_tokens, seq_length + 1)
    if planned_samples is None:
        return MegatronPlan(1, False)
    planned = _check_int("planned_samples", planned_samples, 0)
    need = planned * seq_length + 1
    epochs = max(1, -(-need // num_tokens))
    if epochs == 1:
        return MegatronPlan(1, False)
    before_final = ((epochs - 1) * num_tokens - 1) // seq_length
    per_epoch = (num_tokens - 1) // seq_length
    return MegatronPlan(epochs, planned - before_final < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch))


class EpochIndex(NamedTuple):
    """The index arrays of one epoch of the megatron order.

    ``document_index``: int32 (int64 past 2**31 - 1 sequences) [num_sequences], sequence ids in the epoch's
    order. ``ends``: int64 [num_sequences], tokens of the epoch's stream up to and including each position of
    ``document_index`` (its cumulative sum of lengths). ``shuffle_index``: uint32 or int64 [num_samples].
    """

    document_index: np.ndarray
    ends: np.ndarray
    shuffle_index: np.ndarray


def build_epoch_index(
    sizes: np.ndarray,
    start: int,
    stop: int,
    seq_length: int,
    seed: int,
    epoch: int,
    second_document_shuffle: bool = False,
) -> EpochIndex:
    """Document index, cumulative stream ends and shuffle index of one megatron-order epoch over sequences
    ``[start, stop)`` of a dataset whose sequence lengths are ``sizes`` (int [num_sequences]); vectorised (no
    loop over sequences or samples). Samples: ``(sum(sizes[start:stop]) - 1) // seq_length``.

    Rule: Megatron-Core ``gpt_dataset.py`` (``_build_document_index``, ``_build_shuffle_index``) and
    ``helpers.cpp`` (``build_sample_idx``), one epoch at a time (module docstring). ``second_document_shuffle``:
    the generator shuffles a second document index of the same length before the samples, as megatron-core does
    for a plan of two epochs with a separate final epoch (the first epoch of that plan).

    Raises:
        ValueError: an empty or too short range (fewer than ``seq_length + 1`` tokens), a bad seed or epoch.
    """
    rs = epoch_random_state(seed, epoch)
    id_dtype = np.int32 if stop <= np.iinfo(np.int32).max else np.int64
    document_index = np.arange(start, stop, dtype=id_dtype)
    rs.shuffle(document_index)
    ends = np.cumsum(np.asarray(sizes[document_index], dtype=np.int64), dtype=np.int64)
    if second_document_shuffle:  # only the generator's state matters: its draws depend on the length alone
        rs.shuffle(np.zeros(stop - start, dtype=np.uint8))
    total = int(ends[-1]) if ends.size else 0
    if total < seq_length + 1:
        raise ValueError(f"sequences [{start}, {stop}) hold {total} tokens, fewer than seq_length + 1.")
    num_samples = (total - 1) // seq_length
    dtype = np.int64 if num_samples >= np.iinfo(np.uint32).max - 1 else np.uint32
    shuffle_index = np.arange(num_samples, dtype=dtype)
    rs.shuffle(shuffle_index)
    return EpochIndex(document_index, ends, shuffle_index)


@dataclass(frozen=True)
class GPTDatasetConfig:
    """How a :class:`GPTDataset` cuts, orders and masks its samples (the role of Megatron-Core's
    ``GPTDatasetConfig``): what the datasets of one run share. Which sequences a dataset covers and megatron-core's
    plan for it are arguments of the dataset itself. The values are checked by :class:`GPTDataset` (ValueError).

    Attributes:
        seq_length: tokens per sample (model context length), >= 1.
        seed: base seed, an int in ``[0, 2**63)``.
        eod_id: the end-of-document id: checked to be < the vocabulary; the last tokens of up to 100,000 evenly
            spaced documents (``indexed.document_indices`` when present, else one per sequence) are compared
            with it and the count that does not end with it is a note of `describe`.
        sample_order: ``"megatron"`` or ``"stream"``.
        eod_mask_loss, reset_position_ids, reset_attention_mask: the options of the module docstring (need
            ``eod_id``).
        vocab_size: if given, a sample holding an id ``>= vocab_size`` raises ValueError when read (None: no
            check; the index records no vocabulary).
    """

    seq_length: int
    seed: int
    eod_id: int | None = None
    sample_order: str = "megatron"
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    vocab_size: int | None = None


class GPTDataset(torch.utils.data.Dataset):
    """Samples of ``seq_length + 1`` tokens of an indexed dataset, in the megatron or stream order (module
    docstring), addressed by the global consumed-sample counter (`SampleDataset` protocol).

    Args:
        indexed: the tokenized corpus.
        config: sample length, seed, order, end-of-document options and vocabulary (:class:`GPTDatasetConfig`);
            kept as ``config``.
        sequences: ``(start, stop)``: only sequences ``start .. stop - 1`` (a split); None: all.
        planned_samples: megatron-core's ``num_samples`` for this dataset (a blend component's
            :func:`~megatron_geo.data.blending.samples_needed`), or None; only the megatron order uses it (module
            docstring, :meth:`set_planned_samples`).

    Raises:
        ValueError: bad arguments, fewer than ``seq_length + 1`` tokens in the sequences, ``eod_id`` outside the
            vocabulary, an option without ``eod_id``, or an option on while no checked document ends with eod.
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        config: GPTDatasetConfig,
        *,
        sequences: tuple[int, int] | None = None,
        planned_samples: int | None = None,
    ):
        self.config = config
        self.indexed = indexed
        self.prefix = str(getattr(indexed, "prefix", "?"))
        self.seq_length = _check_int("seq_length", config.seq_length, 1)
        self.seed = _check_int("seed", config.seed, 0)
        if self.seed >= MAX_SEED:
            raise ValueError(f"seed={config.seed} must be < 2**63 (train.seed).")
        if config.sample_order not in SAMPLE_ORDERS:
            raise ValueError(f"sample_order={config.sample_order!r}: expected one of {', '.join(SAMPLE_ORDERS)}.")
        self.sample_order = config.sample_order
        n_seq = len(indexed)
        if sequences is None:
            start, stop = 0, n_seq
        else:
            try:
                start, stop = (int(x) for x in sequences)
            except (TypeError, ValueError):
                raise ValueError(f"sequences={sequences!r} must be a (start, stop) pair of ints.") from None
            if not 0 <= start <= stop <= n_seq:
                raise ValueError(
                    f"sequences={sequences!r} of {self.prefix!r}: expected 0 <= start <= stop <= {n_seq} "
                    f"(its sequence count)."
                )
        self.start, self.stop = start, stop
        self.eod_mask_loss = bool(config.eod_mask_loss)
        self.reset_position_ids = bool(config.reset_position_ids)
        self.reset_attention_mask = bool(config.reset_attention_mask)
        self.vocab_size = None if config.vocab_size is None else _check_int("vocab_size", config.vocab_size, 1)
        self.eod_id = None if config.eod_id is None else int(config.eod_id)

        if start < stop:
            self._token_lo = int(indexed.offsets[start])
            last = stop - 1
            n_tok = int(indexed.offsets[last]) + int(indexed.sizes[last]) - self._token_lo
        else:
            self._token_lo, n_tok = 0, 0
        self.num_tokens = n_tok
        if n_tok < self.seq_length + 1:
            raise ValueError(
                f"corpus {self.prefix!r} (sequences {start}..{stop - 1}) has {n_tok} tokens, fewer than "
                f"seq_length + 1 = {self.seq_length + 1} needed for one sample; use a smaller seq_length, more "
                f"data or a larger split part."
            )
        self.num_samples = (n_tok - 1) // self.seq_length
        options = [k for k in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask") if getattr(self, k)]
        self.eod_note: str | None = None
        if options and self.eod_id is None:
            raise ValueError(f"{', '.join(options)} need the end-of-document id: pass eod_id.")
        if self.eod_id is not None:
            self._check_eod(options)
        keys = ["tokens", "labels", "loss_mask"]
        if self.reset_position_ids:
            keys.append("position_ids")
        if self.reset_attention_mask:
            keys.append("segment_ids")
        self.sample_keys = tuple(keys)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._epochs: OrderedDict[int, EpochIndex] = OrderedDict()
        self.set_planned_samples(planned_samples)

    def set_planned_samples(self, planned_samples: int | None) -> None:
        """Set megatron-core's plan for this dataset (``num_samples``; None: none) and forget the epoch indices built
        so far. With a plan of two epochs and a separate final epoch (:func:`megatron_plan`) the megatron order's
        epoch 0 is that plan's first epoch (module docstring); ``two_epoch_plan`` says whether it is.

        Raises:
            ValueError: a negative ``planned_samples``.
        """
        self.planned_samples = None if planned_samples is None else _check_int("planned_samples", planned_samples, 0)
        plan = megatron_plan(self.num_tokens, self.seq_length, self.planned_samples)
        self.two_epoch_plan = self.sample_order == "megatron" and plan == MegatronPlan(2, True)
        self._epochs.clear()

    # ------------------------------------------------------------ checks

    def _check_eod(self, options: list[str]) -> None:
        eod, ix = self.eod_id, self.indexed
        assert eod is not None
        if eod < 0 or (self.vocab_size is not None and eod >= self.vocab_size):
            raise ValueError(
                f"eod_id={eod} outside the vocabulary [0, {self.vocab_size}) of {self.prefix!r}; use the "
                f"tokenizer the data was made with."
            )
        bounds = getattr(ix, "document_indices", None)
        if bounds is None:
            bounds = np.arange(len(ix) + 1, dtype=np.int64)
        doc_end = bounds[1:]  # exclusive last sequence of each document (non-decreasing)
        lo = int(np.searchsorted(doc_end, self.start, side="right"))
        hi = int(np.searchsorted(doc_end, self.stop, side="right"))
        m = hi - lo  # documents whose last sequence lies in [start, stop)
        k = min(m, EOD_CHECK_DOCUMENTS)
        docs = lo + (np.arange(k, dtype=np.int64) * m) // max(k, 1)
        first = np.asarray(bounds[docs], dtype=np.int64)
        end = np.asarray(bounds[docs + 1], dtype=np.int64)
        has_seq = end > first
        first, end = first[has_seq], end[has_seq]
        tok_start = np.asarray(ix.offsets[first], dtype=np.int64)
        tok_end = np.asarray(ix.offsets[end - 1], dtype=np.int64) + np.asarray(ix.sizes[end - 1], dtype=np.int64)
        nonempty = tok_end > tok_start
        last = np.asarray(ix.tokens[tok_end[nonempty] - 1]).astype(np.int64)
        checked, bad = int(last.size), int(np.count_nonzero(last != eod))
        self.eod_checked, self.eod_missing = checked, bad
        if bad:
            self.eod_note = (
                f"{bad:,} of {checked:,} checked documents do not end with eod_id={eod} (data made without "
                f"--append-eod?)"
            )
        if options and checked - bad == 0:
            raise ValueError(
                f"{', '.join(options)} {'needs' if len(options) == 1 else 'need'} end-of-document tokens, but "
                f"none of the {checked:,} checked documents "
                f"of {self.prefix!r} ends with eod_id={eod}: rebuild the data with tools/preprocess_data.py "
                f"--append-eod and the same tokenizer, or turn the option(s) off."
            )

    def _check_vocab(self, window: np.ndarray, where) -> None:
        """Raise ConfigError (a ValueError) for an id outside ``[0, vocab_size)``; ``where`` is the .bin position of
        window[0] (int) or of every token."""
        vocab = self.vocab_size
        if vocab is None or not window.size or (int(window.max()) < vocab and int(window.min()) >= 0):
            return
        q = int(np.flatnonzero((window >= vocab) | (window < 0))[0])
        pos = where + q if isinstance(where, int) else int(where[q])
        seq = int(np.searchsorted(self.indexed.offsets, pos, side="right")) - 1
        from ..config.errors import ConfigError  # bad input data: one error line (exit 2), not a traceback

        raise ConfigError(
            f"{self.prefix!r}: sequence {seq} holds token id {int(window[q])}, outside the vocabulary "
            f"[0, {vocab}) (vocab_size={vocab}); the data was made with another tokenizer: rebuild it with "
            f"tools/preprocess_data.py and the model's tokenizer."
        )

    # ------------------------------------------------------------ index arrays

    def __len__(self) -> int:
        """Samples in one epoch: ``(num_tokens - 1) // seq_length`` (the same for every epoch)."""
        return self.num_samples

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            self._perms[epoch] = perm
            while len(self._perms) > 2:  # a step spans at most two epochs
                self._perms.popitem(last=False)
        return perm

    def epoch_index(self, epoch: int) -> EpochIndex:
        """The megatron-order index arrays of ``epoch`` (the last two built are cached)."""
        ep = self._epochs.get(epoch)
        if ep is None:
            ep = build_epoch_index(
                self.indexed.sizes,
                self.start,
                self.stop,
                self.seq_length,
                self.seed,
                epoch,
                second_document_shuffle=epoch == 0 and self.two_epoch_plan,
            )
            self._epochs[epoch] = ep
            while len(self._epochs) > 2:  # a step spans at most two epochs
                self._epochs.popitem(last=False)
        return ep

    def sample_index(self, global_sample: int) -> int:
        """Stream order: the unshuffled sample id (for ``self[...]``) of a global consumed-sample counter (>= 0,
        may exceed ``len``); epoch ``e = global_sample // len`` uses
        ``numpy.random.default_rng(seed + e).permutation(len)``.

        Raises:
            ValueError: a negative counter, or the megatron order (use `sample`).
        """
        g = _check_int("global_sample", global_sample, 0)
        if self.sample_order != "stream":
            raise ValueError("sample_index is the stream order's; with sample_order='megatron' call sample(g).")
        epoch, pos = divmod(g, self.num_samples)
        return int(self._permutation(epoch)[pos])

    # ------------------------------------------------------------ reading

    def _stream_window(self, i: int) -> tuple[np.ndarray, int]:
        start = self._token_lo + i * self.seq_length
        return np.asarray(self.indexed.tokens[start : start + self.seq_length + 1], dtype=np.int64), start

    def _megatron_window(self, ep: EpochIndex, s: int) -> tuple[np.ndarray, int | np.ndarray]:
        """Tokens ``[s*S, s*S + S + 1)`` of the epoch's stream and their .bin positions (an int when contiguous)."""
        ix, n = self.indexed, self.seq_length + 1
        p = s * self.seq_length
        k0 = int(np.searchsorted(ep.ends, p, side="right"))  # the position holding stream token p
        k1 = int(np.searchsorted(ep.ends, p + n - 1, side="right"))  # ... and token p + S
        if k0 == k1:
            doc = int(ep.document_index[k0])
            start = int(ix.offsets[doc]) + p - (int(ep.ends[k0]) - int(ix.sizes[doc]))
            return np.asarray(ix.tokens[start : start + n], dtype=np.int64), start
        docs = np.asarray(ep.document_index[k0 : k1 + 1], dtype=np.int64)
        seg_end = ep.ends[k0 : k1 + 1]
        seg_start = seg_end - np.asarray(ix.sizes[docs], dtype=np.int64)
        counts = np.minimum(seg_end, p + n) - np.maximum(seg_start, p)
        where = np.repeat(np.asarray(ix.offsets[docs], dtype=np.int64) - seg_start, counts) + np.arange(p, p + n)
        return np.asarray(ix.tokens[where], dtype=np.int64), where

    def _window(self, g: int) -> tuple[np.ndarray, int | np.ndarray]:
        epoch, pos = divmod(_check_int("global_sample", g, 0), self.num_samples)
        if self.sample_order == "stream":
            return self._stream_window(int(self._permutation(epoch)[pos]))
        ep = self.epoch_index(epoch)
        return self._megatron_window(ep, int(ep.shuffle_index[pos]))

    def _make(self, window: np.ndarray, where) -> dict[str, torch.Tensor]:
        self._check_vocab(window, where)
        t = torch.from_numpy(window)
        tokens = window[:-1]
        out = {"tokens": t[:-1], "labels": t[1:]}
        if self.eod_mask_loss:
            out["loss_mask"] = torch.from_numpy((tokens != self.eod_id).astype(np.float32))
        else:
            out["loss_mask"] = torch.ones(self.seq_length, dtype=torch.float32)
        if self.reset_position_ids or self.reset_attention_mask:
            is_eod = tokens == self.eod_id
            before = np.cumsum(is_eod, dtype=np.int64) - is_eod  # eod tokens strictly before each position
            if self.reset_position_ids:
                seg_start = np.concatenate(([0], np.flatnonzero(is_eod) + 1))
                out["position_ids"] = torch.from_numpy(np.arange(self.seq_length, dtype=np.int64) - seg_start[before])
            if self.reset_attention_mask:
                out["segment_ids"] = torch.from_numpy(before)
        return out

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sample ``i`` in ``[0, len)``: stream order, the unshuffled window ``i`` (pair with `sample_index`);
        megatron order, Megatron's ``dataset[i]``: sample ``i`` of epoch 0 (= ``sample(i)``). Keys: `sample`.

        Raises:
            IndexError: ``i`` outside ``[0, len)``.
        """
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples}).")
        if self.sample_order == "stream":
            return self._make(*self._stream_window(int(i)))
        return self.sample(int(i))

    def sample(self, g: int) -> dict[str, torch.Tensor]:
        """The sample at global consumed-sample counter ``g >= 0`` (epoch ``g // len``, position ``g % len``):
        ``tokens``, ``labels`` int64 [S], ``loss_mask`` float32 [S], plus ``position_ids`` int64 [S] with
        ``reset_position_ids`` and ``segment_ids`` int64 [S] with ``reset_attention_mask``.

        Raises:
            ValueError: a negative counter, or an id ``>= vocab_size`` (names the prefix and sequence).
        """
        return self._make(*self._window(g))

    def micro_batch(self, global_samples: list[int]) -> dict[str, torch.Tensor]:
        """Collated samples for a list of global counters (e.g. one entry of `dp_batch_indices`): each key
        of `sample` as [len(global_samples), S]."""
        return collate([self.sample(g) for g in global_samples])

    def valid_tokens(self, global_samples) -> int:
        """Loss-bearing tokens of the samples at these global counters (= the sum of their ``loss_mask``):
        without ``eod_mask_loss`` ``seq_length`` each, on the host without reading them; with it the inputs
        are read and the non-eod tokens counted."""
        if not self.eod_mask_loss:
            return len(global_samples) * self.seq_length
        return sum(int(np.count_nonzero(self._window(g)[0][:-1] != self.eod_id)) for g in global_samples)

    def describe(self) -> list[str]:
        """One-line start-up facts: prefix and sequences, tokens, samples per epoch, order, options, eod note."""
        n_all = len(self.indexed)
        part = "all" if (self.start, self.stop) == (0, n_all) else f"{self.start:,}..{self.stop - 1:,}"
        lines = [
            f"{self.prefix}: sequences {part} ({self.stop - self.start:,} of {n_all:,}), {self.num_tokens:,} tokens",
            f"{self.num_samples:,} samples per epoch of {self.seq_length} tokens, order {self.sample_order}, "
            f"seed {self.seed}",
        ]
        if self.planned_samples is not None and self.sample_order == "megatron":
            plan = megatron_plan(self.num_tokens, self.seq_length, self.planned_samples)
            if self.two_epoch_plan:
                how = "epoch 0 is megatron-core's first epoch of that plan"
            elif plan.num_epochs == 1:
                how = "epoch 0 is megatron-core's epoch"
            else:
                how = "megatron-core shuffles these epochs together, so its order differs from epoch 0 here"
            final = ", the final one separate" if plan.separate_final_epoch else ""
            lines.append(
                f"megatron-core plans {self.planned_samples:,} samples: {plan.num_epochs} epoch(s){final}; {how}"
            )
        opts = [k for k in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask") if getattr(self, k)]
        lines.append(f"options: {', '.join(opts) if opts else 'none'} (eod_id={self.eod_id})")
        if self.eod_note:
            lines.append(f"note: {self.eod_note}")
        return lines


def dp_batch_indices(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """Global sample counters of one training step for data-parallel rank ``dp_rank``.

    The step covers counters ``consumed_samples .. consumed_samples + G - 1``; rank ``r``
    gets the contiguous slice of ``G / dp_size`` counters starting at
    ``consumed_samples + r * G / dp_size``, split into micro-batches of
    ``micro_batch_size``. Pass each list to ``micro_batch`` of a `SampleDataset`.

    Returns:
        ``G / (micro_batch_size * dp_size)`` lists of ``micro_batch_size`` ints.

    Raises:
        ValueError: negative/zero sizes, ``dp_rank`` outside ``[0, dp_size)``, or ``G`` not
            divisible by ``micro_batch_size * dp_size``.
    """
    consumed = _check_int("consumed_samples", consumed_samples, 0)
    gbs = _check_int("global_batch_size", global_batch_size, 1)
    mbs = _check_int("micro_batch_size", micro_batch_size, 1)
    dp = _check_int("dp_size", dp_size, 1)
    rank = _check_int("dp_rank", dp_rank, 0)
    if rank >= dp:
        raise ValueError(f"dp_rank={rank} must be < dp_size={dp}.")
    if gbs % (mbs * dp):
        raise ValueError(
            f"global_batch_size={gbs} is not divisible by micro_batch_size * dp_size = {mbs} * {dp} = "
            f"{mbs * dp}; choose a global batch size that is a multiple of {mbs * dp}."
        )
    per_rank = gbs // dp
    start = consumed + rank * per_rank
    return [list(range(s, s + mbs)) for s in range(start, start + per_rank, mbs)]


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack a list of sample dicts into a batch: each value becomes [len(samples), ...].

    Raises ValueError for an empty list or samples with different keys.
    """
    if not samples:
        raise ValueError("collate: got an empty list of samples.")
    keys = samples[0].keys()
    for s in samples[1:]:
        if s.keys() != keys:
            raise ValueError(f"collate: samples have different keys: {sorted(keys)} vs {sorted(s.keys())}.")
    return {k: torch.stack([s[k] for s in samples]) for k in keys}
