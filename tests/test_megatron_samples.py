"""GPTDataset's sample orders against plain-Python re-implementations written here: Megatron-Core's document
shuffle -> sample index (walking the documents token by token) -> sample shuffle per epoch, the stream order of
earlier releases, and Megatron's loss mask / position ids / attention mask rules."""

import numpy as np
import pytest
import torch

from megatron_geo.data import GPTDataset, GPTDatasetConfig, IndexedDataset, IndexedDatasetBuilder, dp_batch_indices

EOD = 2


def _build(prefix, docs, vocab_size=300, lengths=None):
    with IndexedDatasetBuilder(str(prefix), vocab_size) as b:
        for k, doc in enumerate(docs):
            b.add_document(np.asarray(doc, dtype=np.int64), lengths=None if lengths is None else lengths[k])
    return IndexedDataset(str(prefix))


def _corpus(rng, n, vocab=300, max_len=30, empty_every=5, eod=EOD):
    """Random documents ending with eod; every ``empty_every``-th one empty; some longer than any S used."""
    docs = []
    for k in range(n):
        if empty_every and k % empty_every == 3:
            docs.append([])
            continue
        length = int(rng.integers(1, max_len)) if k % 7 else 3 * max_len
        doc = [int(x) for x in rng.integers(3, vocab, length)]
        doc[-1] = eod
        docs.append(doc)
    return docs


def _random_state(seed, epoch):
    if epoch == 0 and seed < 2**32:
        return np.random.RandomState(seed)
    return np.random.RandomState([seed % 2**32, seed // 2**32, epoch])


def _reference_epoch(seqs, start, stop, S, seed, epoch):
    """Samples (lists of S + 1 ids) of one epoch in consumed order, by Megatron's steps written as loops."""
    rs = _random_state(seed, epoch)
    doc_index = np.array(list(range(start, stop)), dtype=np.int32)
    rs.shuffle(doc_index)
    sizes = [len(seqs[d]) for d in doc_index]
    n = (sum(sizes) - 1) // S
    # sample index: (position in doc_index, offset) where each sample starts; walk S + 1 tokens per sample,
    # the last token of a sample being the first of the next
    bounds, pos, off = [(0, 0)], 0, 0
    for _ in range(n):
        remaining = S + 1
        while remaining:
            available = sizes[pos] - off
            remaining -= available
            if remaining <= 0:
                off += remaining + available - 1
                remaining = 0
            else:
                pos, off = pos + 1, 0
        bounds.append((pos, off))
    shuffle = np.arange(n, dtype=np.uint32)
    rs.shuffle(shuffle)
    out = []
    for k in range(n):
        (p0, o0), (p1, o1) = bounds[int(shuffle[k])], bounds[int(shuffle[k]) + 1]
        toks = []
        for p in range(p0, p1 + 1):
            doc = seqs[doc_index[p]]
            toks += doc[(o0 if p == p0 else 0) : (o1 + 1 if p == p1 else len(doc))]
        assert len(toks) == S + 1
        out.append(toks)
    return out


@pytest.mark.parametrize(
    "S,seed,subset",
    [(8, 1234, None), (1, 7, None), (5, 0, (4, 33)), (40, 99, None), (3, 2**40 + 5, (0, 20))],
)
def test_megatron_order_matches_a_loop_reference_over_several_epochs(tmp_path, S, seed, subset):
    docs = _corpus(np.random.default_rng(S), 40)
    ds = _build(tmp_path / "c", docs)
    start, stop = subset or (0, len(docs))
    g = GPTDataset(ds, GPTDatasetConfig(S, seed, eod_id=EOD, sample_order="megatron"), sequences=subset)
    n = len(g)
    assert n == (sum(len(d) for d in docs[start:stop]) - 1) // S
    for epoch in range(3):
        want = _reference_epoch(docs, start, stop, S, seed, epoch)
        assert len(want) == n
        for k in range(n):
            s = g.sample(epoch * n + k)
            assert s["tokens"].dtype == torch.int64 and s["labels"].dtype == torch.int64
            assert s["tokens"].tolist() == want[k][:-1], (epoch, k)
            assert s["labels"].tolist() == want[k][1:], (epoch, k)
            assert s["loss_mask"].dtype == torch.float32 and torch.all(s["loss_mask"] == 1)
            assert set(s) == {"tokens", "labels", "loss_mask"}
    # Megatron's dataset[i] is the epoch-0 sample i
    assert g[3]["tokens"].tolist() == _reference_epoch(docs, start, stop, S, seed, 0)[3][:-1]
    with pytest.raises(IndexError):
        g[n]
    with pytest.raises(ValueError, match="sample_index is the stream order"):
        g.sample_index(0)


def test_epoch_zero_is_exactly_randomstate_of_the_seed(tmp_path):
    """The first epoch: RandomState(seed) shuffles the int32 sequence ids, then (same state) the sample ids."""
    docs = [[5 + k] * (k % 4 + 1) for k in range(25)]  # sequence k repeats the id 5 + k
    S, seed = 4, 31337
    g = GPTDataset(_build(tmp_path / "c", docs), GPTDatasetConfig(S, seed, sample_order="megatron"))
    rs = np.random.RandomState(seed)
    order = np.arange(25, dtype=np.int32)
    rs.shuffle(order)
    stream = [t for k in order for t in docs[k]]
    n = (len(stream) - 1) // S
    perm = np.arange(n, dtype=np.uint32)
    rs.shuffle(perm)
    ep = g.epoch_index(0)
    assert ep.document_index.dtype == np.int32 and ep.document_index.tolist() == order.tolist()
    assert ep.shuffle_index.dtype == np.uint32 and ep.shuffle_index.tolist() == perm.tolist()
    for k in range(n):
        i = int(perm[k])
        assert g.sample(k)["tokens"].tolist() == stream[i * S : i * S + S]
        assert g.sample(k)["labels"].tolist() == stream[i * S + 1 : i * S + S + 1]
    # a later epoch has its own shuffles
    assert g.epoch_index(1).document_index.tolist() != order.tolist()


def test_stream_order_is_unchanged(tmp_path):
    """Windows of the file-order stream, epoch e in numpy default_rng(seed + e).permutation order."""
    docs = _corpus(np.random.default_rng(3), 30, empty_every=0)
    stream = [t for d in docs for t in d]
    S, seed = 7, 11
    g = GPTDataset(_build(tmp_path / "c", docs), GPTDatasetConfig(S, seed, eod_id=EOD, sample_order="stream"))
    n = (len(stream) - 1) // S
    assert len(g) == n
    for epoch in range(3):
        perm = np.random.default_rng(seed + epoch).permutation(n)
        for k in range(n):
            i = int(perm[k])
            assert g.sample_index(epoch * n + k) == i
            s = g.sample(epoch * n + k)
            assert s["tokens"].tolist() == stream[i * S : i * S + S]
            assert s["labels"].tolist() == stream[i * S + 1 : i * S + S + 1]
            assert g[i]["tokens"].tolist() == stream[i * S : i * S + S]
    mb = g.micro_batch([n - 1, n, n + 1])
    assert mb["tokens"].shape == (3, S) and mb["tokens"][1].tolist() == g.sample(n)["tokens"].tolist()
    # a sequence range in the stream order: windows of that part of the file
    part = GPTDataset(_build(tmp_path / "c", docs), GPTDatasetConfig(S, seed, sample_order="stream"), sequences=(5, 12))
    sub = [t for d in docs[5:12] for t in d]
    perm = np.random.default_rng(seed).permutation((len(sub) - 1) // S)
    assert part.sample(0)["tokens"].tolist() == sub[int(perm[0]) * S : int(perm[0]) * S + S]


def _reference_ltor(tokens, eod, reset_position_ids, reset_attention_mask, eod_mask_loss):
    """Megatron's _get_ltor_masks_and_position_ids semantics as loops: causal mask, then after every eod at i no
    later position sees positions <= i; positions after i shift down so that i + 1 is 0."""
    S = len(tokens)
    allowed = [[k <= q for k in range(S)] for q in range(S)]
    loss = [0.0 if (eod_mask_loss and t == eod) else 1.0 for t in tokens]
    pos = list(range(S))
    prev = 0
    for i in range(S):
        if tokens[i] != eod:
            continue
        if reset_attention_mask:
            for q in range(i + 1, S):
                for k in range(i + 1):
                    allowed[q][k] = False
        if reset_position_ids:
            for q in range(i + 1, S):
                pos[q] -= i + 1 - prev
            prev = i + 1
    return allowed, loss, pos


@pytest.mark.parametrize("order", ["megatron", "stream"])
@pytest.mark.parametrize("opts", [(True, True, True), (False, True, False), (True, False, True), (False, False, True)])
def test_eod_options_match_megatrons_rules(tmp_path, order, opts):
    eod_mask_loss, reset_position_ids, reset_attention_mask = opts
    rng = np.random.default_rng(5)
    docs = []
    for k in range(60):  # tiny vocabulary: eod often, twice in a row, first and last in a sample
        doc = [int(x) for x in rng.integers(0, 5, int(rng.integers(1, 12)))]
        doc[-1] = EOD
        docs.append(doc if k % 9 else [])
    S = 16
    g = GPTDataset(
        _build(tmp_path / "c", docs, vocab_size=5),
        GPTDatasetConfig(
            S,
            3,
            eod_id=EOD,
            sample_order=order,
            eod_mask_loss=eod_mask_loss,
            reset_position_ids=reset_position_ids,
            reset_attention_mask=reset_attention_mask,
        ),
    )
    keys = {"tokens", "labels", "loss_mask"} | ({"position_ids"} if reset_position_ids else set())
    keys |= {"segment_ids"} if reset_attention_mask else set()
    assert set(g.sample_keys) == keys
    total_loss = 0.0
    for c in range(len(g) + 5):
        s = g.sample(c)
        assert set(s) == keys
        allowed, loss, pos = _reference_ltor(s["tokens"].tolist(), EOD, *opts[1:], eod_mask_loss)
        assert s["loss_mask"].tolist() == loss
        total_loss += sum(loss)
        if reset_position_ids:
            assert s["position_ids"].dtype == torch.int64 and s["position_ids"].tolist() == pos
        if reset_attention_mask:
            seg = s["segment_ids"]
            assert seg.dtype == torch.int64
            causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
            mask = causal & (seg[:, None] == seg[None, :])
            assert mask.tolist() == allowed
    counters = list(range(len(g) + 5))
    assert g.valid_tokens(counters) == total_loss == float(g.micro_batch(counters)["loss_mask"].sum())


def test_eod_note_counts_documents_not_sequences(tmp_path):
    # three documents of two sequences each: only the last sequence of a document ends with eod
    docs = [[7, 8, 9, EOD], [4, 5, EOD], [6, 6, 6, 6, 9]]
    lengths = [[2, 2], [1, 2], [3, 2]]
    ds = _build(tmp_path / "c", docs, lengths=lengths)
    assert len(ds) == 6
    g = GPTDataset(ds, GPTDatasetConfig(2, 0, eod_id=EOD, sample_order="megatron"))
    assert (g.eod_checked, g.eod_missing) == (3, 1)
    assert any("1 of 3 checked documents do not end with eod_id=2" in line for line in g.describe())
    # some end with eod: allowed
    assert GPTDataset(ds, GPTDatasetConfig(2, 0, eod_id=EOD, eod_mask_loss=True)).eod_missing == 1
    none = _build(tmp_path / "n", [[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match="reset_attention_mask needs end-of-document tokens.*none of the 2"):
        GPTDataset(none, GPTDatasetConfig(2, 0, eod_id=EOD, reset_attention_mask=True))


def test_an_id_outside_the_vocabulary_names_the_sequence(tmp_path):
    # the bad id opens sequence 6, after an empty sequence 5 (both start at the same offset)
    docs = [[5, 6, 7, EOD]] * 5 + [[], [250, 5, EOD]] + [[5, 6, EOD]] * 6
    ds = _build(tmp_path / "c", docs)
    for order in ("megatron", "stream"):
        g = GPTDataset(ds, GPTDatasetConfig(3, 1, eod_id=EOD, sample_order=order, vocab_size=200))
        bad = 0
        for c in range(len(g)):
            try:
                g.sample(c)
            except ValueError as e:
                bad += 1
                assert str(tmp_path / "c") in str(e) and "sequence 6" in str(e)
                assert "250" in str(e) and "vocab_size=200" in str(e)
        assert bad >= 1
        GPTDataset(ds, GPTDatasetConfig(3, 1, eod_id=EOD, sample_order=order, vocab_size=300)).micro_batch(
            list(range(len(g)))
        )


def test_resume_and_dp_resharding_see_the_same_samples(tmp_path):
    docs = _corpus(np.random.default_rng(9), 50)
    ds = _build(tmp_path / "c", docs)

    def step(g, consumed, gbs, dp):
        return [
            g.micro_batch(mb)["tokens"].tolist() for r in range(dp) for mb in dp_batch_indices(consumed, gbs, 2, r, dp)
        ]

    gbs = 8
    full = GPTDataset(ds, GPTDatasetConfig(6, 21, sample_order="megatron"))
    steps = 3 * len(full) // gbs + 2  # several epochs
    single = [step(full, s * gbs, gbs, 1) for s in range(steps)]
    for dp in (2, 4):
        resumed = GPTDataset(ds, GPTDatasetConfig(6, 21, sample_order="megatron"))
        assert [step(resumed, s * gbs, gbs, dp) for s in range(steps // 2, steps)] == single[steps // 2 :]


def test_describe_names_the_facts(tmp_path):
    docs = _corpus(np.random.default_rng(1), 20)
    g = GPTDataset(
        _build(tmp_path / "c", docs),
        GPTDatasetConfig(4, 5, eod_id=EOD, sample_order="megatron", eod_mask_loss=True),
        sequences=(2, 15),
    )
    text = "\n".join(g.describe())
    assert str(tmp_path / "c") in text and "2..14" in text and f"{len(g):,} samples per epoch" in text
    assert "order megatron" in text and "eod_mask_loss" in text
    assert f"{sum(len(d) for d in docs[2:15]):,} tokens" in text
