"""Hugging Face Llama <-> megatron-geo: parameter names, the RoPE row order, and ``config.json``.

Our Llama is a plain Llama (RMSNorm, SwiGLU, grouped-query attention, RoPE, no biases, untied embedding
and output layer), so the mapping is one-to-one by name. The one difference in layout: our RoPE rotates
the pairs ``(2i, 2i+1)`` of each head's q/k rows (:func:`megatron_geo.model.llama.apply_rope`), while
``transformers`` rotates ``(i, i + head_dim / 2)`` (``rotate_half``); the q_proj/k_proj rows of each head
are permuted between the two orders (Meta's ``permute`` in ``convert_llama_weights_to_hf.py``). With
it, transformers' per-token losses equal ours to within float rounding.

Pure functions of tensors and dicts: no transformers import here (``hf_export``/``hf_import`` do the I/O).
"""

from __future__ import annotations

import torch

from ..config.schema import ModelConfig

# ours -> transformers, per layer (prefix "layers.{i}." -> "model.layers.{i}.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class HFConversionError(ValueError):
    """A Hugging Face folder or config this converter cannot map; the message names the field and the fix."""


def hf_name(name: str) -> str:
    """The transformers ``LlamaForCausalLM`` parameter name of our parameter ``name``.

    Raises:
        KeyError: ``name`` is not a parameter of our Llama.
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise KeyError(f"'{name}' is not a parameter of megatron_geo's Llama")


def rope_rows_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a q_proj/k_proj weight ``[n_heads * head_dim, hidden]`` from our interleaved RoPE
    pairs (rows ``2i, 2i+1`` of a head) to transformers' half split (rows ``i, i + head_dim / 2``). Same
    shape and dtype; a new contiguous tensor (a pure permutation, so bitwise reversible)."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, hd // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def rope_rows_from_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`rope_rows_to_hf`."""
    rows, cols = w.shape
    hd = rows // n_heads
    return w.reshape(n_heads, 2, hd // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def to_hf_state(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our global state ``{name: tensor}`` (TP = 1 layout; the vocab rows of ``embed``/``output`` may be
    padded, only the first ``cfg.vocab_size`` are kept) -> transformers names, q/k rows permuted. Dtypes are
    kept; every tensor is a new contiguous one.

    Raises:
        HFConversionError: a parameter missing or of the wrong shape for ``cfg``.
    """
    from .consolidated import expected_shapes

    want = expected_shapes(cfg)
    out = {}
    for name, shape in want.items():
        t = state.get(name)
        if t is None:
            raise HFConversionError(
                f"the checkpoint has no '{name}'; it was not saved from a megatron_geo Llama with this config"
            )
        if name in ("embed.weight", "output.weight"):
            t = t[: cfg.vocab_size]
            shape = (cfg.vocab_size, *shape[1:])
        if tuple(t.shape) != shape:
            raise HFConversionError(f"'{name}' has shape {tuple(t.shape)} but the config needs {shape}")
        if name.endswith("attn.q_proj.weight"):
            t = rope_rows_to_hf(t, cfg.num_attention_heads)
        elif name.endswith("attn.k_proj.weight"):
            t = rope_rows_to_hf(t, cfg.num_kv_heads)
        out[hf_name(name)] = t.contiguous()
    return out


def from_hf_state(
    hf_state: dict[str, torch.Tensor], cfg: ModelConfig, where: str, tied: bool = False
) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_hf_state`: transformers tensors -> our names, global unpadded shapes, FP32.

    ``model.rotary_emb.inv_freq`` (a buffer some exports carry) is ignored. ``tied`` (the config's
    ``tie_word_embeddings``): our Llama has separate embedding and output weights, so the output layer starts
    as a copy of the embedding (``lm_head.weight`` must then be absent or equal to it); the two are trained
    apart from then on. The imported model's function is unchanged.

    Raises:
        HFConversionError: a tensor missing, left over (e.g. a bias), of the wrong shape or with non-finite
            values, naming it.
    """
    from .consolidated import expected_shapes

    want = expected_shapes(cfg)
    names = {hf_name(n): n for n in want}
    if tied:
        emb = hf_state.get("model.embed_tokens.weight")
        head = hf_state.get("lm_head.weight")
        if emb is not None and head is not None and not torch.equal(head, emb):
            raise HFConversionError(
                f"{where}: config.json ties the embeddings (tie_word_embeddings=true) but lm_head.weight differs "
                f"from model.embed_tokens.weight; set tie_word_embeddings=false or save the tied model again"
            )
        if emb is not None:
            hf_state = {**hf_state, "lm_head.weight": emb}
    extra = sorted(k for k in hf_state if k not in names and not k.endswith("rotary_emb.inv_freq"))
    if extra:
        bias = [k for k in extra if k.endswith(".bias")]
        why = (
            f"biases ({bias[0]}, ...) are not supported: megatron_geo's Llama has none"
            if bias
            else "they are not part of a Llama this converter supports"
        )
        raise HFConversionError(f"{where}: unexpected tensors {extra[:4]}{'...' if len(extra) > 4 else ''}: {why}")
    out = {}
    for hname, name in names.items():
        t = hf_state.get(hname)
        if t is None:
            hint = (
                " (if the model ties its embeddings, config.json must say tie_word_embeddings=true)"
                if hname == "lm_head.weight"
                else ""
            )
            raise HFConversionError(f"{where}: tensor '{hname}' is missing{hint}; the folder is incomplete")
        shape = want[name]
        if name in ("embed.weight", "output.weight"):
            shape = (cfg.vocab_size, *shape[1:])
        if tuple(t.shape) != shape:
            raise HFConversionError(
                f"{where}: tensor '{hname}' has shape {tuple(t.shape)} but config.json implies "
                f"{shape}; the weights do not match the config"
            )
        if not t.is_floating_point():
            raise HFConversionError(
                f"{where}: tensor '{hname}' has dtype {t.dtype}; quantized weights are not "
                f"supported, export an unquantized (FP32/BF16/FP16) model"
            )
        t = t.to(torch.float32)
        if not torch.isfinite(t).all():
            raise HFConversionError(
                f"{where}: tensor '{hname}' holds NaN or inf values; the weights are damaged "
                f"(export them again from a healthy model)"
            )
        if name.endswith("attn.q_proj.weight"):
            t = rope_rows_from_hf(t, cfg.num_attention_heads)
        elif name.endswith("attn.k_proj.weight"):
            t = rope_rows_from_hf(t, cfg.num_kv_heads)
        out[name] = t.contiguous()
    return out


def hf_config_kwargs(cfg: ModelConfig) -> dict:
    """``LlamaConfig`` keyword arguments for our model config (vocab without TP padding, untied embeddings,
    ids of our SentencePiece convention: unk 0, bos 1, eos 2, no pad)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.seq_length,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        initializer_range=cfg.init_std,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )


def tied_embeddings(c: dict) -> bool:
    """Whether a Hugging Face ``config.json`` dict ties ``lm_head.weight`` to ``model.embed_tokens.weight``
    (transformers' default for a missing field is False for Llama)."""
    return bool(c.get("tie_word_embeddings", False))


def _rope_type(c: dict) -> tuple[str, object] | None:
    """``(field, value)`` of a RoPE scaling other than the default, from a v4 (rope_scaling) or v5
    (rope_parameters) config.json; None for plain RoPE."""
    for field in ("rope_scaling", "rope_parameters"):
        v = c.get(field)
        if v is None:
            continue
        if not isinstance(v, dict):
            return field, v
        kind = v.get("rope_type", v.get("type", "default"))
        if kind != "default" or any(k not in ("rope_type", "type", "rope_theta") for k in v):
            return field, v
    return None


def _positive_int(v: object) -> bool:
    """``v`` is an int (not a bool) of at least 1."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def model_overrides_from_hf(c: dict, where: str) -> dict:
    """Our ``model.*`` values from a Hugging Face ``config.json`` dict.

    Returns ``{"hidden_size", "num_layers", "num_attention_heads", "num_kv_heads", "ffn_hidden_size",
    "seq_length", "vocab_size", "rope_theta", "norm_eps"}``. Tied input and output embeddings
    (``tie_word_embeddings``, e.g. SmolLM2) are accepted: :func:`from_hf_state` unties them on import
    (:func:`tied_embeddings` says whether a config ties them).

    Raises:
        HFConversionError: not a Llama, or a field our Llama cannot represent (biases, a RoPE
            scaling, another activation, a head_dim other than hidden / heads, quantization, ...), naming the
            field, its value and what it must be.
    """

    def bad(field, value, need):
        raise HFConversionError(
            f"{where}: {field}={value!r} is not supported (megatron_geo's Llama needs {need}); "
            f"convert a plain Llama checkpoint"
        )

    if not isinstance(c, dict):
        raise HFConversionError(f"{where}: config.json is not a JSON object")
    if c.get("model_type") != "llama":
        bad("model_type", c.get("model_type"), "'llama'")
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in required if not _positive_int(c.get(k))]
    if missing:
        raise HFConversionError(f"{where}: config.json lacks a positive integer {missing[0]}; it is damaged")
    checks = (
        ("attention_bias", False, "false"),
        ("mlp_bias", False, "false"),
        ("hidden_act", "silu", "'silu' (SwiGLU)"),
        ("quantization_config", None, "none (unquantized weights)"),
    )
    for field, need, text in checks:
        default = {"tie_word_embeddings": False, "hidden_act": "silu"}.get(field, need)
        if c.get(field, default) != need:
            bad(field, c.get(field), text)
    rope = _rope_type(c)
    if rope is not None:
        bad(rope[0], rope[1], "plain RoPE (no scaling): null or {'rope_type': 'default', 'rope_theta': ...}")
    if c.get("attention_dropout", 0.0) not in (0, 0.0, None):
        bad("attention_dropout", c.get("attention_dropout"), "0.0")
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    if h % heads:
        bad("num_attention_heads", heads, f"a divisor of hidden_size={h}")
    if heads % kv:
        bad("num_key_value_heads", kv, f"a divisor of num_attention_heads={heads}")
    if c.get("head_dim") not in (None, h // heads):
        bad("head_dim", c.get("head_dim"), f"hidden_size / num_attention_heads = {h // heads}")
    if (h // heads) % 2:
        bad("head_dim", h // heads, "an even number (RoPE rotates pairs)")
    theta = c.get("rope_theta")
    if theta is None and isinstance(c.get("rope_parameters"), dict):
        theta = c["rope_parameters"].get("rope_theta")
    return {
        "hidden_size": h,
        "num_layers": c["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_kv_heads": kv,
        "ffn_hidden_size": c["intermediate_size"],
        "seq_length": int(c.get("max_position_embeddings") or 2048),
        "vocab_size": c["vocab_size"],
        "rope_theta": float(theta if theta is not None else 10000.0),
        "norm_eps": float(c.get("rms_norm_eps", 1e-6)),
    }
