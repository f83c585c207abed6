#!/usr/bin/env python
"""Compare the comm modes of a sweep: loss-curve plots and a summary table (no network).

    python tools/compare_runs.py runs/sweep_tiny [--out docs/sweep_tiny] [--baseline bf16] [--smooth 10]

Reads every run folder under SWEEP_DIR that holds ``metrics.jsonl`` and ``config.yaml`` (written by
``pretrain_llama.py``; see ``tools/run_comparison.py``), or, for a folder without ``metrics.jsonl``, its offline
wandb run (``wandb/offline-run-*/run-*.wandb``, read locally: config, run name and logged history). The mode of a
run is its ``comm.label`` (config.yaml; the preset name or a compact label of its comm keys), else, for runs made
before labels existed, the part of its folder name before ``-seed<k>`` (else ``comm.dtype`` [+transform, +ef]);
the seed is ``train.seed``.

Writes into ``--out`` (default ``SWEEP_DIR``):
- ``loss.png``: train loss (moving average over ``--smooth`` logged steps) and validation loss vs step,
  one line per mode = mean over seeds, band = min..max over seeds, each mode its own line style and marker
  (equal curves stay visible);
- ``gap_to_<baseline>.png``: loss minus the baseline run *of the same seed*, vs step (mean over seeds, band =
  95% t interval of that mean);
- ``rel_err.png`` (when the runs logged ``comm/rel_err/...``, see ``comm.telemetry_interval``): the live
  quantization error per mode, and for GeoFP8 layers through the transform vs the plain codec;
- ``results.md`` and ``results.csv``, one row per mode:
  - ``diverged`` / ``diverged_seeds``: runs whose end is non-finite (the last ``loss`` or ``val_loss`` logged is
    ``null``, NaN or inf, or the run stopped before ``train.steps`` on a non-finite step: ``train.nonfinite=stop``
    or ``train.max_skipped_steps`` skips in a row). Their final losses are NaN (never an earlier finite value),
    they are left out of the means, stds and pairs below, and named in the tables;
  - ``final_val_loss_mean`` / ``_std``: last validation loss of each run that did not diverge, mean and sample
    std (ddof=1) over those seeds (n/a with fewer than 2);
  - ``gap`` = mean(mode) - mean(baseline); ``gap_sigma`` = gap / std(baseline) (docs/design.md section 4,
    "loss gap to the BF16 run in units of the seed-to-seed std"); ``paired_gap`` = mean over shared seeds of
    (mode - baseline) of the same seed;
  - ``comm_bytes_per_step``: mean of ``comm_bytes`` over all logged steps and seeds (bytes one rank sent
    for DP gradient reduction per step) and ``bytes_rel`` = that / the baseline's;
  - ``tokens_per_sec``: mean over steps after the first, then over seeds (global tokens/s);
  - ``ci_lo``/``ci_hi``/``ci_method``/``verdict``/``seeds_needed``: the paired verdict of ``tools/verdict.py``
  (95% interval of the same-seed gap; better / worse / not distinguishable at n seeds; seeds to resolve the gap,
  ``unknown (one pair)`` / ``unknown (no pairs)`` below 2 pairs);
  rows sorted by the paired gap, the baseline first; ``results.md`` adds a verdict table.

Errors (exit status 2, one ``error:`` line): SWEEP_DIR missing or without runs; a run folder without
metrics or stopped before ``train.steps`` other than on a non-finite step (use ``--skip-incomplete`` to leave it
out); a malformed metrics line (file and line named).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/verdict.py, also when imported from tests

DEFAULT_ORDER = [
    "fp32",
    "bf16",
    "fp8",
    "fp8_ef",
    "fp8_hadamard",
    "fp8_block",
    "geofp8_tensor",
    "geofp8",
    "nvfp4",
    "geonvfp4",
]


class CompareError(ValueError):
    """Bad sweep input; the message names the file or value and the fix."""


@dataclass
class Run:
    """One training run: ``records`` are the metrics.jsonl objects in file order; ``stopped_nonfinite``: it
    ended before ``train.steps`` on a non-finite step (see :func:`stopped_on_nonfinite`)."""

    path: Path
    mode: str
    seed: int
    records: list[dict] = field(default_factory=list)
    stopped_nonfinite: bool = False

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of the records that carry a finite ``key``."""
        pts = [
            (r["step"], float(r[key])) for r in self.records if r.get(key) is not None and math.isfinite(float(r[key]))
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    def mean_series(self, prefix: str) -> tuple[list[int], list[float]]:
        """``(steps, mean over keys starting with prefix)`` at the records that carry any such key (e.g. the
        live quantization error ``comm/rel_err/bucket`` of every bucket, averaged)."""
        steps, vals = [], []
        for r in self.records:
            v = [float(x) for k, x in r.items() if k.startswith(prefix) and x is not None and math.isfinite(float(x))]
            if v:
                steps.append(r["step"])
                vals.append(sum(v) / len(v))
        return steps, vals

    def last_value(self, key: str) -> float | None:
        """``key`` of the last record that carries it, as a float (NaN for ``null``, the trainer's spelling of a
        non-finite value); None when no record carries it. An earlier finite value never stands in."""
        for r in reversed(self.records):
            if key in r:
                return _as_float(r[key])
        return None

    @property
    def diverged(self) -> bool:
        """The run's end is non-finite: its last ``loss`` or ``val_loss`` is null / NaN / inf, or it stopped on a
        non-finite step."""
        ends = [self.last_value(k) for k in ("loss", "val_loss")]
        return self.stopped_nonfinite or any(v is not None and not math.isfinite(v) for v in ends)

    def final(self, key: str) -> float:
        """The run's result for ``key``: its last value; NaN when the run diverged or never logged it."""
        v = self.last_value(key)
        return math.nan if v is None or self.diverged else v

    @property
    def final_val_loss(self) -> float:
        return self.final("val_loss")

    @property
    def final_loss(self) -> float:
        return self.final("loss")

    @property
    def comm_bytes_per_step(self) -> float:
        _, v = self.series("comm_bytes")
        return sum(v) / len(v) if v else math.nan

    @property
    def tokens_per_sec(self) -> float:
        steps, v = self.series("tokens_per_sec")
        v = [x for s, x in zip(steps, v) if s > 1] or v  # the first step includes warm-up
        return sum(v) / len(v) if v else math.nan


def _as_float(v) -> float:
    """A logged value as a float: NaN for None (null) or anything that is not a number."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def stopped_on_nonfinite(recs: list[dict], cfg: dict) -> bool:
    """A run that ended before ``train.steps`` because of non-finite gradients: its last record is a skipped
    step (the trainer logs it before stopping) and either ``train.nonfinite=stop`` or the trailing run of
    consecutive skipped steps reached ``train.max_skipped_steps`` (default 10)."""
    train = cfg.get("train") or {}
    if not recs or recs[-1].get("skipped") is not True:
        return False
    if train.get("nonfinite", "skip") == "stop":
        return True
    run, step = 0, None
    for r in reversed(recs):
        if r.get("skipped") is not True or (step is not None and r["step"] != step - 1):
            break
        run, step = run + 1, r["step"]
    return run >= int(train.get("max_skipped_steps", 10))


def _mode_from_config(cfg: dict) -> str:
    """The run's ``comm.label`` (written by pretrain_llama.py), else a name built from the comm keys (older runs)."""
    c = cfg.get("comm", {})
    if c.get("label"):
        return str(c["label"])
    name = str(c.get("dtype", "unknown"))
    if c.get("transform", "none") not in ("none", None):
        name += f"_{c['transform']}"
    if c.get("error_feedback"):
        name += "_ef"
    return name


def _label(cfg: dict) -> str | None:
    """``comm.label`` of a run's config (the mode runs are grouped by), or None for runs made before it existed."""
    lab = (cfg.get("comm") or {}).get("label")
    return str(lab) if lab else None


def read_metrics(path: Path) -> list[dict]:
    """Records of a metrics.jsonl file. Raises CompareError naming the file and line of a bad record."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise CompareError(
                f"{path}:{i}: not valid JSON ({e.msg}); was the run interrupted while writing? "
                f"delete the partial line or rerun the run"
            ) from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise CompareError(f"{path}:{i}: a metrics record must be an object with a 'step' key")
        out.append(rec)
    return out


def _wandb_records(data: bytes, path: Path) -> list[bytes]:
    """Payloads of a wandb transaction log (``run-*.wandb``): a 7-byte header (``:W&B``, magic, version),
    then LevelDB-log framing: 32 KiB blocks of records ``crc32:u32 length:u16 type:u8 payload``
    (type 1 full, 2 first, 3 middle, 4 last), a block tail shorter than 7 bytes is padding."""
    if data[:4] != b":W&B":
        raise CompareError(f"{path}: not a wandb transaction log (no ':W&B' header)")
    out, part, i, block = [], b"", 7, 32768
    while i + 7 <= len(data):
        left = block - i % block
        if left < 7:
            i += left
            continue
        length, kind = int.from_bytes(data[i + 4 : i + 6], "little"), data[i + 6]
        i += 7
        if kind == 0 and length == 0:
            break  # zero padding at the end of a file that is still being written
        chunk, i = data[i : i + length], i + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            part = chunk
        elif kind == 3:
            part += chunk
        elif kind == 4:
            out.append(part + chunk)
            part = b""
    return out


def read_wandb_offline(path: Path) -> tuple[dict, list[dict], str]:
    """``(config, records, run name)`` of an offline wandb run file; records carry ``step`` = wandb's ``_step``
    (pretrain_llama.py logs with ``step=`` the training step) and every logged key."""
    from wandb.proto import wandb_internal_pb2 as pb

    cfg, recs, name = {}, [], ""
    for payload in _wandb_records(path.read_bytes(), path):
        r = pb.Record()
        r.ParseFromString(payload)
        kind = r.WhichOneof("record_type")
        if kind == "run":
            name = r.run.display_name
            cfg = {u.key: json.loads(u.value_json) for u in r.run.config.update if not u.key.startswith("_")}
        elif kind == "config":
            cfg.update({u.key: json.loads(u.value_json) for u in r.config.update if not u.key.startswith("_")})
        elif kind == "history":
            item = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in r.history.item}
            if "_step" in item:
                item["step"] = item["_step"]
                recs.append({k: v for k, v in item.items() if not k.startswith("_")})
    return cfg, recs, name


def load_sweep(sweep_dir: str | Path, skip_incomplete: bool = False) -> list[Run]:
    """Every run under ``sweep_dir``: folders with ``metrics.jsonl`` + ``config.yaml`` (searched
    recursively), and offline wandb runs (``wandb/offline-run-*/run-*.wandb``, the latest per folder) of
    folders without ``metrics.jsonl``."""
    root = Path(sweep_dir)
    if not root.is_dir():
        raise CompareError(f"sweep folder '{root}' not found; pass the --sweep-dir of tools/run_comparison.py")

    def hidden(p: Path) -> bool:  # .replaced/ (old runs moved aside by run_comparison --force), .git, ...
        return any(part.startswith(".") for part in p.relative_to(root).parts)

    dirs = sorted(
        {
            p.parent
            for pat in ("config.yaml", "metrics.jsonl")
            for p in root.rglob(pat)
            if "wandb" not in p.relative_to(root).parts and not hidden(p)
        }
    )
    wandb_runs: dict[Path, Path] = {}
    for f in sorted(root.rglob("run-*.wandb")):
        if hidden(f):
            continue
        parts = f.relative_to(root).parts
        if "wandb" in parts and f.parent.name.startswith("offline-run-"):
            owner = root.joinpath(*parts[: parts.index("wandb")])
            if not (owner / "metrics.jsonl").is_file():
                wandb_runs[owner] = f  # sorted: the latest offline run of a folder wins
    found = set(dirs) | set(wandb_runs)
    for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not any(child == d or child in d.parents for d in found):
            print(
                f"warning: ignoring '{child}': no config.yaml, metrics.jsonl or offline wandb run in it",
                file=sys.stderr,
            )
    runs = []
    for d, f in wandb_runs.items():
        cfg, recs, name = read_wandb_offline(f)
        if not recs:
            if skip_incomplete:
                continue
            raise CompareError(f"wandb run '{f}' has no logged steps; rerun it or pass --skip-incomplete")
        match = re.fullmatch(r"(.+)-seed(\d+)", name) or re.fullmatch(r"(.+)-seed(\d+)", d.name)
        mode = _label(cfg) or (match.group(1) if match else _mode_from_config(cfg))
        seed = cfg.get("train", {}).get("seed", int(match.group(2)) if match else 0)
        runs.append(Run(d, mode, int(seed), recs))
    for d in dirs:
        if d in wandb_runs:
            continue
        m, c = d / "metrics.jsonl", d / "config.yaml"
        recs = read_metrics(m) if m.is_file() else []
        if not recs or not c.is_file():
            if skip_incomplete:
                print(f"warning: skipping '{d}' ({'no config.yaml' if recs else 'no metrics'})", file=sys.stderr)
                continue
            what = "config.yaml" if recs else "metrics (metrics.jsonl missing or empty)"
            raise CompareError(
                f"run '{d}' has no {what}; let the run finish, rerun it "
                f"(tools/run_comparison.py --resume), or pass --skip-incomplete"
            )
        cfg = yaml.safe_load(c.read_text()) or {}
        steps = cfg.get("train", {}).get("steps")
        stopped = isinstance(steps, int) and recs[-1]["step"] < steps
        nonfinite = stopped and stopped_on_nonfinite(recs, cfg)
        if nonfinite:
            print(
                f"warning: '{d}' stopped at step {recs[-1]['step']} of {steps} on a non-finite gradient: counted "
                f"as diverged",
                file=sys.stderr,
            )
        elif stopped:
            if skip_incomplete:
                print(f"warning: skipping '{d}' (stopped at step {recs[-1]['step']} of {steps})", file=sys.stderr)
                continue
            raise CompareError(
                f"run '{d}' stopped at step {recs[-1]['step']} of train.steps={steps} (still running, "
                f"or failed: see its train.log); wait, rerun it (tools/run_comparison.py "
                f"--resume), or pass --skip-incomplete"
            )
        match = re.fullmatch(r"(.+)-seed(\d+)", d.name)
        mode = _label(cfg) or (match.group(1) if match else _mode_from_config(cfg))
        seed = cfg.get("train", {}).get("seed", int(match.group(2)) if match else 0)
        runs.append(Run(d, mode, int(seed), recs, stopped_nonfinite=nonfinite))
    if not runs:
        raise CompareError(f"no runs (folders with metrics.jsonl and config.yaml) under '{root}'")
    seen = {}
    for r in runs:
        if (r.mode, r.seed) in seen:
            raise CompareError(
                f"two runs of mode '{r.mode}' with seed {r.seed}: '{seen[r.mode, r.seed]}' and '{r.path}'; remove one"
            )
        seen[r.mode, r.seed] = r.path
    return runs


def group_modes(runs: list[Run], order: list[str] | None = None) -> dict[str, list[Run]]:
    """Runs per mode (each sorted by seed), modes in ``order`` (default DEFAULT_ORDER) then alphabetical."""
    order = order or DEFAULT_ORDER
    modes: dict[str, list[Run]] = {}
    for r in runs:
        modes.setdefault(r.mode, []).append(r)
    key = lambda m: (order.index(m) if m in order else len(order), m)  # noqa: E731
    return {m: sorted(modes[m], key=lambda r: r.seed) for m in sorted(modes, key=key)}


def _mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.stdev(xs) if len(xs) > 1 else math.nan


def _finite_vals(runs: list[Run]) -> list[float]:
    """Final validation losses of the runs that did not diverge (and logged one)."""
    return [v for v in (r.final_val_loss for r in runs) if math.isfinite(v)]


def summarize(modes: dict[str, list[Run]], baseline: str = "bf16") -> list[dict]:
    """One row per mode (see the module docstring for the columns); baseline columns are NaN without it.
    Diverged runs count in ``seeds`` and ``diverged``/``diverged_seeds`` only."""
    base = modes.get(baseline)
    b_val = _finite_vals(base) if base else []
    b_mean, b_std = _mean(b_val), _std(b_val)
    b_bytes = _mean([r.comm_bytes_per_step for r in base]) if base else math.nan
    b_by_seed = {r.seed: r.final_val_loss for r in base} if base else {}
    from verdict import describe_interval, describe_seeds_needed, paired_verdict

    rows = []
    for mode, rs in modes.items():
        v = paired_verdict({r.seed: r.final_val_loss for r in rs}, b_by_seed) if base and mode != baseline else None
        val = _finite_vals(rs)
        mean, std = _mean(val), _std(val)
        paired = [
            r.final_val_loss - b_by_seed[r.seed]
            for r in rs
            if r.seed in b_by_seed and math.isfinite(r.final_val_loss) and math.isfinite(b_by_seed[r.seed])
        ]
        by = _mean([r.comm_bytes_per_step for r in rs])
        gap = mean - b_mean
        diverged = [r.seed for r in rs if r.diverged]
        rows.append(
            {
                "mode": mode,
                "seeds": len(rs),
                "finite_runs": len(val),
                "diverged": len(diverged),
                "diverged_seeds": diverged,
                "reference_diverged_seeds": v["reference_diverged"] if v else [],
                "steps": max(r.records[-1]["step"] for r in rs),
                "final_val_loss_mean": mean,
                "final_val_loss_std": std,
                "gap": gap,
                "gap_sigma": gap / b_std if b_std and b_std > 0 else math.nan,
                "paired_gap": _mean(paired) if paired else math.nan,
                "final_train_loss_mean": _mean([r.final_loss for r in rs if not r.diverged]),
                "comm_bytes_per_step": by,
                "bytes_rel": by / b_bytes if b_bytes and b_bytes > 0 else math.nan,
                "tokens_per_sec": _mean([r.tokens_per_sec for r in rs]),
                "ci_lo": v["lo"] if v else math.nan,
                "ci_hi": v["hi"] if v else math.nan,
                "ci_method": v["method"] if v else "",
                "verdict": v["verdict"] if v else ("reference" if base else ""),
                "seeds_needed": v["seeds_needed"] if v else math.nan,
                "paired_seeds": v["n"] if v else 0,
                "seeds_needed_text": describe_seeds_needed(v) if v else "",
                "ci_text": describe_interval(v) if v else "",
            }
        )
    # sorted by the paired gap (the reference first, modes without a pair last)
    rows.sort(key=lambda r: (r["mode"] != baseline, math.isnan(r["paired_gap"]), r["paired_gap"]))
    return rows


CSV_COLUMNS = [
    "mode",
    "seeds",
    "diverged",
    "diverged_seeds",
    "steps",
    "final_val_loss_mean",
    "final_val_loss_std",
    "gap",
    "gap_sigma",
    "paired_gap",
    "paired_seeds",
    "ci_lo",
    "ci_hi",
    "ci_method",
    "verdict",
    "seeds_needed",
    "final_train_loss_mean",
    "comm_bytes_per_step",
    "bytes_rel",
    "tokens_per_sec",
]


def _csv_value(r: dict, k: str):
    """A row's value as the CSV writes it: blank for NaN, seeds as ``1;3``, seeds to resolve in words when it
    is not a number (``unknown (one pair)``, ``never (gap 0)``, ...)."""
    if k == "seeds_needed" and r.get("seeds_needed_text") and not r["seeds_needed_text"].isdigit():
        return r["seeds_needed_text"]
    x = r[k]
    if isinstance(x, list):
        return ";".join(map(str, x))
    return "" if isinstance(x, float) and math.isnan(x) else x


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: _csv_value(r, k) for k in CSV_COLUMNS})


def _f(x: float, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown_table(rows: list[dict], baseline: str) -> str:
    head = (
        f"| mode | seeds | final val loss (mean ± std) | gap to {baseline} | gap / {baseline} std | "
        f"paired gap | final train loss | bytes/step | bytes vs {baseline} | tokens/s |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        seeds = f"{r['seeds']} ({_diverged_text(r['diverged_seeds'])})" if r["diverged"] else f"{r['seeds']}"
        n = r["finite_runs"]
        std = _f(r["final_val_loss_std"], ".4f") if n > 1 else f"n/a ({n} finite run{'s' if n != 1 else ''})"
        lines.append(
            f"| {r['mode']} | {seeds} | {_f(r['final_val_loss_mean'], '.4f')} ± {std}"
            f" | {_f(r['gap'], '+.4f')} | {_f(r['gap_sigma'], '+.2f')} | {_f(r['paired_gap'], '+.4f')}"
            f" | {_f(r['final_train_loss_mean'], '.4f')} | {_f(r['comm_bytes_per_step'], ',.0f')}"
            f" | {_f(r['bytes_rel'], '.3f')} | {_f(r['tokens_per_sec'], ',.0f')} |"
        )
    return "\n".join(lines)


def _diverged_text(seeds: list[int]) -> str:
    """``1 diverged: seed 3`` / ``2 diverged: seeds 1, 4``."""
    return f"{len(seeds)} diverged: seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"


def verdict_table(rows: list[dict], baseline: str) -> str:
    """One line per mode: paired gap of the final validation loss to ``baseline`` with its 95% interval, the
    verdict, the seeds needed to resolve the gap and the diverged seeds (left out of the pairs; rows as
    :func:`summarize` sorts them)."""
    lines = [
        f"| mode | paired seeds | final val loss - {baseline} (same seed) | 95% interval | verdict | "
        f"seeds to resolve the gap | diverged (left out) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["mode"] == baseline or not r["verdict"]:
            continue
        div = [_diverged_text(r["diverged_seeds"])] if r["diverged_seeds"] else []
        if r["reference_diverged_seeds"]:
            div.append(f"{baseline} {_diverged_text(r['reference_diverged_seeds'])}")
        lines.append(
            f"| {r['mode']} | {r['paired_seeds']} | {_f(r['paired_gap'], '+.4f')} | "
            f"{r['ci_text']} | **{r['verdict']}** | {r['seeds_needed_text']} | {'; '.join(div) or 'none'} |"
        )
    return "\n".join(lines)


def _moving_average(v: list[float], w: int) -> list[float]:
    if w <= 1:
        return list(v)
    out, acc = [], 0.0
    for i, x in enumerate(v):
        acc += x
        if i >= w:
            acc -= v[i - w]
        out.append(acc / min(i + 1, w))
    return out


def aligned(rs: list[Run], key: str, smooth: int = 1) -> tuple[list[int], list[list[float]]]:
    """Steps logged in every run of ``rs`` and, per run, ``key`` at those steps (moving average first)."""
    per = []
    for r in rs:
        s, v = r.series(key)
        per.append(dict(zip(s, _moving_average(v, smooth))))
    steps = sorted(set.intersection(*(set(d) for d in per))) if per else []
    return steps, [[d[s] for s in steps] for d in per]


def gap_series(rs: list[Run], base: list[Run], key: str, smooth: int = 1) -> tuple[list[int], list[list[float]]]:
    """Per shared seed, ``key`` of the run minus ``key`` of the baseline run of the same seed, at common steps."""
    by_seed = {b.seed: b for b in base}
    pairs = [(r, by_seed[r.seed]) for r in rs if r.seed in by_seed]
    if not pairs:
        return [], []
    steps, vals = aligned([p for pair in pairs for p in pair], key, smooth)
    return steps, [[a - b for a, b in zip(vals[2 * i], vals[2 * i + 1])] for i in range(len(pairs))]


def _curve_runs(rs: list[Run]) -> tuple[list[Run], str]:
    """The runs a mode's curve averages (those that did not diverge; all of them when every one did, whose
    curves then end where they diverged) and the legend's count, e.g. ``n=2, 1 diverged``."""
    ok = [r for r in rs if not r.diverged]
    bad = len(rs) - len(ok)
    if not ok:
        return rs, f"n={len(rs)}, all diverged"
    return ok, f"n={len(ok)}" + (f", {bad} diverged" if bad else "")


STYLES = ["-", "--", "-.", ":"]
MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]


def _band(ax, steps, vals, label, color, i=0, band="minmax"):
    """Seed mean with a shaded band: ``minmax`` = min..max over seeds, ``ci`` = 95% t interval of the mean.
    Each mode gets its own line style and marker (``i``), so equal curves stay visible on top of each other."""
    mean = [sum(c) / len(c) for c in zip(*vals)]
    every = max(1, len(steps) // 12)
    ax.plot(
        steps,
        mean,
        label=label,
        color=color,
        lw=1.4,
        ls=STYLES[i % len(STYLES)],
        marker=MARKERS[i % len(MARKERS)],
        markevery=every,
        ms=4,
        mfc="none",
    )
    if len(vals) > 1:
        if band == "ci":
            from verdict import t_quantile

            n = len(vals)
            half = [t_quantile(n - 1) * statistics.stdev(c) / math.sqrt(n) for c in zip(*vals)]
            lo, hi = [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)]
        else:
            lo, hi = [min(c) for c in zip(*vals)], [max(c) for c in zip(*vals)]
        ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)


def plot(modes: dict[str, list[Run]], out: Path, baseline: str, smooth: int, title: str) -> list[Path]:
    """Write loss.png and (with a baseline) gap_to_<baseline>.png; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    written = []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (mode, rs) in enumerate(modes.items()):
        runs, count = _curve_runs(rs)
        for ax, key, sm in ((axes[0], "loss", smooth), (axes[1], "val_loss", 1)):
            steps, vals = aligned(runs, key, sm)
            if steps:
                _band(ax, steps, vals, f"{mode} ({count})", colors(i % 10), i)
    axes[0].set_title(f"train loss (moving average over {smooth} steps)" if smooth > 1 else "train loss")
    axes[1].set_title("validation loss")
    zoom_from = _zoom(axes[1], modes, "val_loss")
    if zoom_from is not None:
        axes[1].set_title(f"validation loss (y range of steps >= {zoom_from})")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{title}: seed mean, band = min..max over seeds")
    fig.tight_layout()
    p = out / "loss.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    written.append(p)

    base = [r for r in modes.get(baseline) or [] if not r.diverged]
    if base:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
        for i, (mode, rs) in enumerate(modes.items()):
            if mode == baseline:
                continue
            for ax, key, sm in ((axes[0], "loss", smooth), (axes[1], "val_loss", 1)):
                steps, vals = gap_series([r for r in rs if not r.diverged], base, key, sm)
                if steps:
                    _band(ax, steps, vals, f"{mode} (n={len(vals)})", colors(i % 10), i, band="ci")
        for ax, what in zip(axes, ("train loss", "validation loss")):
            ax.axhline(0.0, color="k", lw=0.8)
            ax.set_title(f"{what} minus {baseline} (same seed)")
            ax.set_xlabel("step")
            ax.set_ylabel("loss gap (nats/token)")
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=8)
        fig.suptitle(f"{title}: gap to {baseline} (same seed), mean over seeds, band = 95% t interval of the mean")
        fig.tight_layout()
        p = out / f"gap_to_{baseline}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        written.append(p)
    return written


def plot_rel_err(modes: dict[str, list[Run]], out: Path, title: str) -> Path | None:
    """``rel_err.png``: the live quantization error (``comm.telemetry_interval``) per mode, mean over its
    buckets (left) and, for GeoFP8 runs, its layers through the geometry-aware codec vs the plain codec
    (right); seed mean with a min..max band. None when no run logged it."""
    series = {}
    for mode, rs in modes.items():
        for key in ("comm/rel_err/bucket", "comm/rel_err/geo/", "comm/rel_err/euclid/"):
            per = [dict(zip(*r.mean_series(key))) for r in rs]
            steps = sorted(set.intersection(*(set(d) for d in per))) if per and all(per) else []
            if steps:
                series[mode, key] = (steps, [[d[st] for st in steps] for d in per])
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, mode in enumerate(modes):
        if (mode, "comm/rel_err/bucket") in series:
            _band(axes[0], *series[mode, "comm/rel_err/bucket"], mode, colors(i % 10), i)
        for j, (key, what) in enumerate((("comm/rel_err/geo/", "geo"), ("comm/rel_err/euclid/", "plain codec"))):
            if (mode, key) in series:
                _band(axes[1], *series[mode, key], f"{mode}: {what}", colors(i % 10), i + j)
    axes[0].set_title("round-trip error of each rank's gradient, mean over buckets")
    axes[1].set_title("GeoFP8 layers: through the transform vs the plain codec")
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("||Q(g) - g|| / ||g||  (DP mean)")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(f"{title}: live quantization error (comm.telemetry_interval), seed mean, band = min..max")
    fig.tight_layout()
    p = out / "rel_err.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def _zoom(ax, modes, key) -> int | None:
    """Limit the y axis to the values of the last 60% of steps (where the modes differ); returns the first
    step of that range."""
    pts = [(st, v) for rs in modes.values() for r in rs for st, v in zip(*r.series(key))]
    if len(pts) < 2:
        return None
    first = 0.4 * max(st for st, _ in pts)
    vals = [v for st, v in pts if st >= first]
    lo, hi = min(vals), max(vals)
    pad = 0.1 * (hi - lo) + 1e-3
    ax.set_ylim(lo - pad, hi + pad)
    return int(first)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("sweep_dir", help="folder of runs (tools/run_comparison.py --sweep-dir)")
    ap.add_argument("--out", default=None, help="output folder (default: SWEEP_DIR)")
    ap.add_argument("--baseline", default="bf16", help="mode the gaps are taken to (default bf16)")
    ap.add_argument("--smooth", type=int, default=10, help="moving-average window for the train-loss curves")
    ap.add_argument("--skip-incomplete", action="store_true", help="leave out run folders without metrics")
    ap.add_argument("--no-plots", action="store_true", help="tables only")
    a = ap.parse_args(argv)
    try:
        if a.smooth < 1:
            raise CompareError(f"--smooth {a.smooth} must be >= 1")
        runs = load_sweep(a.sweep_dir, a.skip_incomplete)
        order = None
        manifest = Path(a.sweep_dir) / "sweep.json"
        if manifest.is_file():
            try:
                order = json.loads(manifest.read_text()).get("presets")
            except (ValueError, AttributeError):
                print(
                    f"warning: '{manifest}' is not a sweep record (damaged?); modes in default order", file=sys.stderr
                )
        modes = group_modes(runs, order)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out or a.sweep_dir)
    if out.exists() and not out.is_dir():
        print(f"error: --out '{out}' is a file; pass a folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    lengths = sorted({r.records[-1]["step"] for r in runs})
    unequal = ""
    if len(lengths) > 1:
        unequal = (
            f"**Warning:** the runs have different lengths ({', '.join(map(str, lengths))} steps); their final "
            f"losses are not comparable. Put runs of one length in one sweep folder."
        )
        print(f"warning: {unequal.replace('**Warning:** ', '')}", file=sys.stderr)
    rows = summarize(modes, a.baseline)
    if a.baseline not in modes and a.baseline != "bf16":
        print(
            f"error: --baseline {a.baseline} is not a mode of this sweep; choose one of {', '.join(modes)}",
            file=sys.stderr,
        )
        return 2
    if a.baseline not in modes:
        print(
            f"warning: baseline mode '{a.baseline}' not in the sweep (modes: {', '.join(modes)}); gap and "
            f"relative-bytes columns are n/a (choose one with --baseline)",
            file=sys.stderr,
        )
    write_csv(rows, out / "results.csv")
    table = markdown_table(rows, a.baseline)
    n_div = sum(r.diverged for r in runs)
    note = (
        f"Sweep `{Path(a.sweep_dir).name}`: {len(runs)} runs, {len(modes)} modes"
        + (
            f", {n_div} diverged (non-finite end: left out of every mean, std and pair, named in the seeds column)"
            if n_div
            else ""
        )
        + ". Final val loss = last "
        f"validation loss of each run; std is the sample std over seeds; gap / {a.baseline} std = "
        f"(mean - {a.baseline} mean) / {a.baseline} std; paired gap = mean over seeds of (run - {a.baseline} "
        f"run of the same seed); bytes/step = bytes one rank sent for DP gradient reduction per step; "
        f"tokens/s = global, mean over steps after the first."
    )
    verdicts = verdict_table(rows, a.baseline) if a.baseline in modes and len(modes) > 1 else ""
    vnote = (
        f"Verdicts: paired (same-seed) difference of the final validation loss to {a.baseline}, 95% "
        f"confidence interval of its mean over seeds (Student t below 5 seeds, BCa bootstrap from 5); better / "
        f"worse only when the interval excludes 0; seeds to resolve = paired seeds whose t interval would be "
        f"narrower than the observed gap (tools/verdict.py)."
    )
    (out / "results.md").write_text(
        (f"{unequal}\n\n" if unequal else "")
        + f"{note}\n\n{table}\n"
        + (f"\n{vnote}\n\n{verdicts}\n" if verdicts else "")
    )
    print(table)
    if verdicts:
        print()
        print(verdicts)
    if not a.no_plots:
        for p in plot(modes, out, a.baseline, a.smooth, Path(a.sweep_dir).name):
            print(f"wrote {p}")
        p = plot_rel_err(modes, out, Path(a.sweep_dir).name)
        if p is not None:
            print(f"wrote {p}")
    print(f"wrote {out / 'results.md'} and {out / 'results.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
