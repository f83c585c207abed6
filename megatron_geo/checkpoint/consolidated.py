"""A single-file, consolidated (TP = 1, FP32) model checkpoint for evaluation and export.

File layout (``torch.save`` of plain Python containers and tensors, readable with
``torch.load(weights_only=True)``)::

    {"format": "megatron_geo.consolidated", "version": 1,
     "config": config_to_dict(cfg),               # the training config (plain nested dict)
     "model": {name: FP32 CPU tensor},            # Llama(cfg.model, tp_group of size 1).state_dict()
     "tokenizer_model": str | None,               # path of the SentencePiece model used in training
     "tokenizer_proto": bytes | None}             # that file's bytes, so the checkpoint is self-contained

The ``model`` shapes are those of a TP = 1 :class:`megatron_geo.model.llama.Llama`: the embedding and
output layer have ``padded_vocab_size(vocab_size, make_vocab_size_divisible_by, 1)`` rows. Tensors with
exactly ``vocab_size`` rows (the logical, unpadded layout) are accepted too and zero-padded on load
(the padded rows are never used: the embedding of a padded id is never looked up and the padded logits
are excluded from the loss).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

from ..config import Config, ConfigError, config_to_dict, load_config
from ..config.schema import ModelConfig
from ..model.llama import Llama, padded_vocab_size

FORMAT = "megatron_geo.consolidated"
VERSION = 1
_VOCAB_ROWS = ("embed.weight", "output.weight")


class CheckpointError(ValueError):
    """A missing, unreadable or inconsistent consolidated checkpoint; the message names the fix."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of ``Llama(cfg, tp_group of size 1, ...).state_dict()``."""
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_kv_heads * hd
    pv = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, 1)
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (pv, h)}
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (h,),
                p + "attn.q_proj.weight": (q, h),
                p + "attn.k_proj.weight": (kv, h),
                p + "attn.v_proj.weight": (kv, h),
                p + "attn.o_proj.weight": (h, q),
                p + "mlp_norm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
    shapes.update({"norm.weight": (h,), "output.weight": (pv, h)})
    return shapes


def _check_state(state: object, cfg: ModelConfig, where: str) -> dict[str, torch.Tensor]:
    """FP32 CPU copy of ``state`` with unpadded vocab rows padded; CheckpointError on a name/shape mismatch."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: model state must be a dict of tensors, got {type(state).__name__}")
    want = expected_shapes(cfg)
    missing = [k for k in want if k not in state]
    extra = [k for k in state if k not in want]
    if missing or extra:
        raise CheckpointError(
            f"{where}: parameter names do not match a TP=1 Llama with this config (hidden {cfg.hidden_size}, "
            f"{cfg.num_layers} layers): missing {missing[:4]}{'...' if len(missing) > 4 else ''}, "
            f"unexpected {extra[:4]}{'...' if len(extra) > 4 else ''}. Pass the consolidated (TP=1) state dict "
            f"and the config it was trained with"
        )
    out = {}
    for k, shape in want.items():
        t = state[k]
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise CheckpointError(f"{where}: '{k}' must be a floating-point tensor, got {type(t).__name__}")
        if k in _VOCAB_ROWS and t.ndim == 2 and t.shape[0] == cfg.vocab_size and tuple(t.shape[1:]) == shape[1:]:
            t = torch.cat([t.float(), t.new_zeros(shape[0] - t.shape[0], *shape[1:], dtype=torch.float32)])
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{where}: '{k}' has shape {tuple(t.shape)} but the config's model needs {shape} (TP=1, vocab "
                f"padded to {want['embed.weight'][0]}); was it saved from a tensor-parallel shard, or with "
                f"another model config?"
            )
        out[k] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def save_consolidated(
    path: str | os.PathLike, cfg: Config, model_state: dict[str, torch.Tensor], tokenizer_model: str | None = None
) -> Path:
    """Write a consolidated checkpoint (layout in the module docstring) atomically.

    Args:
        path: output file (parent folders are created); written as ``path.tmp-<pid>`` then renamed, so
            a reader never sees a partial file.
        cfg: the training config; stored as a plain dict (``config_to_dict``).
        model_state: the TP=1 Llama state dict (any float dtype, any device; stored FP32 on CPU).
        tokenizer_model: path of the SentencePiece ``.model`` used in training (its bytes are embedded),
            or None.

    Returns the path written. Raises CheckpointError for a state that does not fit ``cfg.model`` and
    FileNotFoundError for a tokenizer path that does not exist.
    """
    path = Path(path)
    state = _check_state(model_state, cfg.model, f"save_consolidated({path})")
    proto = None
    if tokenizer_model:
        tok = Path(tokenizer_model).expanduser()
        if not tok.is_file():
            raise FileNotFoundError(
                f"save_consolidated: tokenizer model '{tokenizer_model}' not found; pass the "
                f"SentencePiece .model file used in training, or None"
            )
        proto = tok.read_bytes()
        tokenizer_model = str(tok.resolve())
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": config_to_dict(cfg),
        "model": state,
        "tokenizer_model": tokenizer_model or None,
        "tokenizer_proto": proto,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_consolidated(path: str | os.PathLike) -> dict:
    """The raw payload dict of a consolidated checkpoint (tensors on CPU), after format checks.

    Raises CheckpointError: missing file, a folder (a sharded checkpoint), not a torch file, or another format.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"'{path}' is a folder (a sharded torch.distributed.checkpoint?); export one file "
            f"with tools/convert_checkpoint.py and pass that (or a Hugging Face folder: --to hf)"
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint '{path}' not found; pass a file written by save_consolidated (tools/convert_checkpoint.py)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a foreign file
        raise CheckpointError(
            f"'{path}' is not a readable consolidated checkpoint ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); export one with "
            f"tools/convert_checkpoint.py"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"'{path}' is not a megatron_geo consolidated checkpoint (format {got!r}, expected "
            f"{FORMAT!r}); export one with tools/convert_checkpoint.py"
        )
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"'{path}': consolidated format version {payload.get('version')!r} is not supported "
            f"(this code reads version {VERSION})"
        )
    return payload


def config_from_dict(d: dict, where: str = "checkpoint") -> Config:
    """A :class:`Config` from ``config_to_dict`` output, through the same checks as a YAML file."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(d, f)
    try:
        return load_config([f.name])
    except ConfigError as e:
        raise CheckpointError(
            f"{where}: stored config does not fit this code's schema: {str(e).replace(f.name, 'config')}"
        ) from None
    finally:
        os.unlink(f.name)


def _tp1_group():
    """A process group of this process alone (creating a world of one over a HashStore if needed)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() == 1:
        return dist.group.WORLD
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def load_consolidated(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Config, Llama]:
    """Read a consolidated checkpoint into ``(Config, Llama)``.

    The model is a TP=1 ``Llama(cfg.model, group, cfg.train.seed)`` in FP32 on ``device``, in eval mode,
    with the stored weights. If torch.distributed is not initialised, a single-process gloo world is
    created (in-memory HashStore, no port); in a larger world the model gets a group of this rank alone.

    Raises CheckpointError: missing file, wrong format/version, or weights that do not fit the stored
    config (names and the first bad shape are given).
    """
    payload = read_consolidated(path)
    cfg = config_from_dict(payload.get("config") or {}, str(path))
    state = _check_state(payload.get("model"), cfg.model, str(path))
    model = Llama(cfg.model, _tp1_group(), cfg.train.seed)
    model.load_state_dict(state, strict=True)
    return cfg, model.to(device).eval()


def tokenizer_path(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str | None:
    """Path of the checkpoint's SentencePiece model: the stored path if that file still has the stored
    bytes, else the embedded bytes written to ``cache_dir`` (default: next to the checkpoint,
    ``<name>.tokenizer.model``, or a temp folder if that is not writable). None if none was stored."""
    payload = read_consolidated(path)
    stored, proto = payload.get("tokenizer_model"), payload.get("tokenizer_proto")
    if stored and Path(stored).is_file() and (proto is None or Path(stored).read_bytes() == proto):
        return stored
    if proto is None:
        return None
    p = Path(path)
    for d in [Path(cache_dir)] if cache_dir else [p.parent, Path(tempfile.gettempdir())]:
        out = d / f"{p.name}.tokenizer.model"
        try:
            d.mkdir(parents=True, exist_ok=True)
            if not out.is_file() or out.read_bytes() != proto:
                out.write_bytes(proto)
            return str(out)
        except OSError:
            continue
    raise CheckpointError(f"cannot write the embedded tokenizer of '{path}'; pass --tokenizer")
