"""Metric sinks: ``metrics.jsonl`` and wandb (offline by default), and the record each step logs. Only rank 0
writes."""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

import torch
import yaml

from ..config import Config, ConfigError, config_to_dict, dump_config
from ..config.checks import check_choice, choices_of
from ..config.schema import LoggingConfig
from ..model import flops_per_token
from ..parallel import ParallelContext
from .checkpointing import launch_neutral
from .mfu import gpu_flops_metrics

_WandbMode = Literal["online", "offline", "disabled", "shared"]  # wandb.init(mode=...)

ID_FILE = "wandb_run_id"


def _folder_identity(run_dir: Path) -> dict:
    st = run_dir.stat()
    return {"run_dir": str(run_dir.resolve()), "inode": st.st_ino}


def read_wandb_id(run_dir: Path) -> tuple[str | None, dict | None]:
    """The wandb run id kept in ``run_dir/wandb_run_id`` and the identity of the folder it was made in
    (``{"run_dir": resolved path, "inode": int}``; None for a file of the one-line format, which names no
    folder). ``(None, None)`` when there is no readable id."""
    f = run_dir / ID_FILE
    try:
        text = f.read_text()
    except OSError:
        return None, None
    try:
        d = json.loads(text)
    except ValueError:
        d = None
    if isinstance(d, dict) and isinstance(d.get("id"), str) and _valid_id(d["id"]):
        origin = {k: d.get(k) for k in ("run_dir", "inode")}
        return d["id"], origin
    line = text.strip().splitlines()[0].strip() if text.strip() else ""
    return (line if _valid_id(line) else None), None  # a damaged file: a new run rather than a garbage id


def _valid_id(run_id: str) -> bool:
    """wandb run ids of this project: 1-64 characters of [A-Za-z0-9_-]."""
    return 0 < len(run_id) <= 64 and all(c.isascii() and (c.isalnum() or c in "_-") for c in run_id)


def choose_wandb_id(run_dir: Path, resume_step: int, mode: str = "auto", new_timeline: bool = False) -> tuple[str, str]:
    """The wandb run id a launch logs under, and a line saying why.

    A fresh run (``resume_step == 0``) gets a new id. A resumed run continues the id kept in its folder
    when the folder is the one the id was made in (the same resolved path or the same inode, so a folder
    moved within its file system, or mounted elsewhere, stays the same run; a copy is a new run);
    ``mode``: ``auto`` (that rule), ``never`` (always a new id), ``must`` (continue the kept id even in a
    copy; an error when there is none).

    ``new_timeline``: this launch starts a new timeline at ``resume_step`` (a roll-back to an earlier checkpoint of
    the run, or a start from another checkpoint). wandb ignores steps below a run's last logged step, so the kept
    run, which may hold later steps of the abandoned timeline, is never continued (whatever ``mode``): the id is
    a new one derived from it, ``<kept id>-s<step>-<6 hex digits>`` (:func:`fork_of` reads it back).

    Raises:
        ConfigError: ``mode="must"`` and the folder keeps no id, or an unknown mode.
    """
    check_choice("logging.wandb_resume", mode, choices_of(LoggingConfig, "wandb_resume"))
    kept, origin = read_wandb_id(run_dir) if resume_step > 0 else (None, None)
    if new_timeline and resume_step > 0:
        if kept is None:
            new = uuid.uuid4().hex[:12]
            return new, f"wandb: new run {new} (a new timeline from step {resume_step})"
        fork = f"{kept[:40]}-s{resume_step}-{uuid.uuid4().hex[:6]}"
        return fork, (
            f"wandb: new run {fork}: this launch starts a new timeline at step {resume_step}, and run {kept} keeps "
            f"the steps of the one it replaces (wandb drops steps below a run's last); its config records "
            f"forked_from"
        )
    if mode == "must":
        if kept is None:
            raise ConfigError(
                f"logging.wandb_resume=must but {run_dir / ID_FILE} holds no wandb run id to continue; "
                f"use logging.wandb_resume=auto"
            )
        return kept, f"wandb: continuing run {kept} (logging.wandb_resume=must)"
    new = uuid.uuid4().hex[:12]  # wandb accepts any [a-z0-9] id; its generate_id moved in 0.31
    if kept is None or mode == "never":
        return new, f"wandb: new run {new}"
    here = _folder_identity(run_dir)
    if origin is None or origin.get("run_dir") == here["run_dir"] or origin.get("inode") == here["inode"]:
        return kept, f"wandb: continuing run {kept}"
    return new, (
        f"wandb: new run {new}: this folder is a copy of {origin.get('run_dir')}, whose run is {kept} "
        f"(logging.wandb_resume=must continues that one instead)"
    )


def fork_of(run_id: str) -> tuple[str, int] | None:
    """``(parent id, step)`` of an id made by :func:`choose_wandb_id` for a new timeline, else None."""
    head, sep, tail = run_id.rpartition("-")
    parent, sep2, step = head.rpartition("-s")
    if not (sep and sep2 and parent and len(tail) == 6 and step.isdigit()):
        return None
    return parent, int(step)


# wandb refuses a run whose tag is longer than 64 characters (wandb.init raises); groups and names are kept within
# 128, the length of wandb's other run-text fields
WANDB_TAG_CHARS = 64
WANDB_TEXT_CHARS = 128


def wandb_text(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its head and an 8-hex-digit hash of the whole
    (``<head>~<hash>``, exactly ``limit`` characters): distinct long texts stay distinct, and the same text always
    gives the same result (a resumed run keeps its tags). The full comm label is in the run's config either way."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{text[: limit - 9]}~{digest}"


@dataclass(frozen=True)
class WandbSpec:
    """The wandb run a :class:`MetricsLogger` mirrors its records to (the ``logging.wandb*`` keys; built by
    :func:`open_run_outputs`).

    Attributes:
        mode: ``offline`` | ``online`` | ``disabled`` (``wandb.init``'s mode; ``disabled``: no wandb run and no
            ``wandb_run_id`` file).
        project: the wandb project.
        group, name: the run's wandb group and name (empty: wandb's default, none and a generated name).
        tags: the run's tags (each cut to wandb's 64 characters by :func:`wandb_text`; group and name to 128).
        config: the run's config as wandb shows it (JSON types).
        resume: whether a resumed run continues the kept wandb run: ``auto``, ``never`` or ``must``
            (:func:`choose_wandb_id`'s ``mode``).
    """

    mode: str
    project: str
    group: str = ""
    name: str = ""
    tags: tuple[str, ...] = ()
    config: dict = field(default_factory=dict)
    resume: str = "auto"


class MetricsLogger:
    """Append one JSON object per logged step to ``run_dir/metrics.jsonl`` and mirror it to wandb.

    A fresh run (``resume_step=0``) starts a new file; a run resumed from the checkpoint of step
    ``resume_step`` keeps the records up to that step and continues the same wandb run when the folder is
    the one that run was made in (its id and the folder's identity are kept in ``run_dir/wandb_run_id``;
    see :func:`choose_wandb_id` and ``wandb_spec.resume``). ``new_timeline`` (a roll-back, or a start from another
    checkpoint): a new wandb run forked from the kept one (its config's ``forked_from`` names that run and the
    step, its name ends in ``-from-step<N>``), and the records after ``resume_step`` are moved to
    ``metrics.abandoned-<time>.jsonl``. The wandb run starts before any file of the folder is rewritten.

    ``wandb_spec``: the wandb run (:class:`WandbSpec`; its ``mode``: offline | online | disabled). The wandb group
    defaults to the comm settings, so runs of different comm modes line up in one project. ``enabled``: this rank
    writes (rank 0); ``log`` takes the lines saying which wandb run is used and where replaced records went.

    Raises:
        ConfigError: with wandb on, ``wandb_spec.resume`` unknown, or ``must`` with no kept run id
            (:func:`choose_wandb_id`).
    """

    def __init__(
        self,
        run_dir: str,
        enabled: bool,
        wandb_spec: WandbSpec,
        resume_step: int = 0,
        log=None,
        new_timeline: bool = False,
    ):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb = None
        if not enabled:
            return
        kept: list[str] = []
        dropped: list[str] = []
        if resume_step > 0 and self.path.is_file():  # a resumed run keeps the records up to its checkpoint
            for line in self.path.read_text().splitlines():
                try:
                    (kept if json.loads(line).get("step", 0) <= resume_step else dropped).append(line)
                except ValueError:
                    break  # a line cut by a crash: drop it and what follows
        spec = wandb_spec
        if spec.mode != "disabled":  # first: a wandb run that cannot start leaves the folder's files as they were
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            folder = Path(run_dir)
            run_id, why = choose_wandb_id(folder, resume_step, spec.resume, new_timeline)
            if log is not None:
                log(why)
            config, name = spec.config, spec.name
            fork = fork_of(run_id) if new_timeline else None
            if fork is not None:
                config = dict(config, forked_from={"run": fork[0], "step": fork[1]})
                name = f"{name or 'run'}-from-step{fork[1]}"
            self._wandb = wandb.init(
                project=spec.project,
                group=wandb_text(spec.group, WANDB_TEXT_CHARS) or None,
                name=wandb_text(name, WANDB_TEXT_CHARS) or None,
                tags=[wandb_text(t, WANDB_TAG_CHARS) for t in spec.tags],
                config=config,
                dir=run_dir,
                mode=cast(_WandbMode, spec.mode),
                reinit=True,
                id=run_id,
                resume="allow",
            )
            tmp_id = folder / (ID_FILE + ".tmp")
            tmp_id.write_text(json.dumps({"id": run_id, **_folder_identity(folder)}) + "\n")
            os.replace(tmp_id, folder / ID_FILE)
        if new_timeline and dropped:  # the replaced timeline's later records are kept aside, not lost
            aside = self.path.with_name(f"metrics.abandoned-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
            aside.write_text("".join(line + "\n" for line in dropped))
            if log is not None:
                log(f"metrics: the records after step {resume_step} of the replaced timeline moved to {aside}")
        # a new run starts a new file; a resumed one rewrites the kept records first (atomically, so a kill
        # at any point loses nothing that was written) and then appends
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 -- appended to until close()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        # strict JSON: non-finite floats (a skipped step's norm) are written as null
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def open_run_outputs(
    cfg: Config, pctx: ParallelContext, start_step: int, log, new_timeline: bool = False
) -> MetricsLogger:
    """Every rank opens the run's :class:`MetricsLogger` (tags and wandb names from the comm settings; rank 0's
    logs), then rank 0 writes ``train.run_dir/config.yaml`` (:func:`~.checkpointing.launch_neutral`). Call it once
    the checkpoint, if any, loaded: a failed start (or a wandb run that cannot start) leaves the run folder as it
    was. ``new_timeline``: the launch rolled back or started from another checkpoint (:func:`choose_wandb_id`)."""
    t, lg, label = cfg.train, cfg.logging, cfg.comm.label
    run_dir = Path(t.run_dir)
    if pctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    tags = (
        f"comm={label}",
        f"comm.dtype={cfg.comm.dtype}",
        f"opt={cfg.optimizer.name}",
        f"tp={pctx.tp_size}",
        f"dp={pctx.dp_size}",
    )
    spec = WandbSpec(
        lg.wandb,
        lg.wandb_project,
        group=lg.wandb_group or label,
        name=lg.wandb_name or f"{label}-seed{t.seed}",
        tags=tags,
        config=config_to_dict(cfg),
        resume=lg.wandb_resume,
    )
    logger = MetricsLogger(str(run_dir), pctx.is_main, spec, resume_step=start_step, log=log, new_timeline=new_timeline)
    if pctx.is_main:
        try:
            (run_dir / "config.yaml").write_text(_config_record(cfg))
        except BaseException:
            logger.close()
            raise
    return logger


def _config_record(cfg: Config) -> str:
    """``config.yaml``: the resolved config, and under ``x-inert_keys`` (which the loader skips) the keys this run
    was given that its comm preset switches off."""
    from .validate import inert_notes

    text = dump_config(launch_neutral(cfg))
    notes = inert_notes(cfg)
    return text + (yaml.safe_dump({"x-inert_keys": notes}, sort_keys=False, width=1000) if notes else "")


class StepRecords:
    """The metrics record of each step: ``step`` (1-based), ``lr``, ``grad_norm``, ``tokens_per_sec`` (global),
    ``comm_bytes`` (this rank, this step, the gradient reduction), ``step_time_s``, ``consumed_samples``, ``skipped``,
    then the extras given (telemetry, checkpoint times, ``comm_gather_bytes``: the parameter gather, and on log steps
    with a quantised gather ``param_gather/max_ulps``), with GeoFP8 ``geo_refresh`` and per-layer
    ``geo/<layer>/<key>`` refresh diagnostics, and on CUDA ``tflops_per_gpu``, ``mfu`` and ``max_memory_gib``."""

    def __init__(self, cfg: Config, pctx: ParallelContext, geo):
        self.lr, self.pctx, self.geo = cfg.optimizer.lr, pctx, geo
        self.flops_tok = flops_per_token(cfg.model)
        self.gpu_name = torch.cuda.get_device_name(pctx.device) if pctx.device.type == "cuda" else None

    def make(
        self,
        step: int,
        lr_scale: float,
        res,
        dt: float,
        consumed: int,
        comm_bytes: float,
        *extras: dict,
        refreshed: bool = False,
    ) -> dict:
        """The record of step ``step`` (0-based) from its :class:`~.step.StepResult` ``res`` and ``dt`` seconds."""
        record = {
            "step": step + 1,
            "lr": self.lr * lr_scale,
            "grad_norm": res.grad_norm,
            "tokens_per_sec": res.tokens / dt,
            "comm_bytes": comm_bytes,
            "step_time_s": dt,
            "consumed_samples": consumed,
            "skipped": res.skipped,
        }
        for extra in extras:
            record.update(extra)
        if self.geo is not None:
            record["geo_refresh"] = refreshed
            if refreshed:  # per-layer refresh diagnostics (host floats, read once at the refresh)
                record.update(
                    {
                        f"geo/{n.removesuffix('.weight')}/{k}": v
                        for n, d in self.geo.diagnostics.items()
                        for k, v in d.items()
                    }
                )
        if self.gpu_name is not None:  # MFU and memory (docs/design.md section 4, Metrics)
            fl = gpu_flops_metrics(record["tokens_per_sec"], self.pctx.world_size, self.flops_tok, self.gpu_name)
            record.update(
                tflops_per_gpu=fl["tflops_per_gpu"],
                mfu=fl["mfu"],
                max_memory_gib=torch.cuda.max_memory_allocated(self.pctx.device) / 2**30,
            )
        return record
