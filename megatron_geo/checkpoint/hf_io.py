"""Write and read Hugging Face Llama folders; build a resumable checkpoint from one.

Export (:func:`export_hf`): ``config.json`` (``transformers.LlamaConfig``), ``generation_config.json``,
``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` above
``max_shard_size``, written by ``huggingface_hub.save_torch_state_dict``) and the tokenizer
(:mod:`.hf_tokenizer`). Import (:func:`read_hf`, :func:`write_checkpoint`): the weights of a plain Llama
folder as a ``torch.distributed.checkpoint`` step folder with ``meta.json`` (step 0, no optimizer state),
which ``checkpoint.load=PATH`` resumes at any DP x TP layout.

Both write into a hidden temporary folder next to the output and rename it at the end: a failure leaves
nothing half-written, and an existing non-empty output is replaced only with ``force``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from ..config import Config, config_to_dict
from .hf import (
    HFConversionError,
    from_hf_state,
    hf_config_kwargs,
    model_overrides_from_hf,
    tied_embeddings,
    to_hf_state,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_output(out: Path, force: bool, source: Path | None = None) -> None:
    """Refuse a non-empty existing ``out`` without ``force``, a file in its place, and an ``out`` that is the
    ``source`` being converted or holds it (replacing it would delete the input).

    Raises:
        HFConversionError: naming the path and the fix.
    """
    dst = Path(out).resolve()
    if (
        dst == Path.cwd().resolve()
        or dst in Path.cwd().resolve().parents
        or not Path(out).name
        or Path(out).name in (".", "..")
    ):
        raise HFConversionError(
            f"output {out} is the current folder or above it; give a new folder name, e.g. out/model-hf"
        )
    if source is not None:
        src = Path(source).resolve()
        if src == dst or dst in src.parents:
            raise HFConversionError(f"output {out} is or contains the input {source}; choose another output folder")
        # inside a run's checkpoints folder, checkpoint.keep_latest would delete it with the step it sits in
        guarded = src.parent if src.parent.name == "checkpoints" else src
        if guarded in dst.parents:
            raise HFConversionError(
                f"output {out} is inside {guarded}, where checkpoint pruning would delete it; "
                f"choose a folder outside the run's checkpoints"
            )
    if out.exists() and not out.is_dir():
        raise HFConversionError(f"output {out} is a file; give a folder name")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HFConversionError(f"output folder {out} is not empty; choose a new folder or pass --force to replace it")


def _keep_top_level_rope_theta(path: Path, theta: float) -> None:
    """transformers 5 writes ``rope_theta`` only inside ``rope_parameters``; 4.x reads the top-level key and
    silently falls back to 10000 without it. Write both so every version sees the run's theta."""
    d = json.loads(path.read_text())
    d["rope_theta"] = float(theta)
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` folder to ``out`` (replacing an old ``out`` only now)."""
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _staging(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def export_hf(
    state: dict[str, torch.Tensor],
    cfg: Config,
    out: Path,
    dtype: str = "bf16",
    max_shard_size: str | int = "5GB",
    tokenizer_model: str | None = None,
    force: bool = False,
) -> list[str]:
    """Write a Hugging Face Llama folder that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load.

    Args:
        state: our global FP32 state ``{name: tensor}`` (``tools/convert_checkpoint.read_model_state``: TP = 1
            shapes, vocab rows unpadded or padded).
        cfg: the training config (its ``model`` section gives ``config.json``).
        out: output folder (created; must be empty or absent unless ``force``).
        dtype: ``"bf16"`` or ``"fp32"``: the dtype of the stored weights (and ``config.json``'s dtype).
        max_shard_size: largest safetensors file (e.g. ``"5GB"``, or bytes); above it the weights are sharded.
        tokenizer_model: our SentencePiece ``.model`` to export as the tokenizer, a Hugging Face tokenizer folder
            (``data.tokenizer_type=huggingface``; saved as it is), or None for none.
        force: replace a non-empty ``out``.

    Returns the sorted file names written. Raises HFConversionError (bad dtype, a tokenizer the export cannot
    reproduce, a non-empty output, a state that does not fit ``cfg``).
    """
    import transformers
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig, LlamaConfig

    if dtype not in DTYPES:
        raise HFConversionError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    check_output(out, force)
    hf_state = {k: v.to(DTYPES[dtype]).contiguous() for k, v in to_hf_state(state, cfg.model).items()}
    tmp = _staging(out)
    try:
        dtype_key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        config = LlamaConfig(
            **hf_config_kwargs(cfg.model),
            architectures=["LlamaForCausalLM"],
            **{dtype_key: {"fp32": "float32", "bf16": "bfloat16"}[dtype]},
        )
        config.save_pretrained(str(tmp))
        _keep_top_level_rope_theta(tmp / "config.json", cfg.model.rope_theta)
        GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(str(tmp))
        save_torch_state_dict(hf_state, str(tmp), max_shard_size=max_shard_size, metadata={"format": "pt"})
        if tokenizer_model and Path(tokenizer_model).is_dir():  # a Hugging Face tokenizer folder: as it is
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True).save_pretrained(str(tmp))
        elif tokenizer_model:
            from .hf_tokenizer import save_hf_tokenizer

            save_hf_tokenizer(tokenizer_model, tmp, cfg.model.seq_length, cfg.model.vocab_size)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():  # safetensors files come out 0600; give them the usual permissions
            f.chmod(0o666 & ~umask)
        names = sorted(p.name for p in tmp.iterdir())
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return names


def _load_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards its index lists."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise HFConversionError(
                f"{index} is not a safetensors index ({type(e).__name__}); the folder is damaged"
            ) from None
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".safetensors"))
        hint = (
            f" (found {found[:3]}: save it with safe_serialization=True, e.g. "
            f"model.save_pretrained(DIR), to get safetensors)"
            if found
            else ""
        )
        raise HFConversionError(f"{folder} has no model.safetensors or model.safetensors.index.json{hint}")
    state = {}
    for name in files:
        path = folder / name
        if not path.is_file() or Path(name).name != name:
            raise HFConversionError(f"{folder}: weight file {name!r} (listed in the index) is missing")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise HFConversionError(
                f"{path} could not be read ({type(e).__name__}: {str(e)[:200]}); the file is damaged or incomplete"
            ) from None
    return state


def hf_config_ties(folder: Path) -> bool:
    """Whether ``folder/config.json`` ties the embeddings (False when it cannot be read)."""
    try:
        return tied_embeddings(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return False


def read_hf(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(model overrides, our FP32 global state)`` of a Hugging Face Llama folder.

    The overrides are ``model.*`` values (:func:`.hf.model_overrides_from_hf`); the state has our names and
    unpadded shapes, q/k rows in our RoPE order.

    Raises:
        HFConversionError: not a folder, no/invalid ``config.json``, an unsupported architecture field, missing
            or damaged weight files, or tensors that do not fit the config; each names the value and the fix.
    """
    from ..config import load_config

    if not folder.is_dir():
        raise HFConversionError(
            f"{folder} is not a folder; pass a Hugging Face model folder (config.json + model.safetensors)"
        )
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise HFConversionError(
            f"{folder} has no config.json; pass a Hugging Face model folder (one written by "
            f"save_pretrained or tools/convert_checkpoint.py --to hf)"
        )
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise HFConversionError(f"{cfg_path} is not valid JSON ({e}); the folder is damaged") from None
    model = model_overrides_from_hf(hf_cfg, str(cfg_path))
    cfg = load_config([], [f"model.{k}={v}" for k, v in model.items()])
    return model, from_hf_state(_load_safetensors(folder), cfg.model, str(folder), tied=tied_embeddings(hf_cfg))


def write_checkpoint(
    state: dict[str, torch.Tensor],
    cfg: Config,
    out: Path,
    force: bool = False,
    source: str = "",
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write our global FP32 ``state`` as a checkpoint folder that ``checkpoint.load=out`` resumes.

    ``out`` holds the DCP files and ``meta.json`` (step 0, 0 samples consumed, saved at DP = TP = 1, the
    config ``cfg``, ``source``); there is no optimizer state, so the optimizer starts fresh (the trainer logs
    it). ``extra_files`` (``{name: text}``) are written beside them. One process, no process group.

    Raises:
        HFConversionError: a non-empty ``out`` without ``force``.
    """
    import torch.distributed.checkpoint as dcp

    from .manager import FORMAT, META

    check_output(out, force)
    tmp = _staging(out)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "saving in a single process"
            dcp.save({f"model/{k}": v for k, v in state.items()}, checkpoint_id=str(tmp), no_dist=True)
        meta = {
            "format": FORMAT,
            "step": 0,
            "consumed_samples": 0,
            "dp_size": 1,
            "tp_size": 1,
            "skipped_in_a_row": 0,
            "config": config_to_dict(cfg),
            "geo": None,
            "source": source,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "torch": torch.__version__,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
