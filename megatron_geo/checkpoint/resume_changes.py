"""Settings that change a run's trajectory, compared between a checkpoint and the launch that resumes it.

A relaunch of a run (a Slurm requeue, an ``exit_interval`` stop, extending ``train.steps``) must continue
the trajectory the checkpoint was on. Keys that would silently change it are refused on a resume unless
``checkpoint.allow_changes`` names them:

- the data order: ``train.seed`` (the per-epoch shuffle of the sample index), ``model.seq_length`` (the
  sample boundaries), ``data.source`` / ``data.train_prefix`` / ``data.train_blend`` / ``data.split`` (the
  documents), ``data.sample_order``; what the model sees of them: ``data.eod_mask_loss``,
  ``data.reset_position_ids``, ``data.reset_attention_mask``. A checkpoint saved before a key existed is compared
  as what that code ran with (:data:`LEGACY_VALUES`), so a new default never slips into a resumed run;
- the model's function beyond its shapes: ``model.rope_theta``, ``model.norm_eps``;
- the gradient reduction's numerics: every ``comm`` key but :data:`COMM_UNCOMPARED` (:data:`COMM_KEYS`, read from
  the schema, so a new key is compared unless it is listed there; ``comm.param_gather`` sets the parameters the
  replicas hold) and, where GeoFP8 transforms, every ``geo`` key (``checkpoint.allow_changes=comm`` / ``geo``
  names a whole section);
- the samples per step: ``train.global_batch_size``;
- the learning-rate schedule: ``optimizer.lr``, ``optimizer.min_lr``, ``optimizer.adamw_lr``,
  ``train.warmup_steps``, ``train.lr_decay_style``, ``train.steps``. These are compared by their effect: a
  change is refused only when the learning rate of some step still to train differs from the saved
  schedule's (so extending a run that is still in its warmup, or a constant schedule, is no change); the
  message gives the first such step and both rates.

Every value is compared resolved: the config loader expands ``~`` and environment variables and makes paths
absolute, so the checkpoint records the files a run read; the training and the separate validation files are
identified by size and index hash as well (:func:`check_data_files`). The optimizer's other hyper-parameters
(weight decay, betas, eps, clipping, Muon momentum) and ``comm.compile`` / ``comm.telemetry_interval`` are logged
when they change. A run initialised from another checkpoint (or rolled back to an earlier one) starts a new
trajectory, so there every difference is only logged.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

from ..config import Config, ConfigError, config_to_dict
from ..config.schema import CommConfig, GeoConfig, parse_power
from ..optim.schedule import lr_at

DATA_KEYS = {
    "train.seed": "the data order (the per-epoch shuffle of the sample index)",
    "model.seq_length": "the sample boundaries, hence the data order",
    "data.source": "the training documents",
    "data.train_prefix": "the training documents",
    "data.tokenizer_type": "the token ids of the documents",
    "data.tokenizer_model": "the token ids of the documents",
    "data.train_blend": "the training documents and their weights",
    "data.split": "which sequences train",
    "data.sample_order": "the data order",
    "data.eod_mask_loss": "which tokens carry loss",
    "data.reset_position_ids": "the positions the model sees",
    "data.reset_attention_mask": "what each token attends to",
    "train.global_batch_size": "the samples per step",
}
# What a checkpoint saved before a key existed ran with: a missing key means this value, never today's default
# (data.sample_order was a stream of windows before Megatron's order became the default).
LEGACY_VALUES = {
    "data.tokenizer_type": "sentencepiece",
    "data.train_blend": "",
    "data.split": "",
    "data.sample_order": "stream",
    "data.eod_mask_loss": False,
    "data.reset_position_ids": False,
    "data.reset_attention_mask": False,
    "comm.param_gather": "auto",
}
# the model's function (not its shapes, which a checkpoint's tensors fix): refused on resume like the data keys
MODEL_KEYS = {
    "model.rope_theta": "the rotary position embedding's base, hence every attention score",
    "model.norm_eps": "every RMSNorm's epsilon",
}
# what the gradients carry: every comm key but those of COMM_UNCOMPARED sets the reduction's numerics (so a new key is
# compared on resume, the safe side, unless it is added there); the geo keys count where either side transforms with
# GeoFP8
_WIRE = "the gradient reduction's numerics (what every step's update is made of)"
#: comm keys that leave every step's update as it is: how the codecs run (``compile``), the run's name for its
#: settings (``label``) and a measurement (``telemetry_interval``); ``compile`` and ``telemetry_interval`` are logged
COMM_UNCOMPARED = ("compile", "label", "telemetry_interval")
# comm keys whose effect is not the wire's: the parameters every replica computes with (the plain gather, or the
# quantised difference)
_COMM_EFFECTS = {"param_gather": "the parameters every replica computes with (the parameter all-gather)"}


def section_keys(
    cls: type, section: str, effect: str, uncompared: tuple[str, ...] = (), effects: dict[str, str] | None = None
) -> dict[str, str]:
    """``{"section.key": what it sets}`` for every field of the schema section class ``cls`` but ``uncompared``:
    ``effects[key]`` where given, else ``effect``."""
    own = effects or {}
    return {f"{section}.{f.name}": own.get(f.name, effect) for f in dataclasses.fields(cls) if f.name not in uncompared}


COMM_KEYS = section_keys(CommConfig, "comm", _WIRE, COMM_UNCOMPARED, _COMM_EFFECTS)
GEO_KEYS = section_keys(GeoConfig, "geo", "GeoFP8's coordinates, hence the gradient reduction's numerics")
SECTIONS = {"comm": tuple(COMM_KEYS), "geo": tuple(GEO_KEYS)}  # checkpoint.allow_changes=comm names them all
SCHEDULE_KEYS = (
    "optimizer.lr",
    "optimizer.min_lr",
    "optimizer.adamw_lr",
    "train.warmup_steps",
    "train.lr_decay_style",
    "train.steps",
)
# not config keys: the training / the separate validation files themselves (data/identity.py), changed under the
# same prefixes or reached by the same config text through another environment
DATA_FILES = "data.files"
VALID_FILES = "data.valid_files"
ALLOWABLE = (*DATA_KEYS, *MODEL_KEYS, *COMM_KEYS, *GEO_KEYS, *SCHEDULE_KEYS, DATA_FILES, VALID_FILES)
# changed on resume only with a log line (they change the update but not which data or learning rate it sees)
LOGGED_KEYS = (
    "comm.compile",
    "comm.telemetry_interval",
    "optimizer.weight_decay",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "optimizer.clip_grad",
    "optimizer.muon_momentum",
    "optimizer.muon_adjust_lr_fn",
    "optimizer.muon_ns",
)
_PATH_KEYS = ("data.train_prefix",)


def parse_allow_changes(text: str) -> set[str]:
    """``checkpoint.allow_changes`` (comma-separated keys, a section ``comm`` / ``geo`` for all its keys, or
    ``all``) as a set of dotted keys.

    Raises:
        ConfigError: a key that is not one of :data:`ALLOWABLE` (names it and the valid keys).
    """
    keys = {k.strip() for k in str(text or "").split(",") if k.strip()}
    if "all" in keys:
        return set(ALLOWABLE)
    for sec, members in SECTIONS.items():
        if sec in keys:
            keys = (keys - {sec}) | set(members)
    bad = sorted(keys - set(ALLOWABLE))
    if bad:
        raise ConfigError(
            f"checkpoint.allow_changes names {', '.join(bad)}, which a resume never refuses; valid keys: "
            f"{', '.join(ALLOWABLE)} (or comm, geo, all)"
        )
    return keys


def _get(d: dict, key: str):
    sec, name = key.split(".")
    return d.get(sec, {}).get(name)


def _saved(d: dict, key: str):
    """The saved value of ``key``; for a checkpoint written before the key existed, what that code ran with."""
    value = _get(d, key)
    if value is None and key in LEGACY_VALUES and key.split(".")[0] in d:
        return LEGACY_VALUES[key]
    return value


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expandvars(os.path.expanduser(path)))


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _norm(key: str, v):
    if key in _PATH_KEYS and isinstance(v, str) and v:
        return _abs(v)
    if key == "data.train_blend" and isinstance(v, str):  # weights as numbers, prefixes as absolute paths
        return " ".join(str(float(t)) if _is_number(t) else _abs(t) for t in v.split())
    if key == "geo.power" and v is not None:  # one value in any spelling (an older checkpoint holds the number 0.5)
        try:
            return parse_power(v)
        except ConfigError:
            return v
    return v


def _lr(c: dict, step: int, which: str) -> float:
    o, t = c["optimizer"], c["train"]
    base = o["lr"]
    if which == "adamw" and (o.get("adamw_lr") or -1.0) >= 0:
        base = o["adamw_lr"]
    scale = lr_at(
        step,
        max_lr=1.0,
        min_lr=o["min_lr"] / o["lr"] if o["lr"] else 0.0,
        warmup_steps=t["warmup_steps"],
        total_steps=t["steps"],
        style=t["lr_decay_style"],
    )
    return base * scale


def first_lr_difference(saved: dict, now: dict, start_step: int) -> tuple[int, float, float] | None:
    """The first optimizer step in ``[start_step, now.train.steps)`` whose learning rate differs between the
    saved and the new config (``(step, saved_lr, new_lr)``, step 0-based), or None when none does.

    Both the main learning rate and AdamW's (``optimizer.adamw_lr`` under Muon) are compared; rates are
    equal when within 1e-12 relative (the schedule of :func:`megatron_geo.optim.schedule.lr_at`).
    """
    for step in range(start_step, now["train"]["steps"]):
        for which in ("main", "adamw"):
            a, b = _lr(saved, step, which), _lr(now, step, which)
            if not math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0):
                return step, a, b
    return None


def check_resume_changes(saved: dict, cfg: Config, start_step: int, kind: str) -> list[str]:
    """Compare the checkpoint's config ``saved`` with this launch's ``cfg``.

    Args:
        saved: the ``config`` mapping of the checkpoint's ``meta.json``.
        start_step: the checkpoint's step (the next step to train is ``start_step + 1``, 1-based).
        kind: ``resume`` refuses the changes :data:`ALLOWABLE` lists unless ``checkpoint.allow_changes`` names
            them; ``init`` and ``rollback`` only report them.

    Returns:
        Lines for the start-up log (each change and its effect).

    Raises:
        ConfigError: on a resume, a refused change (names every refused key, both values, the effect and the
            override).
    """
    now = config_to_dict(cfg)
    allowed = parse_allow_changes(cfg.checkpoint.allow_changes)
    notes, refused, refused_keys = [], [], []
    compared = {**DATA_KEYS, **MODEL_KEYS, **COMM_KEYS}
    if "geo" in (_get(saved, "comm.transform"), _get(now, "comm.transform")):
        compared.update(GEO_KEYS)
    for key, what in compared.items():
        old, new = _norm(key, _saved(saved, key)), _norm(key, _get(now, key))
        if old is None or old == new:
            continue
        line = f"{key} changed on resume: {old!r} -> {new!r} (it sets {what})"
        if kind == "resume" and key not in allowed:
            refused.append(line)
            refused_keys.append(key)
        else:
            notes.append(line + (" (allowed by checkpoint.allow_changes)" if kind == "resume" else ""))
    for key in LOGGED_KEYS:  # the optimizer's other hyper-parameters: stated, never silent
        old, new = _get(saved, key), _get(now, key)
        if old is not None and old != new:
            notes.append(f"{key} changed on resume: {old!r} -> {new!r}")
    sched = [k for k in SCHEDULE_KEYS if _get(saved, k) is not None and _get(saved, k) != _get(now, k)]
    if sched:
        changes = ", ".join(f"{k} {_get(saved, k)!r} -> {_get(now, k)!r}" for k in sched)
        try:
            diff = first_lr_difference(saved, now, start_step)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            diff = (start_step, float("nan"), float("nan"))  # an old checkpoint's schedule cannot be evaluated
        if diff is None:
            notes.append(f"{changes} on resume: the learning rate of every remaining step is unchanged")
        else:
            step, a, b = diff
            saved_steps = saved["train"]["steps"]
            effect = (
                f"the learning rate of step {step + 1} becomes {b:.3e} where the saved schedule gives {a:.3e}"
                f"{' (it ended at step ' + str(saved_steps) + ')' if step >= saved_steps else ''}"
            )
            line = f"{changes} on resume: {effect}"
            unallowed = [k for k in sched if k not in allowed]
            if kind == "resume" and unallowed:
                refused.append(line)
                refused_keys += unallowed
            else:
                notes.append(line + (" (allowed by checkpoint.allow_changes)" if kind == "resume" else ""))
    if refused:
        keys = refused_keys
        raise ConfigError(
            "resuming would change this run's trajectory: " + "; ".join(refused) + ". Keep the checkpoint's values, "
            f"or accept the change with checkpoint.allow_changes={','.join(keys)} (to stop a run earlier without "
            f"changing its schedule use train.exit_interval; to start a new run from this checkpoint use a new "
            f"train.run_dir with checkpoint.load=PATH)"
        )
    return notes


_SOURCE_KEYS = {
    "training": ("data.source", "data.train_prefix", "data.train_blend"),
    "validation": ("data.source", "data.valid_prefix", "data.valid_blend"),
}


def check_data_files(
    saved: list[dict] | None,
    now: list[dict],
    cfg: Config,
    kind: str,
    saved_cfg: dict | None = None,
    what: str = "training",
) -> list[str]:
    """Compare the files a checkpoint recorded (:func:`megatron_geo.data.identity.dataset_identity` per prefix)
    with this launch's: the same prefixes whose files changed on disk, or the same config text that now reaches
    other files (a ``$VAR`` in a prefix of a checkpoint that recorded it unexpanded), would silently change the
    documents.

    Args:
        what: ``training`` (key ``data.files``) or ``validation`` (the separate validation files of
            ``data.valid_prefix`` / ``data.valid_blend``, key ``data.valid_files``).
        saved_cfg: the checkpoint's config mapping; with it, prefixes that differ while the config keys that name
            them compare equal are a change of files.

    Returns:
        Start-up log lines (a change on ``init`` / ``rollback``, or allowed by ``checkpoint.allow_changes``).

    Raises:
        ConfigError: on a resume, a changed file unless ``checkpoint.allow_changes`` names the key.
    """
    from ..data.identity import identity_changes

    key = DATA_FILES if what == "training" else VALID_FILES
    if saved is None:  # a checkpoint that did not record these files (validation files before they were recorded)
        return []
    changes = identity_changes(saved or [], now)
    old_prefixes = [str(s.get("prefix")) for s in saved]
    new_prefixes = [str(n.get("prefix")) for n in now]
    if saved_cfg is not None and cfg.data.source != "shakespeare" and old_prefixes != new_prefixes:
        now_cfg = config_to_dict(cfg)
        same_text = all(_norm(k, _saved(saved_cfg, k)) == _norm(k, _get(now_cfg, k)) for k in _SOURCE_KEYS[what])
        if same_text:  # else the config keys' own comparison reports (or allows) the change
            changes.append(
                f"the same config resolves to other files ({', '.join(old_prefixes)} -> {', '.join(new_prefixes)})"
            )
    # the cache folder and file name, not the cache root (data.cache_dir may differ between nodes)
    old = [Path(p).parts[-2:] for p in old_prefixes]
    new = [Path(p).parts[-2:] for p in new_prefixes]
    if saved and cfg.data.source == "shakespeare" and old != new:
        # the embedded corpus' folders are named after its tokenizer (a fingerprint of a Hugging Face tokenizer's
        # files): other folders under the same config keys mean other token ids, e.g. a tokenizer folder rewritten
        changes.append(
            f"the embedded corpus was tokenized differently ({', '.join('/'.join(o) for o in old)} -> "
            f"{', '.join('/'.join(n) for n in new)}: "
            f"the tokenizer's files changed)"
        )
    if not changes:
        return []
    line = f"the {what} files changed since the checkpoint was saved: " + "; ".join(changes)
    if kind == "resume" and key not in parse_allow_changes(cfg.checkpoint.allow_changes):
        effect = "documents" if what == "training" else "validation loss (not comparable with the earlier steps')"
        raise ConfigError(
            f"resuming would change this run's {effect}: {line}. Restore the files the run was started on, or "
            f"accept the change with checkpoint.allow_changes={key}"
        )
    return [line + (" (allowed by checkpoint.allow_changes)" if kind == "resume" else "")]
