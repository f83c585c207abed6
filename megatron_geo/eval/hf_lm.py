"""lm-eval's own ``hf`` model (``HFLM``) on a Hugging Face folder from ``tools/convert_checkpoint.py --to hf``.

A second, independent scoring path: transformers' Llama and tokenizer instead of our model and
:class:`~megatron_geo.eval.lm_wrapper.MegatronGeoLM`. Requests are encoded the way our wrapper encodes them:
our training documents follow an EOS (the previous document's end), so the tokenizer is set to prefix
the EOS token (``add_bos_token=True`` with an EOS template) and empty contexts use EOS
(``prefix_token_id``). ``loglikelihood`` and ``generate_until`` requests then see the same token ids as
in our wrapper; ``loglikelihood_rolling`` differs by one term, lm-eval also scores the prefixed EOS.
"""

from __future__ import annotations

import json
from pathlib import Path


def is_hf_folder(path: str | Path) -> bool:
    """True for a folder with a ``config.json`` (a Hugging Face model folder)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def _check_weight_files(path: Path) -> None:
    """Open every safetensors file's header (cheap: no weights are read), so that a missing or truncated file is
    one clear error instead of a loader traceback. Raises ValueError naming the file."""
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"'{path}' has no *.safetensors weights; export it with tools/convert_checkpoint.py --to hf")
    for f in files:
        try:
            with safe_open(str(f), "pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise ValueError(
                f"'{f}' could not be read ({e}); the file is damaged or incomplete: export the folder again"
            ) from None


def load_hf_lm(path: str | Path, batch_size: int = 8, device: str = "cpu"):
    """``lm_eval.models.huggingface.HFLM`` on the folder, FP32, EOS-prefixed as described above.

    Raises:
        ValueError: the folder has no tokenizer or no EOS token, or transformers is not installed (the message
            names ``pip install -e .[hf]``).
    """
    try:
        from lm_eval.models.huggingface import HFLM
        from tokenizers import processors
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(
            f"evaluating a Hugging Face folder needs transformers ({e.name} is missing): pip install -e '.[hf]'"
        ) from None
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise ValueError(f"'{path}' has no tokenizer (tokenizer.json); export it again without --no-tokenizer")
    _check_weight_files(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.eos_token_id is None:
        raise ValueError(
            f"the tokenizer of '{path}' has no EOS token; export it with tools/convert_checkpoint.py --to hf"
        )
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.eos_token} $A", special_tokens=[(tok.eos_token, tok.eos_token_id)]
    )
    max_len = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
    return HFLM(
        pretrained=str(path),
        tokenizer=tok,
        backend="causal",
        batch_size=batch_size,
        device=device,
        dtype="float32",
        add_bos_token=True,
        prefix_token_id=tok.eos_token_id,
        max_length=max_len,
    )
