"""Small data and state-gathering helpers for the checkpoint tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def make_corpus(root: Path, vocab_size: int = 96) -> list[str]:
    """A tokenizer and train/valid indexed datasets in ``root``; returns the config overrides that use them."""
    from megatron_geo.data import IndexedDatasetBuilder, Tokenizer, train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa", "theta", "lambda", "zeta"]
    lines = [" ".join(rng.choice(words) + str(rng.randrange(40)) for _ in range(12)) for _ in range(600)]
    (root / "text.txt").write_text("\n".join(lines))
    model = train_tokenizer([str(root / "text.txt")], str(root / "tok"), vocab_size=vocab_size)
    tok = Tokenizer(model)
    for split, part in (("train", lines[:500]), ("valid", lines[500:])):
        with IndexedDatasetBuilder(str(root / split), vocab_size=tok.vocab_size) as b:
            for line in part:
                b.add_document(tok.encode(line) + [tok.eod_id])
    return ["data.source=indexed", f"data.train_prefix={root}/train", f"data.valid_prefix={root}/valid",
            f"data.tokenizer_model={model}", f"model.vocab_size={tok.vocab_size}"]


def tiny_train_overrides(run_dir: Path, data: list[str], *extra: str) -> list[str]:
    return ["model.hidden_size=32", "model.num_layers=2", "model.num_attention_heads=4", "model.num_kv_heads=2",
            "model.ffn_hidden_size=64", "model.seq_length=16", "model.make_vocab_size_divisible_by=1",
            "parallel.bucket_size=3000", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.warmup_steps=2", "train.eval_interval=4", "train.eval_batches=1", "train.progress=false",
            "logging.wandb=disabled", f"train.run_dir={run_dir}", *data, *extra]


def train_jobs(rank, world, jobs):
    """``run_distributed`` worker: train each override list of ``jobs`` in turn; returns the train results."""
    from megatron_geo.config import load_config, validate_config
    from megatron_geo.training.trainer import train

    from helpers import pctx_for

    out = []
    for overrides in jobs:
        cfg = load_config([], overrides)
        validate_config(cfg, world)
        out.append(train(cfg, pctx_for(cfg.parallel.tensor)))
    return out


def local_state(optimizer) -> list[dict]:
    """Every main param piece of this rank with its optimizer state (for reassembly in the parent)."""
    out = []
    for m in optimizer.mains:
        st = optimizer.optimizer_of(m).state.get(m.main, {})
        out.append({"name": m.name, "start": m.param_start, "shape": tuple(m.param.shape),
                    "partition_dim": getattr(m.param, "partition_dim", None)
                    if getattr(m.param, "tensor_model_parallel", False) else None,
                    "main": m.main.detach().reshape(-1).clone(),
                    "state": {k: (v.detach().reshape(-1).clone() if v.numel() == m.main.numel() else v.clone())
                              for k, v in st.items()}})
    return out


def assemble(per_rank: list[list[dict]], tp_size: int, vocab_rows: int | None = None) -> dict:
    """Full (TP = 1, unpadded) tensors ``{name: {"main": t, "<state>": t}}`` from every rank's pieces.

    ``per_rank[rank]`` lists the pieces of global rank ``rank = dp_rank * tp_size + tp_rank``. Pieces are
    placed into TP-local flat tensors, which are concatenated along the partition dim (torch.cat).
    """
    local: dict[tuple[str, int], dict] = {}
    meta: dict[str, tuple] = {}
    for rank, pieces in enumerate(per_rank):
        tp_rank = rank % tp_size
        for pc in pieces:
            numel = 1
            for s in pc["shape"]:
                numel *= s
            entry = local.setdefault((pc["name"], tp_rank), {})
            meta[pc["name"]] = (pc["shape"], pc["partition_dim"])
            for key, val in [("main", pc["main"])] + [(k, v) for k, v in pc["state"].items() if v.dim() > 0]:
                flat = entry.setdefault(key, torch.full((numel,), float("nan"), dtype=val.dtype))
                flat[pc["start"]:pc["start"] + val.numel()] = val
            for k, v in pc["state"].items():
                if v.dim() == 0:
                    entry["scalar_" + k] = v.item()
    out = {}
    for name, (shape, pdim) in meta.items():
        keys = local[(name, 0)].keys()
        full = {}
        for key in keys:
            if key.startswith("scalar_"):
                full[key] = local[(name, 0)][key]
                continue
            if pdim is None:
                t = local[(name, 0)][key].view(shape)
            else:
                t = torch.cat([local[(name, r)][key].view(shape) for r in range(tp_size)], dim=pdim)
            if vocab_rows is not None and name in ("embed.weight", "output.weight"):
                t = t[:vocab_rows]
            full[key] = t
        out[name] = full
    return out
