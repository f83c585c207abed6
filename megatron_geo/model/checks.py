"""Start-up checks of the ``model`` section: its shape rules (:func:`check_model_config`, before any process group
starts) and its vocabulary against the data a run reads (:func:`check_vocab_size`, once the tokenizer is known)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.checks import check_positive
from ..config.errors import ConfigError
from ..config.schema import Config, ModelConfig

if TYPE_CHECKING:
    from ..data.hf_tokenizer import HFTokenizer
    from ..data.tokenizer import Tokenizer

_POSITIVE = (
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_kv_heads",
    "ffn_hidden_size",
    "seq_length",
    "vocab_size",
    "make_vocab_size_divisible_by",
)


def check_model_config(m: ModelConfig, tensor: int) -> None:
    """Check the model's shape for tensor-parallel size ``tensor`` (a positive number, checked first).

    Checked: the sizes positive; ``hidden_size`` divisible by ``num_attention_heads``, with an even head dim (RoPE);
    ``num_attention_heads`` divisible by ``num_kv_heads``; ``num_attention_heads``, ``num_kv_heads`` and
    ``ffn_hidden_size`` divisible by ``tensor``.

    Raises:
        ConfigError: naming the key, the value and what it must divide or be divisible by.
    """
    check_positive("model", m, _POSITIVE)
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}"
        )
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(f"head dim {m.hidden_size // m.num_attention_heads} must be even for RoPE")
    if m.num_attention_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}"
        )
    for name in ("num_attention_heads", "num_kv_heads", "ffn_hidden_size"):
        if getattr(m, name) % tensor:
            raise ConfigError(f"model.{name}={getattr(m, name)} is not divisible by parallel.tensor={tensor}")


def check_vocab_size(cfg: Config, tokenizer: Tokenizer | HFTokenizer | None = None) -> None:
    """``model.vocab_size`` (ids, not the padded size) against the vocabulary of the data.

    - With the run's tokenizer (``data.source=indexed``, or a Hugging Face tokenizer with either source): equal
      to its ``vocab_size`` (``len(tokenizer)`` for Hugging Face), so that the embedding and the output layer cover
      exactly its ids, the end-of-document id among them. The data's own ids are checked against the tokenizer
      when the datasets open (the first 16M tokens of each file) and again as each sample is read.
    - With the embedded corpus and the SentencePiece tokenizer trained on it with ``model.vocab_size`` pieces: at
      least :data:`~megatron_geo.data.corpus.SHAKESPEARE_MIN_VOCAB` (91: a piece for every character of the text,
      and unk, bos, eos); SentencePiece refuses fewer. The largest size the text gives (99,523 pieces) is reported
      by SentencePiece when the corpus is built.

    Raises:
        ConfigError: one line naming ``model.vocab_size``, the value, the bound and the fix.
    """
    v, d = cfg.model.vocab_size, cfg.data
    if tokenizer is not None:
        n = tokenizer.vocab_size
        if v != n:
            size = f"{n} ids (len(tokenizer))" if d.tokenizer_type == "huggingface" else f"{n} pieces"
            raise ConfigError(
                f"model.vocab_size={v} but the tokenizer data.tokenizer_model={tokenizer.model_path!r} has {size}; "
                f"set model.vocab_size={n}, or use the tokenizer the data was made with"
            )
        return
    if d.source == "shakespeare" and d.tokenizer_type == "sentencepiece":
        from ..data.corpus import SHAKESPEARE_MIN_VOCAB

        if v < SHAKESPEARE_MIN_VOCAB:
            raise ConfigError(
                f"model.vocab_size={v} is too small for the embedded corpus (data.source=shakespeare): the "
                f"SentencePiece tokenizer trained on it needs at least {SHAKESPEARE_MIN_VOCAB} pieces (one per "
                f"character of the text, and unk, bos, eos); set model.vocab_size={SHAKESPEARE_MIN_VOCAB} or more "
                f"(configs/tiny.yaml uses 2048)"
            )
