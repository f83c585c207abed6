"""Start-up checks of the ``model`` section against the data a run reads (the shape checks that need no data,
such as head counts against ``parallel.tensor``, are in :mod:`megatron_geo.training.validate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.errors import ConfigError
from ..config.schema import Config

if TYPE_CHECKING:
    from ..data.hf_tokenizer import HFTokenizer
    from ..data.tokenizer import Tokenizer


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
