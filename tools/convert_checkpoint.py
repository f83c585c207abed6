"""Export a sharded training checkpoint to one consolidated FP32 file (TP = 1) for evaluation.

    python tools/convert_checkpoint.py runs/demo out/demo.pt            # a run dir: its latest checkpoint
    python tools/convert_checkpoint.py runs/demo/checkpoints/step_00000600 out/demo.pt

Runs in one process, whatever DP x TP the checkpoint was saved at: torch.distributed.checkpoint
reads every shard of each ``model/<name>`` entry (the FP32 main params, in the global layout) into one
full tensor. The output format is :mod:`megatron_geo.checkpoint.consolidated` (read it back with
``load_consolidated``; ``tools/eval_downstream.py`` takes it directly). Exit code 2 on bad input.
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
    raise ConfigError(f"{path} holds no complete checkpoint (a step_* folder with meta.json and .metadata, a "
                      f"checkpoints folder, or a run folder with checkpoints/)")


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
        raise ConfigError(f"{ckpt} could not be read ({type(e).__name__}: {first[:300]}); it is damaged or "
                          f"incomplete, convert another step_* folder") from None
    return {k[len("model/"):]: v for k, v in state.items()}


def tokenizer_for(cfg, explicit: str | None) -> str | None:
    """The SentencePiece model used in training: ``--tokenizer``, ``data.tokenizer_model`` or the
    embedded corpus's (prepared again from the package if its cache was removed)."""
    if explicit:
        return explicit
    if cfg.data.source == "indexed":
        return cfg.data.tokenizer_model or None
    from megatron_geo.data import prepare_default_corpus

    return prepare_default_corpus(os.path.expanduser(cfg.data.cache_dir), cfg.model.vocab_size).tokenizer_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", type=Path, help="step_* folder, checkpoints folder, or run folder")
    p.add_argument("output", type=Path, help="consolidated .pt file to write")
    p.add_argument("--tokenizer", help="SentencePiece .model to embed (default: the one the run trained with)")
    p.add_argument("--no-tokenizer", action="store_true", help="embed no tokenizer")
    a = p.parse_args(argv)
    try:
        if a.output.is_dir():
            raise ConfigError(f"output {a.output} is a folder; give a file name, e.g. {a.output / 'model.pt'}")
        ckpt = find_checkpoint(a.checkpoint)
        meta = read_meta(ckpt)
        cfg = config_from_dict(meta["config"], str(ckpt))
        state = read_model_state(ckpt)
        tok = None if a.no_tokenizer else tokenizer_for(cfg, a.tokenizer)
        if tok and not Path(tok).expanduser().is_file():
            raise ConfigError(f"tokenizer {tok} not found; pass --tokenizer PATH")
        out = save_consolidated(a.output, cfg, state, tok)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in state.values())
    print(f"{ckpt} (step {meta['step']}, saved at DP={meta['dp_size']} TP={meta['tp_size']}) -> {out}: "
          f"{len(state)} tensors, {n:,} values, tokenizer {tok or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
