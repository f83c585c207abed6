"""Shared builders for the distributed tests: a tiny config, synthetic batches, model + optimizer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_geo.config import load_config
from megatron_geo.config.schema import GeoConfig
from megatron_geo.geometry import GeoState
from megatron_geo.parallel import ParallelContext, build_groups


def tiny_cfg(*overrides: str):
    base = [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_attention_heads=4",
        "model.num_kv_heads=2",
        "model.ffn_hidden_size=64",
        "model.seq_length=16",
        "model.vocab_size=131",
        "model.make_vocab_size_divisible_by=1",
        "parallel.bucket_size=3000",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "optimizer.lr=1e-2",
        "optimizer.min_lr=1e-2",
        "train.warmup_steps=0",
        "logging.wandb=disabled",
    ]
    return load_config([], base + list(overrides))


def pctx_for(tp: int = 1):
    return build_groups(dist.get_rank(), dist.get_world_size(), tp, torch.device("cpu"), "gloo")


def dp_pctx(dp_size: int, dp_rank: int = 0, group=None, device="cpu") -> ParallelContext:
    """A context of ``dp_size`` DP ranks (TP 1; this one is DP rank ``dp_rank``) that creates no process group:
    ``group`` (None: the default group) stands for every group. For code that runs no collective at that DP size
    (index tables, argument checks) or runs them on a group the test made."""
    return ParallelContext(dp_rank, dp_size, 0, 1, dp_rank, dp_size, group, group, group, torch.device(device), "gloo")


def global_batch(cfg, step: int, seed: int = 0) -> dict:
    """The whole global batch of a step: tokens/labels ``[G, s]`` and an all-ones mask."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    G, s, v = cfg.train.global_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    data = torch.randint(0, v, (G, s + 1), generator=g)
    return {"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": torch.ones(G, s)}


def rank_micro_batches(batch: dict, micro: int, dp_rank: int, dp_size: int) -> list[dict]:
    """Rank ``dp_rank``'s contiguous slice of the global batch, cut into micro-batches (as dp_batch_indices)."""
    G = batch["tokens"].shape[0]
    per = G // dp_size
    lo = dp_rank * per
    return [{k: v[lo + i : lo + i + micro] for k, v in batch.items()} for i in range(0, per, micro)]


def load_tool(name: str):
    """The module of ``tools/<name>.py`` (the tools are scripts, not a package), loaded once per call."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_tool", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_error_line(tool, capsys, *argv) -> str:
    """Run ``tool.main(argv)`` (a tools/ module), assert it exits 2 with exactly one ``error: ...`` line on stderr,
    and return that line."""
    capsys.readouterr()
    assert tool.main([str(a) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def geo_state(model: torch.nn.Module, dp_group=None, *, log=None, roundtrip=None, **geo) -> GeoState:
    """A :class:`~megatron_geo.geometry.GeoState` over ``model`` for ``GeoConfig(statistics="full", **geo)`` (the
    ``geo.*`` keys by their config names), E4M3's FP8 limits, silent unless ``log`` is given."""
    cfg = GeoConfig(**{"statistics": "full", **geo})
    return GeoState(cfg, model, dp_group, log=log or (lambda m: None), roundtrip=roundtrip)
