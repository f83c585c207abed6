"""Dataclass schema of the resolved training config.

Every key a YAML file or a ``dotted.key=value`` override may set is a field here; the loader
(:mod:`megatron_geo.config.loader`) rejects anything else. Sections mirror the architecture in
docs/configuration.md. A YAML null (or a ``key=null`` override) sets a key to the default written here.

A key whose text has a meaning beyond its type is parsed by one function, next to its section here when the config
layer itself needs it (``geo.power``: :func:`parse_power`, which the label and the comm-preset comparison use too)
or next to the code that uses it otherwise (``optimizer.muon_split``: ``distributed/split_plan.py``;
``optimizer.muon_ns_dtype``: ``optim/muon.py``; ``train.param_dtype``: ``model/llama.py``); validation and every
reader call that function.

A key with a fixed set of values is a ``Literal`` field: its values are written here and nowhere else. The loader
refuses any other value when it reads the key, :func:`megatron_geo.config.checks.check_choices` checks a config
built in code, and code that needs the list reads it with :func:`~megatron_geo.config.checks.choices_of`.

Path-valued keys are declared with :func:`path_field`: the loader expands ``~`` and ``$VAR`` in them once,
when the config is resolved, so every later reader (and the dumped ``config.yaml``) sees the final path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from .errors import ConfigError


def path_field(default: str, *, required: bool, keywords: tuple[str, ...] = ()):
    """A ``str`` field holding a filesystem path.

    Args:
        default: the default path (may start with ``~``).
        required: an empty value is a config error (else empty means "not given").
        keywords: values that are words, not paths (e.g. ``auto``); they are left as written.
    """
    return field(default=default, metadata={"path": True, "required": required, "keywords": keywords})


@dataclass
class ModelConfig:
    """Llama shape. ``vocab_size`` is the tokenizer's vocab; the model pads it (see ``padded_vocab_size``)."""

    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    ffn_hidden_size: int = 384
    seq_length: int = 128
    vocab_size: int = 2048
    make_vocab_size_divisible_by: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    transformer_impl: Literal["local", "transformer_engine"] = "local"


@dataclass
class ParallelConfig:
    """Process layout: world = tensor x data. ``bucket_size`` is in elements (Megatron's unit)."""

    tensor: int = 1
    distributed_optimizer: bool = True
    bucket_size: int = 4_000_000
    overlap_grad_reduce: bool = True
    # start each bucket's parameter gather right after the update and wait for it in a forward pre-hook of
    # its first module (Megatron's overlap_param_gather); auto = on with CUDA, off on CPU
    overlap_param_gather: Literal["auto", "true", "false"] = "auto"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_minutes: float = 30.0


@dataclass
class OptimizerConfig:
    """``name``: adamw (everything) or muon (Muon on 2-D hidden matrices, AdamW on the rest)."""

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    muon_momentum: float = 0.95
    muon_adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    muon_ns_dtype: str = "auto"  # auto: bf16 (torch.optim.Muon) on CUDA, fp32 on CPU
    # Newton-Schulz form: quintic (torch.optim.Muon's) or gram (same result, on X X^T)
    muon_ns: Literal["quintic", "gram"] = "quintic"
    muon_split: str = "auto"  # split Muon matrices by rows over DP groups: auto (where it saves time), off, 2..
    muon_overlap: bool = True  # orthogonalise each owned Muon matrix when its bucket is reduced (bitwise the same)
    adamw_lr: float = -1.0  # learning rate of the AdamW part under muon; <0 means same as lr
    clip_grad: float = 1.0


@dataclass
class TrainConfig:
    """Batch sizes are in samples of ``model.seq_length`` tokens; intervals are in optimizer steps."""

    steps: int = 200
    global_batch_size: int = 16
    micro_batch_size: int = 4
    warmup_steps: int = 20
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    eval_interval: int = 50
    eval_batches: int = 4
    log_interval: int = 1
    seed: int = 1234
    run_dir: str = path_field("runs/default", required=True)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    param_dtype: str = "fp32"
    autocast_dtype: Literal["auto", "none", "bf16"] = "auto"
    progress: bool = True
    # skip: skip the update on all ranks and log it | stop: stop with an error
    nonfinite: Literal["skip", "stop"] = "skip"
    compile: bool = False  # torch.compile each transformer block (inductor on CUDA, eager backend on CPU)
    exit_interval: int = 0  # save a checkpoint and exit (code 0) when the step is a multiple of this; 0: off
    max_skipped_steps: int = 10  # this many consecutive skipped steps stop the run (after a last checkpoint)


@dataclass
class DataConfig:
    """``source=shakespeare`` prepares the embedded corpus on first use; ``indexed`` reads your own files."""

    source: Literal["shakespeare", "indexed"] = "shakespeare"
    cache_dir: str = path_field("~/.cache/megatron_geo", required=True)
    train_prefix: str = path_field("", required=False)
    valid_prefix: str = path_field("", required=False)
    tokenizer_model: str = path_field("", required=False)
    # sentencepiece: tokenizer_model is a SentencePiece .model | huggingface: a folder AutoTokenizer loads
    # (tokenizer.json; Megatron-LM's --tokenizer-type HuggingFaceTokenizer), also with source=shakespeare
    tokenizer_type: Literal["sentencepiece", "huggingface"] = "sentencepiece"
    # Megatron-LM's --data-path spelling: "0.3 PREFIX_A 0.7 PREFIX_B" (weights normalised) or prefixes alone
    # (weights = their sample counts); mixed by Megatron's greedy blending index (data/blending.py)
    train_blend: str = ""
    valid_blend: str = ""
    # "969,30,1": train / valid / test parts of every training prefix, by sequence, as Megatron's --split;
    # empty: the whole prefix trains
    split: str = ""
    # megatron: per-epoch sequence shuffle, sample index over that order, sample shuffle (Megatron-LM's
    # GPTDataset) | stream: windows of the unshuffled token stream, shuffled per epoch
    sample_order: Literal["megatron", "stream"] = "megatron"
    eod_mask_loss: bool = False  # no loss where the input token is the end-of-document token (Megatron's)
    reset_position_ids: bool = False  # positions restart at 0 after each end-of-document token
    reset_attention_mask: bool = False  # no attention across an end-of-document token (SDPA boolean mask)


@dataclass
class CommConfig:
    """Gradient-reduction wire format and its options (docs/configuration.md, ``comm``; orthogonal keys)."""

    dtype: str = "fp32"  # a format registered in comm/formats.py: fp32, bf16, fp8_e4m3, fp8_e5m2, nvfp4
    # tensor (one FP32 scale per parameter) | block (one per block_size elements)
    scaling: Literal["tensor", "block"] = "tensor"
    block_size: int = 128  # elements per scale with scaling=block
    rounding: Literal["nearest", "stochastic"] = "nearest"  # nearest | stochastic (unbiased, seeded)
    error_feedback: bool = False  # keep what quantisation lost and add it back next step
    # none | hadamard (fixed block-Hadamard rotation) | geo (GeoFP8, see geo.*)
    transform: Literal["none", "hadamard", "geo"] = "none"
    hadamard_block: int = 128  # rotation block (power of two)
    # none (per-rank scales, sent with the payload) | max (shared MAX scales)
    scale_sync: Literal["none", "max"] = "none"
    # fp32_sum: every rank's codes decoded and summed in FP32 (default) | wire_sum: the paper's Euclidean
    # collective, codes with one DP-shared scale summed in FP8 inside the reduce-scatter (fp8 only)
    reduce_op: Literal["fp32_sum", "wire_sum"] = "fp32_sum"
    wire_sum_prediv: bool = True  # wire_sum: divide by the DP size before the sum (in the scale), not after
    # torch.compile(fullgraph=True) each codec's encode and decode (codes bitwise equal to eager);
    # auto = on with CUDA, off on CPU (where a C++ compiler and a first-call compile are needed)
    compile: Literal["auto", "true", "false"] = "auto"
    # the run's name for its comm settings (wandb group and tag, run name, summary, compare_runs.py); empty:
    # the preset's name (configs/comm/<name>.yaml) or a compact label of the non-default comm/geo keys
    label: str = ""
    # every this many steps, each rank measures the relative round-trip error ||Q(g) - g|| / ||g|| of its own
    # gradient per low-precision bucket (and GeoFP8 layer, also through the plain codec), DP-averaged with one
    # small all-reduce and logged as comm/rel_err/...; 0: off
    telemetry_interval: int = 50
    # the parameter all-gather after each step (distributed optimizer, DP > 1): auto = the parameters in
    # train.param_dtype (bf16: the same, BF16 parameters only) | fp8 / nvfp4 = the owner sends the difference to what
    # every replica holds, quantised in blocks of 128 (comm/param_codec.py, distributed/param_gather.py)
    param_gather: str = "auto"


@dataclass
class GeoConfig:
    """GeoFP8 (``comm.transform=geo``): input-side transform from a damped rank-``rank`` K-FAC factor.

    ``damping`` is relative to the mean eigenvalue of A (trace(A) / d_in), so it is scale-free.
    ``layers``: comma-separated globs over parameter names (the paper: the MLP down projections); with
    ``select=auto`` they are the candidates, profiled for ``profile_steps`` steps under Euclidean FP8,
    and the ``num_layers`` with the highest bound-hit rate get the transform.
    """

    layers: str = "layers.*.mlp.down_proj.weight"
    # layers: use geo.layers | auto: profile bound hits, then pick the top | gain: at every refresh, the num_layers
    # candidates with the largest positive predicted gain (geometry/refresh_stats.py; others stay Euclidean)
    select: Literal["layers", "auto", "gain"] = "layers"
    num_layers: int = 13  # auto / gain: how many layers get the transform (paper: 13)
    profile_steps: int = 100  # auto: Euclidean steps profiled before choosing (paper: 100)
    rank: int = 32
    damping: float = 1e-3
    # D = ((lambda_ref + damping) / (lambda_i + damping)) ** power: a number in (0, 1] (0.5 whitens, the paper's
    # form) or auto: p = clip(s / 4, 0, 1/2) per layer at each refresh from the slope s of the gradient energy
    # against A's eigenvalues (no trial quantisation; p = 0 keeps the layer Euclidean)
    power: str = "0.5"
    power_search: str = ""  # e.g. "0.5,0.25,0": at each refresh every layer takes the power (0 = Euclidean)
    # with the smallest DP-summed round-trip error of its gradient; overrides power
    refresh_interval: int = 50
    ef_on_refresh: Literal["rebase", "reset"] = "rebase"  # rebase: R <- R T_old^-1 T_new | reset: R <- 0
    # full A (d_in^2) | sketch A·Omega (d_in x sketch_size) | auto: sketch if d_in > 4 x sketch_size
    statistics: Literal["auto", "full", "sketch"] = "auto"
    sketch_size: int = 64  # columns of Omega (>= rank; 2 x rank is a good choice)


def parse_power(spec, key: str = "geo.power") -> float | str:
    """``geo.power`` ("0.5", "0.25", "auto") -> 0.5, 0.25 or ``"auto"`` (``key`` names it in errors).

    Raises:
        ConfigError: anything but ``auto`` or a number in (0, 1].
    """
    text = str(spec).strip().lower()
    if text == "auto":
        return "auto"
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (math.isfinite(v) and 0 < v <= 1):
        raise ConfigError(
            f"{key}={spec!r} must be a number in (0, 1] (0.5 whitens the top-r directions, 0.25 "
            f"goes halfway) or auto (p = clip(s / 4, 0, 1/2) per layer from the refresh's statistics)"
        )
    return v


def parse_power_search(spec, key: str = "geo.power_search") -> tuple[float, ...]:
    """``geo.power_search`` ("0.5,0.25,0", or "[0.5, 0.25, 0]") -> (0.5, 0.25, 0.0); "" -> () (the fixed
    ``geo.power``). ``key`` names the setting in error messages.

    Raises:
        ConfigError: an element that is not a number in [0, 1] (or empty), a repeated value, or more
            than 8 values.
    """
    text = "" if spec is None else str(spec).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text.strip():
        return ()
    out: list[float] = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = float(part) if part else float("nan")
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and 0.0 <= v <= 1.0):
            shown = repr(part) if part else "an empty element"
            raise ConfigError(
                f"{key}={spec!r}: {shown} is not a power in [0, 1]; give comma-separated "
                f"exponents such as {key}=0.5,0.25,0 (0 = Euclidean), or an empty value to "
                f"turn the search off"
            )
        if v in out:
            raise ConfigError(f"{key}={spec!r} repeats {v:g}; list each power once")
        out.append(v)
    if len(out) > 8:
        raise ConfigError(
            f"{key}={spec!r} has {len(out)} powers; at most 8 (each costs a trial "
            f"quantization of every selected gradient at every refresh)"
        )
    return tuple(out)


@dataclass
class CheckpointConfig:
    """Sharded torch.distributed.checkpoint saves under ``dir`` (default ``<train.run_dir>/checkpoints``).

    ``interval``: save every this many steps (0: only on a stop signal, a non-finite stop or at the end
    with ``save_at_end``). ``keep_latest``: complete checkpoints kept (older ones are removed only after a
    newer one is complete; 0 keeps all). ``load``: ``auto`` (resume from the latest complete checkpoint
    in ``dir`` if there is one), ``latest`` (the same, but it must exist), ``none`` (start fresh), or a
    checkpoint folder path, which initialises a run folder that has no checkpoint of its own (relaunches
    resume the run's own checkpoints; see ``checkpoint/start.py``). ``allow_changes``: keys that a resume
    may change although they change the run's trajectory (data order, global batch, learning-rate
    schedule; ``all`` for every one), see ``checkpoint/resume_changes.py``.
    """

    dir: str = path_field("", required=False)  # empty: <train.run_dir>/checkpoints
    interval: int = 0
    keep_latest: int = 2
    load: str = path_field("auto", required=True, keywords=("auto", "latest", "none"))
    save_at_end: bool = True
    allow_changes: str = ""  # comma-separated keys a resume may change (see checkpoint/resume_changes.py)


@dataclass
class LoggingConfig:
    """``wandb``: offline (default), online or disabled. Group and tags default to the comm settings."""

    wandb: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "megatron-geo"
    wandb_group: str = ""
    wandb_name: str = ""
    # auto: continue the wandb run only in the folder its id was made in | never | must
    wandb_resume: Literal["auto", "never", "must"] = "auto"


@dataclass
class ProfilingConfig:
    """``steps``: ``START:END`` profiles optimizer steps START..END-1 (a half-open range, as a Python slice) with
    ``torch.profiler`` into ``<train.run_dir>/profile/``; empty: off. ``memory_snapshot``: also record a CUDA
    memory snapshot over the same steps (on a GPU)."""

    steps: str = ""
    memory_snapshot: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    geo: GeoConfig = field(default_factory=GeoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
