"""Checks of a loaded config that need no process group, run before any distributed work starts.

This module runs them; each section's rules live next to the code that owns the section: the choices of every
``Literal`` key in the schema (:func:`megatron_geo.config.checks.check_choices`), ``parallel``
(:mod:`megatron_geo.parallel.checks`), ``model`` (:mod:`megatron_geo.model.checks`), ``optimizer``
(:mod:`megatron_geo.optim.checks`), ``train`` and ``logging`` (:mod:`.train_config`), ``comm``
(:mod:`megatron_geo.comm.checks`), ``geo`` (:mod:`megatron_geo.geometry.checks`), ``data`` (:mod:`.data_config`)
and ``checkpoint`` (:mod:`megatron_geo.checkpoint.checks`). A setting with a parser of its own next to its owner
(``optimizer.muon_split``, ``optimizer.muon_ns_dtype``, ``train.param_dtype``, ``geo.power``,
``geo.power_search``, ``profiling.steps``) is checked here by calling that parser, never by a second list of its
values."""

from __future__ import annotations

import os

from ..checkpoint.checks import check_checkpoint_config, check_checkpoint_inputs
from ..comm.checks import check_comm_config, comm_inert_keys, fp8_dtypes, wire_format
from ..config.checks import InertRule, check_choices
from ..config.loader import ConfigError, resolve_paths
from ..config.schema import Config, parse_power, parse_power_search
from ..distributed.split_plan import parse_muon_split
from ..geometry.checks import check_geo_config, geo_inert_keys
from ..model.checks import check_model_config
from ..model.llama import param_dtype
from ..optim.checks import check_optimizer_config, optimizer_inert_keys
from ..optim.muon import newton_schulz_dtype
from ..parallel.checks import check_parallel_config, parallel_inert_keys
from .data_config import check_data_paths, data_inert_keys, validate_data_config
from .profiling import parse_profile_steps, profiling_inert_keys
from .train_config import check_device_inputs, check_logging_inputs, check_train_config, train_inert_keys

__all__ = [
    "check_inputs",
    "inert_notes",
    "output_file_problem",
    "parse_power_search",
    "reject_inert_keys",
    "validate_config",
    "wire_format",
]


def validate_config(cfg: Config, world_size: int) -> None:
    """Check ``cfg`` for ``world_size`` processes: every ``Literal`` key's choice, the keys with parsers of their
    own, then each section's rules in the order ``parallel``, ``model``, ``optimizer``, ``comm``, ``geo``,
    ``train``, ``data``, ``checkpoint`` (see the module docstring for where each lives).

    Raises:
        ConfigError: naming the key, the bad value and how to fix it.
    """
    check_choices(cfg)
    o, p, t, g = cfg.optimizer, cfg.parallel, cfg.train, cfg.geo
    newton_schulz_dtype(o, "cpu")  # the device: auto only
    dtype = param_dtype(t)
    parse_muon_split(o.muon_split)
    parse_power(g.power)
    parse_power_search(g.power_search)
    parse_profile_steps(cfg.profiling.steps)
    check_parallel_config(p, world_size, t.device)
    check_model_config(cfg.model, p.tensor)
    check_optimizer_config(o, p.tensor)
    check_comm_config(cfg.comm, dtype)
    check_geo_config(g, cfg.comm, fp8_dtypes())
    check_train_config(t, world_size // p.tensor)
    validate_data_config(cfg)
    check_checkpoint_config(cfg)


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
    ``checkpoint.load`` (a folder); the wandb package unless ``logging.wandb=disabled``. Devices
    (``devices=True``; the Slurm pre-flight check on a login node leaves them out): ``train.device=cuda`` or
    ``parallel.backend=nccl`` without CUDA, ``train.device=auto`` on a process the launcher gave GPUs that CUDA
    cannot use (which would fall back to the CPU), and ``comm.compile`` without a C++ compiler where it needs one.

    Raises:
        ConfigError: naming the key, the value and the fix.
        LaunchError: ``train.device=auto``, GPUs allotted (``SLURM_GPUS_ON_NODE``, ``SLURM_STEP_GPUS`` /
            ``SLURM_JOB_GPUS``, ``CUDA_VISIBLE_DEVICES``) but CUDA unusable on this node (this process's own
            environment: every rank checks its node; the message names the variable and the fix).
    """
    reject_inert_keys(cfg)
    check_data_paths(cfg)
    check_checkpoint_inputs(cfg)
    check_logging_inputs(cfg.logging)
    if devices:
        check_device_inputs(cfg)


def _inert_rules(cfg: Config) -> list[InertRule]:
    """``(keys, the setting that gives them no effect, how to give them one)`` for the settings of ``cfg``, each
    section's rules from its owner, in a fixed order."""
    return [
        *data_inert_keys(cfg.data),
        *comm_inert_keys(cfg.comm),
        *geo_inert_keys(cfg.geo, cfg.comm),
        *optimizer_inert_keys(cfg.optimizer, cfg.parallel.distributed_optimizer),
        *parallel_inert_keys(cfg.parallel),
        *profiling_inert_keys(cfg.profiling),
        *train_inert_keys(cfg.train),
    ]


def _same_setting(key: str, value, default) -> bool:
    """Whether ``value`` means the default (``geo.power`` in any spelling of the same number)."""
    if key == "geo.power":
        return parse_power(value) == parse_power(default)
    return value == default


def _inert_settings(cfg: Config) -> list[tuple[str, str, str, bool]]:
    """``(key=value, the setting that voids it, the fix, whether a comm preset switched it off)`` for every key of
    ``cfg`` set away from its default while its rule gives it no effect (a comm preset sets the ``comm`` and
    ``geo`` sections whole)."""
    defaults = Config()
    resolve_paths(defaults)
    out = []
    for keys, why, fix in _inert_rules(cfg):
        preset = all(k.split(".")[0] in ("comm", "geo") for k in keys)
        for key in keys:
            sec, name = key.split(".")
            value, default = getattr(getattr(cfg, sec), name), getattr(getattr(defaults, sec), name)
            if not _same_setting(key, value, default):
                shown = str(value).lower() if isinstance(value, bool) else value
                out.append((f"{key}={shown}", why, fix, preset))
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
