"""Start-up checks of the data a run reads that open its files: the tokenizer is loaded, ``model.vocab_size`` is
checked against it, and the embedded corpus's cache folder is probed. Every process makes them before any process
group starts, so that bad input is one ``error:`` line (exit 2) and not a traceback on every rank (the checks that
only look at the config or at file headers are :func:`megatron_geo.training.validate.validate_config` and
:func:`~megatron_geo.training.validate.check_inputs`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config.schema import Config

if TYPE_CHECKING:
    from ..data.hf_tokenizer import HFTokenizer
    from ..data.tokenizer import Tokenizer


def check_data_inputs(cfg: Config, write: bool = True) -> None:
    """Load the run's tokenizer and check the settings that depend on it, as :func:`build_data` will use them.

    - ``data.tokenizer_model``: with ``data.tokenizer_type=huggingface`` (either source) the folder loads with
      ``transformers`` and has an EOS token; with ``data.source=indexed`` and SentencePiece the file is a
      SentencePiece model with an EOS piece (:func:`megatron_geo.data.tokenizer.check_tokenizer_file`: an
      indexed dataset's ``.idx`` given by mistake is named as such);
    - ``model.vocab_size``: :func:`megatron_geo.model.checks.check_vocab_size` (equal to the tokenizer's, or
      large enough for the embedded corpus's own tokenizer);
    - ``data.cache_dir`` (``write=True``, ``data.source=shakespeare``): holds the built corpus, or can be created
      and written (:func:`megatron_geo.data.corpus.check_cache_dir`). ``write=False`` (``--print-config``) leaves
      it alone: that check creates the folder.

    Raises:
        ConfigError: one line naming the key, the value and the fix.
    """
    from ..data.corpus import check_cache_dir
    from ..model.checks import check_vocab_size

    d = cfg.data
    hf = None
    tok: Tokenizer | HFTokenizer | None = None
    if d.tokenizer_type == "huggingface":
        from ..data.hf_tokenizer import HFTokenizer

        tok = hf = HFTokenizer(d.tokenizer_model, "data.tokenizer_model")
        _ = hf.eod_id  # a tokenizer without an EOS token: one line naming the folder
    elif d.source == "indexed":
        from ..data.tokenizer import check_tokenizer_file

        tok = check_tokenizer_file(d.tokenizer_model, "data.tokenizer_model")
    check_vocab_size(cfg, tok)
    if write and d.source == "shakespeare":
        check_cache_dir(d.cache_dir, cfg.model.vocab_size, tokenizer=hf)
