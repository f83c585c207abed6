"""Per-document positions and attention (data.reset_position_ids / reset_attention_mask) in the model: a packed
sample of two documents gives, on the second document's tokens, the losses of that document run alone."""

import torch

from helpers import tiny_cfg
from megatron_geo.checkpoint.consolidated import _tp1_group
from megatron_geo.model.llama import Llama, document_causal_mask

EOD = 3


def _model():
    return Llama(tiny_cfg("model.vocab_size=50").model, _tp1_group(), 11).eval()


def _megatron_mask_loop(tokens: list[int], eod: int) -> torch.Tensor:
    """Megatron-LM's reset_attention_mask as a loop: start causal, then for each end-of-document position i no
    later position attends to positions <= i. True = may attend."""
    s = len(tokens)
    allowed = [[j <= i for j in range(s)] for i in range(s)]
    for i, t in enumerate(tokens):
        if t == eod:
            for q in range(i + 1, s):
                for k in range(i + 1):
                    allowed[q][k] = False
    return torch.tensor(allowed)


def test_document_causal_mask_is_megatrons_reset_attention_mask():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        toks = torch.randint(0, 6, (12,), generator=g)
        toks[torch.rand(12, generator=g) < 0.2] = EOD
        seg = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(toks == EOD, 0)[:-1]])  # eods before
        got = document_causal_mask(seg.unsqueeze(0))[0, 0]
        assert torch.equal(got, _megatron_mask_loop(toks.tolist(), EOD))


def test_packed_second_document_equals_the_document_alone():
    model = _model()
    g = torch.Generator().manual_seed(1)
    a = torch.randint(4, 50, (6,), generator=g).tolist() + [EOD]  # first document ends with EOD
    b = torch.randint(4, 50, (9,), generator=g).tolist()
    packed = torch.tensor([a + b])  # 16 tokens: inputs
    labels = torch.roll(packed, -1, 1)
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    seg = torch.tensor([[0] * len(a) + [1] * len(b)])
    with torch.no_grad():
        whole = model(packed, labels, position_ids=pos, segment_ids=seg)[0, len(a) : -1]
        alone = model(torch.tensor([b]), labels[:, len(a) :])[0, :-1]
        plain = model(packed, labels)[0, len(a) : -1]
    torch.testing.assert_close(whole, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(plain, alone, rtol=1e-3, atol=1e-3)  # without the resets the context leaks


def test_default_positions_equal_explicit_arange():
    model = _model()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randint(0, 50, (2, 16), generator=g), torch.randint(0, 50, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    seg = torch.zeros(2, 16, dtype=torch.long)
    with torch.no_grad():
        ref = model(x, y)
        torch.testing.assert_close(model(x, y, position_ids=pos), ref, rtol=0, atol=0)
        torch.testing.assert_close(model(x, y, segment_ids=seg), ref, rtol=1e-6, atol=1e-6)
