"""Start-up checks of the ``train`` and ``logging`` sections (before any process group starts): the ``train`` keys
against each other and the data-parallel size, their keys without effect, and what the launch needs of this
machine (the wandb package, CUDA, a C++ compiler for ``comm.compile``)."""

from __future__ import annotations

import importlib.util
import os

from ..config.checks import InertRule, check_positive
from ..config.errors import ConfigError
from ..config.schema import Config, LoggingConfig, TrainConfig

_POSITIVE = ("steps", "global_batch_size", "micro_batch_size", "eval_interval", "log_interval")
_HINTS = {"eval_interval": " (to turn validation off, set train.eval_batches=0)"}


def check_output_folder(key: str, path: str) -> None:
    """``path`` (the value of ``key``) is a folder or can become one: no part of it that exists is a file.

    Raises:
        ConfigError: naming the key, the path, the file in the way and the fix.
    """
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if probe and not os.path.isdir(probe):
        raise ConfigError(f"{key}={path!r}: {probe!r} exists and is not a directory; choose another {key}")


def check_train_config(t: TrainConfig, dp: int) -> None:
    """Check the ``train`` keys for data-parallel size ``dp``.

    Checked: ``steps``, ``global_batch_size``, ``micro_batch_size``, ``eval_interval`` and ``log_interval``
    positive; ``warmup_steps``, ``eval_batches`` and ``exit_interval >= 0``; ``global_batch_size`` a multiple of
    ``micro_batch_size x dp``; ``run_dir`` a folder or free to become one; ``seed`` in ``[0, 2**63)``;
    ``max_skipped_steps >= 1``.

    Raises:
        ConfigError: naming the key, the bad value and the fix.
    """
    check_positive("train", t, _POSITIVE, _HINTS)
    if t.warmup_steps < 0 or t.eval_batches < 0:
        raise ConfigError("train.warmup_steps and train.eval_batches must be >= 0")
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
            f"{t.micro_batch_size} x data-parallel size {dp} (= {t.micro_batch_size * dp}); pick a global batch "
            f"that is a multiple of {t.micro_batch_size * dp}"
        )
    check_output_folder("train.run_dir", t.run_dir)
    if t.exit_interval < 0:
        raise ConfigError(f"train.exit_interval={t.exit_interval} must be >= 0 (0 disables it)")
    if not 0 <= t.seed < 2**63:  # torch.manual_seed and the data shuffle's numpy generator take this range
        raise ConfigError(f"train.seed={t.seed} must be in [0, 2**63); choose another seed")
    if t.max_skipped_steps < 1:
        raise ConfigError(f"train.max_skipped_steps={t.max_skipped_steps} must be >= 1")


def train_inert_keys(t: TrainConfig) -> list[InertRule]:
    """The ``train`` keys that the settings give no effect: ``max_skipped_steps`` with ``nonfinite=stop``,
    ``autocast_dtype`` with ``device=cpu``."""
    rules: list[InertRule] = []
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


def check_logging_inputs(lg: LoggingConfig) -> None:
    """``logging.wandb`` other than ``disabled`` needs the wandb package.

    Raises:
        ConfigError: naming the setting and the two fixes.
    """
    if lg.wandb != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"logging.wandb={lg.wandb} needs the wandb package, which this Python does not "
            f"have; install it (pip install 'wandb>=0.17') or set logging.wandb=disabled "
            f"(metrics.jsonl is written either way)"
        )


def check_device_inputs(cfg: Config) -> None:
    """The devices the config asks for exist on this machine: CUDA for ``train.device=cuda`` or
    ``parallel.backend=nccl``; with ``train.device=auto``, CUDA usable where the launcher allotted GPUs; a C++
    compiler where ``comm.compile`` compiles a scaled codec on the CPU.

    Raises:
        ConfigError: naming the key, the value and the fix.
        LaunchError: GPUs allotted but CUDA unusable
            (:func:`megatron_geo.parallel.launch_env.require_cuda_if_allotted`).
    """
    import torch

    from ..comm.checks import wire_format
    from ..comm.compiled import compiler_problem, resolve_compile
    from ..parallel.launch_env import require_cuda_if_allotted

    t = cfg.train
    require_cuda_if_allotted(t.device)
    if (t.device == "cuda" or cfg.parallel.backend == "nccl") and not torch.cuda.is_available():
        key = "train.device=cuda" if t.device == "cuda" else "parallel.backend=nccl"
        raise ConfigError(
            f"{key} but CUDA is not available on this machine (torch {torch.__version__}); run on a "
            f"GPU node with a CUDA build of torch, or use train.device=cpu and parallel.backend=auto "
            f"(or gloo)"
        )
    if wire_format(cfg.comm).scaled:  # the scaled codecs are what comm.compile compiles
        dev = "cuda" if t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available()) else "cpu"
        problem = compiler_problem(dev) if resolve_compile(cfg.comm.compile, dev) else None
        if problem:
            raise ConfigError(
                f"comm.compile={cfg.comm.compile}: {problem}; install g++ (or point CXX at a C++ "
                f"compiler) or use comm.compile=false"
            )
