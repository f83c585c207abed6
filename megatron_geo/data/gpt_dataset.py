"""Fixed-length GPT training samples over an `IndexedDataset`, with deterministic
per-epoch shuffling and data-parallel batch assignment by consumed-sample counter.

The corpus is one token stream (all documents in order; each ends with EOD when
built by the project's tools). Sample ``i`` is ``stream[i*S : i*S + S + 1]`` for
``S = seq_length``: inputs are its first ``S`` tokens, labels its last ``S``.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from .indexed_dataset import IndexedDataset


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}.")
    return int(value)


class GPTDataset(torch.utils.data.Dataset):
    """Non-overlapping ``seq_length + 1``-token windows of the concatenated corpus.

    Args:
        indexed: the tokenized corpus.
        seq_length: tokens per sample (model context length), >= 1.
        seed: base seed (>= 0) of the per-epoch shuffle (`sample_index`).
        eod_id: if given, checks that every document ends with this id (catches data
            built without EOD or with another tokenizer) and that it is < vocab_size.

    Raises:
        ValueError: bad arguments, corpus shorter than ``seq_length + 1`` tokens, or
            the ``eod_id`` check fails.
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, seed: int, eod_id: int | None = None):
        self.indexed = indexed
        self.seq_length = _check_int("seq_length", seq_length, 1)
        self.seed = _check_int("seed", seed, 0)
        n_tok = indexed.num_tokens
        if n_tok < self.seq_length + 1:
            raise ValueError(
                f"corpus {indexed.prefix!r} has {n_tok} tokens, fewer than seq_length + 1 = "
                f"{self.seq_length + 1} needed for one sample; use a smaller seq_length or more data."
            )
        self.num_samples = (n_tok - 1) // self.seq_length
        if eod_id is not None:
            self._check_eod(int(eod_id))
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def _check_eod(self, eod_id: int) -> None:
        ix = self.indexed
        if not 0 <= eod_id < ix.vocab_size:
            raise ValueError(f"eod_id={eod_id} outside the dataset's vocab [0, {ix.vocab_size}).")
        nonempty = ix.sizes > 0
        last = np.asarray(ix.tokens[(ix.offsets + ix.sizes - 1)[nonempty]])
        bad = np.flatnonzero(last != eod_id)
        if bad.size:
            doc = int(np.flatnonzero(nonempty)[bad[0]])
            raise ValueError(
                f"{bad.size} documents of {ix.prefix!r} (first: doc {doc}) do not end with eod_id={eod_id}; "
                f"rebuild it with tools/preprocess_data.py --append-eod and the same tokenizer."
            )

    def __len__(self) -> int:
        """Number of full samples: ``(num_tokens - 1) // seq_length``."""
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sample ``i`` (unshuffled id in ``[0, len)``) as a dict of tensors:
        ``tokens`` int64 [S], ``labels`` int64 [S] (tokens shifted by one),
        ``loss_mask`` float32 [S] (all ones)."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples}).")
        start = int(i) * self.seq_length
        window = self.indexed.tokens[start : start + self.seq_length + 1]
        window = torch.from_numpy(np.asarray(window, dtype=np.int64))
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": torch.ones(self.seq_length, dtype=torch.float32),
        }

    def valid_tokens(self, global_samples) -> int:
        """Loss-bearing tokens of the samples at these global consumed-sample counters, on the host without
        reading them: every sample's ``loss_mask`` is all ones, so ``seq_length`` each. Equals the sum of the
        ``loss_mask`` of :meth:`micro_batch` over the same counters."""
        return len(global_samples) * self.seq_length

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            self._perms[epoch] = perm
            while len(self._perms) > 2:  # a step spans at most two epochs in practice
                self._perms.popitem(last=False)
        return perm

    def sample_index(self, global_sample: int) -> int:
        """Map a global consumed-sample counter (>= 0, may exceed ``len``) to a sample id.

        Epoch ``e = global_sample // len`` uses the permutation
        ``numpy.random.default_rng(seed + e).permutation(len)``.
        """
        g = _check_int("global_sample", global_sample, 0)
        epoch, pos = divmod(g, self.num_samples)
        return int(self._permutation(epoch)[pos])

    def micro_batch(self, global_samples: list[int]) -> dict[str, torch.Tensor]:
        """Collated samples for a list of global counters (e.g. one entry of `dp_batch_indices`)."""
        return collate([self[self.sample_index(g)] for g in global_samples])


def dp_batch_indices(
    consumed_samples: int, global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """Global sample counters of one training step for data-parallel rank ``dp_rank``.

    The step covers counters ``consumed_samples .. consumed_samples + G - 1``; rank ``r``
    gets the contiguous slice of ``G / dp_size`` counters starting at
    ``consumed_samples + r * G / dp_size``, split into micro-batches of
    ``micro_batch_size``. Pass each counter to `GPTDataset.sample_index`.

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
