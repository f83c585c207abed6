"""Cross-field checks of a loaded config that need no process group, run before any distributed work starts.

They live above ``config`` (like Megatron-LM's argument validation in its training package) because they consult
the wire-format registry, the checkpoint folder, the data files and the launch environment. A setting with a parser
of its own next to its owner (``optimizer.muon_split``, ``optimizer.muon_ns_dtype``, ``train.param_dtype``,
``geo.power``) is checked here by calling that parser, never by a second list of its values; the keys with a fixed
set of values are ``Literal`` fields of the schema, checked by :func:`megatron_geo.config.checks.check_choices`."""

from __future__ import annotations

import dataclasses
import math
import os

from ..comm.param_codec import check_param_gather
from ..config.checks import check_choices
from ..config.loader import ConfigError, resolve_paths
from ..config.schema import Config, parse_power, parse_power_search
from ..distributed.split_plan import parse_muon_split
from ..model.llama import param_dtype
from ..optim.muon import newton_schulz_dtype

_POSITIVE = [
    ("model", "hidden_size"),
    ("model", "num_layers"),
    ("model", "num_attention_heads"),
    ("model", "num_kv_heads"),
    ("model", "ffn_hidden_size"),
    ("model", "seq_length"),
    ("model", "vocab_size"),
    ("model", "make_vocab_size_divisible_by"),
    ("parallel", "tensor"),
    ("parallel", "bucket_size"),
    ("train", "steps"),
    ("train", "global_batch_size"),
    ("train", "micro_batch_size"),
    ("train", "eval_interval"),
    ("train", "log_interval"),
]


def validate_config(cfg: Config, world_size: int) -> None:
    """Check choices, positivity and size compatibility for ``world_size`` processes.

    Raises:
        ConfigError: naming the key, the bad value and how to fix it.
    """
    check_choices(cfg)  # every Literal key of the schema
    newton_schulz_dtype(cfg.optimizer, "cpu")  # the device: auto only
    param_dtype(cfg.train)
    fmt = wire_format(cfg.comm)
    for sec, key in _POSITIVE:
        v = getattr(getattr(cfg, sec), key)
        if v <= 0:
            hint = " (to turn validation off, set train.eval_batches=0)" if key == "eval_interval" else ""
            raise ConfigError(f"{sec}.{key}={v} must be positive{hint}")
    m, p, t, c = cfg.model, cfg.parallel, cfg.train, cfg.comm
    o = cfg.optimizer
    parse_muon_split(o.muon_split)
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise ConfigError(f"optimizer.lr={o.lr} must be a positive finite number")
    if not (math.isfinite(o.min_lr) and 0 <= o.min_lr <= o.lr):
        raise ConfigError(f"optimizer.min_lr={o.min_lr} must be between 0 and optimizer.lr={o.lr}")
    for name, v in (("beta1", o.beta1), ("beta2", o.beta2), ("muon_momentum", o.muon_momentum)):
        if not 0 <= v < 1:
            raise ConfigError(f"optimizer.{name}={v} must be in [0, 1)")
    for name, v in (("weight_decay", o.weight_decay), ("clip_grad", o.clip_grad)):
        if not (math.isfinite(v) and v >= 0):
            raise ConfigError(f"optimizer.{name}={v} must be >= 0 (clip_grad=0 turns clipping off)")
    if not o.eps > 0:
        raise ConfigError(f"optimizer.eps={o.eps} must be > 0")
    for name, v in (("comm.block_size", c.block_size), ("comm.hadamard_block", c.hadamard_block)):
        if v <= 0 or v & (v - 1):
            raise ConfigError(f"{name}={v} must be a positive power of two (e.g. 128)")
    fmt.check(c)  # the wire format's own rules (error feedback, rounding, scaling, scale sync, wire_sum)
    check_param_gather(c, param_dtype(t))  # comm.param_gather: a known value that fits train.param_dtype
    g = cfg.geo
    if c.transform == "geo":
        if g.select == "auto" and (g.num_layers < 1 or g.profile_steps < 1):
            raise ConfigError(
                f"geo.select=auto needs geo.num_layers={g.num_layers} >= 1 and geo.profile_steps={g.profile_steps} >= 1"
            )
        if g.select == "gain" and g.num_layers < 1:
            raise ConfigError(
                f"geo.select=gain needs geo.num_layers={g.num_layers} >= 1 (how many layers keep the transform)"
            )
        if fmt.fp8_max is None and g.select == "auto":
            from ..comm.formats import FORMATS

            fp8 = " or ".join(f.name for f in FORMATS.values() if f.fp8_max is not None)
            raise ConfigError(f"geo.select=auto profiles FP8 bound hits; use comm.dtype={fp8}")
        if g.sketch_size < g.rank:
            raise ConfigError(f"geo.sketch_size={g.sketch_size} must be >= geo.rank={g.rank}")
        for key, v in (("rank", g.rank), ("refresh_interval", g.refresh_interval)):
            if v < 1:
                raise ConfigError(f"geo.{key}={v} must be >= 1")
        if not g.damping > 0:
            raise ConfigError(f"geo.damping={g.damping} must be > 0 (relative to the mean eigenvalue of A, e.g. 1e-3)")
    # checked with any transform, so that a typo is not silently carried in config.yaml
    parse_power(g.power)
    parse_power_search(g.power_search)
    if c.reduce_op != "wire_sum" and not c.wire_sum_prediv:
        raise ConfigError(
            "comm.wire_sum_prediv=false only changes comm.reduce_op=wire_sum; set comm.reduce_op="
            "wire_sum as well, or drop comm.wire_sum_prediv"
        )
    if t.warmup_steps < 0 or t.eval_batches < 0:
        raise ConfigError("train.warmup_steps and train.eval_batches must be >= 0")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={m.num_attention_heads}"
        )
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError(f"head dim {m.hidden_size // m.num_attention_heads} must be even for RoPE")
    if m.num_attention_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}"
        )
    if world_size % p.tensor:
        raise ConfigError(
            f"world size {world_size} is not divisible by parallel.tensor={p.tensor}; launch a multiple of "
            f"{p.tensor} processes or change parallel.tensor"
        )
    for name, v in (
        ("num_attention_heads", m.num_attention_heads),
        ("num_kv_heads", m.num_kv_heads),
        ("ffn_hidden_size", m.ffn_hidden_size),
    ):
        if v % p.tensor:
            raise ConfigError(f"model.{name}={v} is not divisible by parallel.tensor={p.tensor}")
    dp = world_size // p.tensor
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel size {dp} (= {t.micro_batch_size * dp}); pick a global batch "
            f"that is a multiple of {t.micro_batch_size * dp}"
        )
    if cfg.optimizer.name == "muon" and p.tensor > 1:
        raise ConfigError(
            "optimizer.name=muon with parallel.tensor>1 is not supported: Muon orthogonalizes whole matrices and this "
            "release does not gather TP shards for it. Use parallel.tensor=1 with muon, or optimizer.name=adamw with TP"
        )
    if p.backend == "nccl" and t.device == "cpu":
        raise ConfigError("parallel.backend=nccl needs CUDA; use parallel.backend=gloo (or auto) with train.device=cpu")
    for name, path in (("train.run_dir", t.run_dir), ("data.cache_dir", cfg.data.cache_dir)):
        probe = path
        while probe and not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if probe and not os.path.isdir(probe):
            raise ConfigError(f"{name}={path!r}: {probe!r} exists and is not a directory; choose another {name}")
    ck = cfg.checkpoint
    if t.exit_interval < 0:
        raise ConfigError(f"train.exit_interval={t.exit_interval} must be >= 0 (0 disables it)")
    if cfg.comm.telemetry_interval < 0:
        raise ConfigError(f"comm.telemetry_interval={cfg.comm.telemetry_interval} must be >= 0 (0 disables it)")
    for key in ("interval", "keep_latest"):
        if getattr(ck, key) < 0:
            raise ConfigError(
                f"checkpoint.{key}={getattr(ck, key)} must be >= 0 (checkpoint.interval=0: no periodic "
                f"saves; checkpoint.keep_latest=0: keep all)"
            )
    if not 0 <= t.seed < 2**63:  # torch.manual_seed and the data shuffle's numpy generator take this range
        raise ConfigError(f"train.seed={t.seed} must be in [0, 2**63); choose another seed")
    if t.max_skipped_steps < 1:
        raise ConfigError(f"train.max_skipped_steps={t.max_skipped_steps} must be >= 1")
    if not ck.load:
        raise ConfigError("checkpoint.load is empty; use auto, latest, none or a checkpoint folder")
    if ck.load not in ("auto", "latest", "none") and not os.path.isdir(ck.load) and not _has_own_checkpoint(cfg):
        raise ConfigError(
            f"checkpoint.load={ck.load!r} is not a folder; use auto, latest, none or the path of a "
            f"checkpoint folder (e.g. {t.run_dir}/checkpoints/step_00000100)"
        )
    from ..checkpoint.resume_changes import parse_allow_changes

    parse_allow_changes(ck.allow_changes)
    if not (math.isfinite(p.timeout_minutes) and p.timeout_minutes > 0):
        raise ConfigError(f"parallel.timeout_minutes={p.timeout_minutes} must be a positive number of minutes")
    from .data_config import validate_data_config
    from .profiling import parse_profile_steps

    validate_data_config(cfg)
    parse_profile_steps(cfg.profiling.steps)


def wire_format(comm):
    """The registered wire format of ``comm.dtype`` (:func:`megatron_geo.comm.formats.get_format`).

    Raises:
        ConfigError: an unknown ``comm.dtype``; the message lists the registered formats.
    """
    from ..comm.formats import get_format

    try:
        return get_format(comm.dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _has_own_checkpoint(cfg: Config) -> bool:
    """Whether the run folder holds a complete checkpoint of its own (which a relaunch resumes whatever an
    explicit ``checkpoint.load`` names, so that path may be gone)."""
    from ..checkpoint.manager import checkpoint_root, latest_checkpoint

    return latest_checkpoint(checkpoint_root(cfg)) is not None


def output_file_problem(flag: str, path: str | None) -> str | None:
    """Why a tool could not write ``path`` given by ``flag`` (its folder is missing), or None: checked before
    any work so that a long run does not fail at its end."""
    if path and not os.path.isdir(os.path.dirname(os.path.abspath(os.path.expanduser(path)))):
        return f"{flag} {path}: the folder {os.path.dirname(path)!r} does not exist; create it or choose another path"
    return None


def check_inputs(cfg: Config, devices: bool = True) -> None:
    """Every file and device the config names, checked before any process group starts (bad input is
    one clear error, not a traceback on every rank).

    First :func:`reject_inert_keys` (a key that the other settings give no effect). Files: every prefix of
    ``data.train_prefix`` / ``train_blend`` / ``valid_prefix`` / ``valid_blend`` (``.bin`` and ``.idx``) and
    ``data.tokenizer_model`` with ``data.source=indexed`` (a Hugging Face tokenizer's folder with either source),
    ``checkpoint.load`` (a folder). Devices
    (``devices=True``; the Slurm pre-flight check on a login node leaves them out): ``train.device=cuda`` or
    ``parallel.backend=nccl`` without CUDA, and ``train.device=auto`` on a process the launcher gave GPUs that CUDA
    cannot use (which would fall back to the CPU).

    Raises:
        ConfigError: naming the key, the value and the fix.
        LaunchError: ``train.device=auto``, GPUs allotted (``SLURM_GPUS_ON_NODE``, ``SLURM_STEP_GPUS`` /
            ``SLURM_JOB_GPUS``, ``CUDA_VISIBLE_DEVICES``) but CUDA unusable on this node (this process's own
            environment: every rank checks its node; the message names the variable and the fix).
    """
    reject_inert_keys(cfg)
    d = cfg.data
    if d.source == "indexed":
        from .data_config import data_files

        for key, prefix in data_files(cfg):
            missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ConfigError(
                    f"{key}={prefix!r}: {' and '.join(repr(m) for m in missing)} not found; write them with "
                    f"tools/preprocess_data.py --output-prefix {prefix} or fix the path"
                )
            from ..data.indexed_dataset import check_dataset_files

            check_dataset_files(key, prefix)  # format, header and sizes of both files
        if d.tokenizer_type == "sentencepiece" and d.tokenizer_model and not os.path.exists(d.tokenizer_model):
            raise ConfigError(
                f"data.tokenizer_model={d.tokenizer_model!r} not found; train one with "
                f"tools/train_tokenizer.py or fix the path"
            )
    if d.tokenizer_type == "huggingface":  # with either source: the embedded corpus is tokenized with it too
        from ..data.hf_tokenizer import check_tokenizer_folder

        check_tokenizer_folder(d.tokenizer_model, "data.tokenizer_model")
    ck = cfg.checkpoint.load
    if ck not in ("auto", "latest", "none", "") and not os.path.isdir(ck) and not _has_own_checkpoint(cfg):
        raise ConfigError(
            f"checkpoint.load={ck!r} is not a folder; use auto, latest, none or an existing checkpoint folder"
        )
    if cfg.logging.wandb != "disabled":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(
                f"logging.wandb={cfg.logging.wandb} needs the wandb package, which this Python does not "
                f"have; install it (pip install 'wandb>=0.17') or set logging.wandb=disabled "
                f"(metrics.jsonl is written either way)"
            )
    if devices:
        import torch

        from ..parallel.launch_env import require_cuda_if_allotted

        require_cuda_if_allotted(cfg.train.device)
        wants_cuda = cfg.train.device == "cuda" or cfg.parallel.backend == "nccl"
        if wants_cuda and not torch.cuda.is_available():
            key = "train.device=cuda" if cfg.train.device == "cuda" else "parallel.backend=nccl"
            raise ConfigError(
                f"{key} but CUDA is not available on this machine (torch {torch.__version__}); run on a "
                f"GPU node with a CUDA build of torch, or use train.device=cpu and parallel.backend=auto "
                f"(or gloo)"
            )
        if wire_format(cfg.comm).scaled:  # the scaled codecs are what comm.compile compiles
            from ..comm.compiled import compiler_problem, resolve_compile

            dev = (
                "cuda"
                if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
                else "cpu"
            )
            problem = compiler_problem(dev) if resolve_compile(cfg.comm.compile, dev) else None
            if problem:
                raise ConfigError(
                    f"comm.compile={cfg.comm.compile}: {problem}; install g++ (or point CXX at a C++ "
                    f"compiler) or use comm.compile=false"
                )


def _inert_rules(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """``(keys, the setting that gives them no effect, how to give them one)`` for the settings of ``cfg``."""
    c, g, d, o, t = cfg.comm, cfg.geo, cfg.data, cfg.optimizer, cfg.train
    rules: list[tuple[tuple[str, ...], str, str]] = []
    if d.source == "shakespeare":
        # a Hugging Face tokenizer tokenizes the embedded corpus: its folder is then in use
        tok_key = ("data.tokenizer_model",) if d.tokenizer_type == "sentencepiece" else ()
        rules.append(
            (
                (
                    "data.train_prefix",
                    "data.valid_prefix",
                    *tok_key,
                    "data.train_blend",
                    "data.valid_blend",
                    "data.split",
                ),
                "data.source=shakespeare (the embedded corpus)",
                "set data.source=indexed to train on your files",
            )
        )
    if d.source == "indexed":
        rules.append(
            (
                ("data.cache_dir",),
                "data.source=indexed (only the embedded corpus is prepared there)",
                "set data.source=shakespeare",
            )
        )
    fmt = wire_format(c)
    if not fmt.scaled:
        rules.append((("comm.scaling",), f"comm.dtype={c.dtype} (sent unscaled)", "use an fp8 comm.dtype"))
    if not (c.scaling == "block" and fmt.block_scaling):
        rules.append(
            (
                ("comm.block_size",),
                f"comm.scaling={c.scaling} and comm.dtype={c.dtype}",
                "set comm.scaling=block with an fp8 comm.dtype",
            )
        )
    if c.transform != "hadamard":
        rules.append((("comm.hadamard_block",), f"comm.transform={c.transform}", "set comm.transform=hadamard"))
    if c.transform != "geo":
        rules.append(
            (
                tuple(f"geo.{f.name}" for f in dataclasses.fields(g)),
                f"comm.transform={c.transform}",
                "set comm.transform=geo",
            )
        )
    else:
        if g.select == "layers":
            rules.append(
                (("geo.num_layers",), "geo.select=layers (geo.layers alone chooses)", "set geo.select=auto or gain")
            )
        if g.select != "auto":
            rules.append(
                (("geo.profile_steps",), f"geo.select={g.select} (nothing is profiled)", "set geo.select=auto")
            )
        if parse_power_search(g.power_search):
            rules.append(
                (
                    ("geo.power",),
                    f"geo.power_search={g.power_search} (the search picks each layer's power)",
                    "drop geo.power_search",
                )
            )
        if g.statistics == "full":
            rules.append((("geo.sketch_size",), "geo.statistics=full", "set geo.statistics=sketch or auto"))
        if not c.error_feedback:
            rules.append(
                (
                    ("geo.ef_on_refresh",),
                    "comm.error_feedback=false (no residual to carry over)",
                    "set comm.error_feedback=true",
                )
            )
    if o.name == "adamw":
        rules.append(
            (
                (
                    "optimizer.muon_momentum",
                    "optimizer.muon_adjust_lr_fn",
                    "optimizer.muon_ns_dtype",
                    "optimizer.muon_ns",
                    "optimizer.muon_overlap",
                    "optimizer.muon_split",
                    "optimizer.adamw_lr",
                ),
                "optimizer.name=adamw",
                "set optimizer.name=muon",
            )
        )
    if not cfg.parallel.distributed_optimizer and o.name == "muon":
        rules.append(
            (
                ("optimizer.muon_split",),
                "parallel.distributed_optimizer=false (every rank orthogonalises every matrix whole)",
                "set parallel.distributed_optimizer=true",
            )
        )
    if not cfg.parallel.distributed_optimizer:
        rules.append(
            (
                ("comm.param_gather",),
                "parallel.distributed_optimizer=false (nothing is gathered)",
                "set parallel.distributed_optimizer=true",
            )
        )
        rules.append(
            (
                ("parallel.overlap_param_gather",),
                "parallel.distributed_optimizer=false (nothing is gathered)",
                "set parallel.distributed_optimizer=true",
            )
        )
    if not cfg.profiling.steps.strip():
        rules.append(
            (
                ("profiling.memory_snapshot",),
                "profiling.steps empty (no profiling window)",
                "set profiling.steps=START:END",
            )
        )
    if t.nonfinite == "stop":
        rules.append(
            (
                ("train.max_skipped_steps",),
                "train.nonfinite=stop (the first non-finite step stops the run)",
                "set train.nonfinite=skip",
            )
        )
    if t.device == "cpu":
        rules.append(
            (
                ("train.autocast_dtype",),
                "train.device=cpu (autocast runs on CUDA only)",
                "set train.device=auto or cuda",
            )
        )
    return rules


def _same_setting(key: str, value, default) -> bool:
    """Whether ``value`` means the default (``geo.power`` in any spelling of the same number)."""
    if key == "geo.power":
        return parse_power(value) == parse_power(default)
    return value == default


def _preset_section(keys: tuple[str, ...]) -> bool:
    """Whether a rule's keys all belong to the sections a comm preset sets whole (``comm``, ``geo``)."""
    return all(k.split(".")[0] in ("comm", "geo") for k in keys)


def _inert_settings(cfg: Config) -> list[tuple[str, str, str, bool]]:
    """``(key=value, the setting that voids it, the fix, whether a comm preset switched it off)`` for every key of
    ``cfg`` set away from its default while its rule gives it no effect."""
    defaults = Config()
    resolve_paths(defaults)
    out = []
    for keys, why, fix in _inert_rules(cfg):
        for key in keys:
            sec, name = key.split(".")
            value, default = getattr(getattr(cfg, sec), name), getattr(getattr(defaults, sec), name)
            if not _same_setting(key, value, default):
                shown = str(value).lower() if isinstance(value, bool) else value
                out.append((f"{key}={shown}", why, fix, _preset_section(keys)))
    return out


def inert_notes(cfg: Config) -> list[str]:
    """The notes of :func:`reject_inert_keys` (comm/geo keys the chosen comm preset switches off), never raising:
    for the start-up log and ``config.yaml`` of a run whose config was checked at launch (or built by a tool)."""
    return [
        f"{s} has no effect with {why} (recorded, not used)" for s, why, _, preset in _inert_settings(cfg) if preset
    ]


def reject_inert_keys(cfg: Config) -> list[str]:
    """A key set away from its default while the other settings give it no effect is an error, never ignored
    (e.g. ``data.train_prefix`` with ``data.source=shakespeare``, ``optimizer.muon_*`` with
    ``optimizer.name=adamw``): a user who set it believes it shapes what is trained. A key at its default, in any
    spelling, passes, so a resolved ``config.yaml`` (which lists every key) loads again.

    The exception is a ``comm`` / ``geo`` key that the chosen comm preset switches off (``geo.*`` on ``bf16``,
    ``comm.block_size`` with tensor scaling): a comparison of presets passes one list of overrides to every run, so
    such keys are returned as notes, which the trainer logs at start-up and records in ``config.yaml``
    (``x-inert_keys``), instead of refusing the sweep.

    Left alone on purpose: keys that a switch documented as "off" voids while a shipped model config sets them
    (``train.eval_interval`` with ``train.eval_batches=0``, ``optimizer.min_lr`` with
    ``train.lr_decay_style=constant``, ``logging.wandb_*`` with ``logging.wandb=disabled``), and per-bucket or
    per-codec options that a sweep passes to every mode (``comm.compile``, ``comm.telemetry_interval``).

    Returns:
        One line per inert comm/geo key: ``key=value has no effect with <setting> (recorded, not used)``.

    Raises:
        ConfigError: naming the first other such key, its value, the setting that voids it and the fix.
    """
    for setting, why, fix, preset in _inert_settings(cfg):
        if not preset:
            key = setting.split("=")[0]
            raise ConfigError(f"{setting} has no effect with {why}; drop {key} or {fix}")
    return inert_notes(cfg)
