#!/usr/bin/env python
"""Run one training per (comm preset, seed) into one sweep folder, so the modes can be compared.

    python tools/run_comparison.py --config configs/tiny.yaml --sweep-dir runs/sweep_tiny
    python tools/run_comparison.py --config configs/llama_600m.yaml --sweep-dir runs/sweep_600m --slurm
    python tools/run_comparison.py ... --presets bf16 fp8 geofp8 --seeds 2 train.steps=300

Every run writes to ``SWEEP_DIR/<preset>-seed<k>/`` (``train.run_dir``), uses ``train.seed=<k>`` and
``logging.wandb_group=<sweep name>`` (``logging.wandb_name=<preset>-seed<k>``), so the curves of one
sweep line up in one wandb group. Extra ``section.key=value`` arguments are passed to every run (after
the ones above, so they may override them, except run_dir/seed/group).

Locally each run is ``torchrun --standalone --nproc-per-node N pretrain_llama.py --config MODEL
--config configs/comm/<preset>.yaml OVERRIDES`` (one after the other; stdout+stderr go to
``<run>/train.log``). With ``--slurm`` each run is instead submitted as
``sbatch [--job-name ...] scripts/slurm/pretrain.sbatch --config MODEL --config PRESET OVERRIDES``
(nodes, GPUs and time go in ``--sbatch-arg``; submit from the repository root, which the job uses as
``MG_ROOT``; Slurm logs go to ``logs/``). ``SWEEP_DIR/sweep.json`` records the presets, seeds and
exact commands, and each run folder its own arguments (``sweep_args.json``). ``tools/compare_runs.py
SWEEP_DIR`` then makes the plots and tables.

Re-running into an existing sweep folder: a run folder whose recorded arguments equal this run's is
continued (a finished one is reported "already complete with the same arguments", an unfinished one resumes
from its checkpoint). A run folder with different (or unrecorded) arguments is an error unless
``--resume`` (unrecorded arguments: trust that they are the same and continue) or ``--force`` (start new
runs; the old folders are moved to ``SWEEP_DIR/.replaced/``, nothing is deleted).

Exit status: 0 if every run finished (or was submitted), 1 if any failed (the others still run),
2 for bad arguments (unknown preset, missing config file, missing sbatch script).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = ROOT / "configs" / "comm"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from megatron_geo.config.presets import comm_presets  # noqa: E402
from megatron_geo.config.renamed import renamed_hint  # noqa: E402

DEFAULT_PRESETS = list(comm_presets(PRESET_DIR))  # every configs/comm/*.yaml, by name
SBATCH_SCRIPT = ROOT / "scripts" / "slurm" / "pretrain.sbatch"
RESERVED = ("train.run_dir", "train.seed", "logging.wandb_group", "logging.wandb_name")


class SweepError(ValueError):
    """Bad sweep arguments; the message names the value and the fix."""


def resolve_preset(name: str) -> tuple[str, Path]:
    """``(label, yaml path)`` of a preset given by name (``configs/comm/<name>.yaml``) or by path."""
    p = Path(name)
    if p.suffix in (".yaml", ".yml"):
        if not p.is_file():
            raise SweepError(f"preset file '{name}' not found")
        if p.parent.name != "comm":
            raise SweepError(
                f"preset file '{name}' is not in a 'comm' folder; comm presets live in configs/comm/ (a "
                f"model config goes to --config)"
            )
        return p.stem, p
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        known = list(comm_presets(PRESET_DIR))
        raise SweepError(
            f"unknown comm preset '{name}'{renamed_hint(name)}; choose from {', '.join(known)} (configs/comm/) or pass "
            f"a YAML file path"
        )
    return name, path


def plan_runs(
    configs: list[str], presets: list[str], seeds: list[int], sweep_dir: Path, overrides: list[str]
) -> list[dict]:
    """One entry per (seed, preset), seed-major: ``name``, ``run_dir``, ``preset``, ``seed``, ``config_args``
    (``--config`` files then overrides, as pretrain_llama.py and the sbatch script take them)."""
    for c in configs:
        if not Path(c).is_file():
            raise SweepError(f"model config '{c}' not found (pass an existing YAML file to --config)")
    for ov in overrides:
        key = "".join(ov.split("=", 1)[0].split())  # the config loader ignores spaces in keys: so does this check
        if "=" not in ov or "." not in key:
            raise SweepError(f"override '{ov}' is not of the form section.key=value (e.g. train.steps=300)")
        if key in RESERVED:
            raise SweepError(f"override '{ov}': {key} is set per run by the sweep; use --sweep-dir/--seeds instead")
    if not seeds:
        raise SweepError("no seeds: pass --seeds N (N >= 1) or --seed-list")
    if any(sd < 0 for sd in seeds) or len(set(seeds)) != len(seeds):
        raise SweepError(f"seeds {seeds}: each must be a distinct integer >= 0")
    if not presets:
        raise SweepError("no presets: pass --presets NAME [NAME ...] (files in configs/comm/)")
    group = sweep_dir.name
    runs = []
    resolved = [resolve_preset(p) for p in presets]
    # seed-major: every preset with the first seed, then the next seed, so a sweep stopped early
    # still compares all modes
    for seed in seeds:
        for label, path in resolved:
            name = f"{label}-seed{seed}"
            run_dir = sweep_dir / name
            args = []
            for c in configs:
                args += ["--config", str(c)]
            args += [
                "--config",
                os.path.relpath(path),
                f"train.run_dir={run_dir}",
                f"train.seed={seed}",
                f"logging.wandb_group={group}",
                f"logging.wandb_name={name}",
                *overrides,
            ]
            runs.append({"name": name, "preset": label, "seed": seed, "run_dir": str(run_dir), "config_args": args})
    return runs


def run_finished(run_dir: Path) -> bool:
    """True if ``run_dir/metrics.jsonl`` ends with the last step of ``config.yaml`` (``train.steps``)."""
    import yaml

    m, c = run_dir / "metrics.jsonl", run_dir / "config.yaml"
    if not (m.is_file() and c.is_file()):
        return False
    try:
        steps = yaml.safe_load(c.read_text())["train"]["steps"]
        lines = [ln for ln in m.read_text().splitlines() if ln.strip()]
        return bool(lines) and json.loads(lines[-1])["step"] == steps
    except (ValueError, KeyError, TypeError):
        return False


ARGS_FILE = "sweep_args.json"


def last_step(run_dir: Path) -> int:
    """The last step in ``run_dir/metrics.jsonl`` (0 when there is none)."""
    m = run_dir / "metrics.jsonl"
    if not m.is_file():
        return 0
    for ln in reversed(m.read_text().splitlines()):
        try:
            return int(json.loads(ln)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def recorded_args(run_dir: Path) -> dict | None:
    """``{"config_args": [...], "config": resolved config}`` a run folder was started with (None: not recorded,
    or not a run folder yet)."""
    f = run_dir / ARGS_FILE
    try:
        rec = json.loads(f.read_text()) if f.is_file() else None
        return rec if rec and "config_args" in rec else None
    except (ValueError, TypeError):
        return None


def resolve_configs(runs: list[dict], world: int | None) -> None:
    """Load and check every run's config before anything is launched (a typo'd key, a bad value or two comm
    presets fail here, naming the run, instead of once per run inside its train.log); stores the resolved
    config in ``run["config"]``. ``world``: processes per run (None: the smallest that fits, for --slurm).

    Raises:
        SweepError: the first run whose config does not load or validate.
    """
    sys.path.insert(0, str(ROOT))
    from megatron_geo.config import ConfigError, config_to_dict, load_config
    from megatron_geo.training.validate import reject_inert_keys, validate_config

    for r in runs:
        args = r["config_args"]
        files = [a for prev, a in zip(args, args[1:]) if prev == "--config"]
        overrides = [a for i, a in enumerate(args) if a != "--config" and (i == 0 or args[i - 1] != "--config")]
        try:
            cfg = load_config(files, overrides)
            validate_config(cfg, world if world is not None else cfg.parallel.tensor)
            reject_inert_keys(cfg)  # a key with no effect on this run (e.g. geo.* on a plain fp8 preset)
        except ConfigError as e:
            raise SweepError(f"run {r['name']}: {e}") from None
        r["config"] = config_to_dict(cfg)


def _differences(old: dict, new: dict) -> list[str]:
    """``section.key: old -> new`` for every key whose resolved value differs (paths that name the same folder,
    e.g. a relative and an absolute ``train.run_dir``, are equal)."""
    out = []
    for sec in sorted(set(old) | set(new)):
        a, b = old.get(sec) or {}, new.get(sec) or {}
        for k in sorted(set(a) | set(b)):
            va, vb = a.get(k), b.get(k)
            if (
                (sec, k) in (("train", "run_dir"), ("checkpoint", "dir"))
                and va
                and vb
                and Path(va).resolve() == Path(vb).resolve()
            ):
                continue
            if va != vb:
                out.append(f"{sec}.{k}: {a.get(k)!r} -> {b.get(k)!r}")
    return out


def check_existing(runs: list[dict], resume: bool, force: bool) -> list[dict]:
    """Per planned run whose folder already exists: ``{"run", "state"}`` with state ``same`` (recorded
    arguments equal), ``unrecorded`` (a folder with outputs but no record) or ``different``.

    Raises:
        SweepError: a folder with different arguments (without ``--force``), or unrecorded ones (without
            ``--resume`` or ``--force``); the message names the run and the differing arguments.
    """
    out = []
    for r in runs:
        d = Path(r["run_dir"])
        if not d.is_dir() or not any(d.iterdir()):
            continue
        rec = recorded_args(d)
        diffs = []
        if rec is None:
            state = "unrecorded"
        elif "config" in rec and "config" in r:  # compare what the runs would train, not how it was spelled
            diffs = _differences(rec["config"], r["config"])
            state = "different" if diffs else "same"
        else:
            state = "same" if sorted(rec["config_args"]) == sorted(r["config_args"]) else "different"
            diffs = [f"arguments {rec['config_args']} -> {r['config_args']}"] if state == "different" else []
        out.append({"run": r, "state": state})
        if force:
            continue
        if state == "different":
            raise SweepError(
                f"run folder '{d}' was started with another config ({'; '.join(diffs[:6])}"
                f"{'; ...' if len(diffs) > 6 else ''}); use another --sweep-dir, or --force to start "
                f"new runs (the old folders are moved to {d.parent / '.replaced'}/)"
            )
        if state == "unrecorded" and not resume:
            raise SweepError(
                f"run folder '{d}' exists but records no arguments ({ARGS_FILE}); pass --resume to "
                f"continue it as this sweep's run, or --force to start new runs"
            )
    return out


def local_command(run: dict, nproc: int, python: str) -> list[str]:
    torchrun = [python, "-m", "torch.distributed.run"]
    return [
        *torchrun,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(ROOT / "pretrain_llama.py"),
        *run["config_args"],
    ]


def slurm_command(run: dict, sbatch_args: list[str]) -> list[str]:
    return ["sbatch", f"--job-name={run['name']}", *sbatch_args, str(SBATCH_SCRIPT), *run["config_args"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--config", action="append", default=None, help="model config YAML (repeatable; default configs/tiny.yaml)"
    )
    ap.add_argument(
        "--presets",
        nargs="+",
        default=DEFAULT_PRESETS,
        help="comm presets, space- or comma-separated (names in configs/comm/ or YAML paths; default: "
        "every preset in configs/comm/)",
    )
    ap.add_argument("--seeds", type=int, default=3, help="number of seeds: train.seed = 1..N (default 3)")
    ap.add_argument("--seed-list", type=int, nargs="+", default=None, help="explicit seeds (overrides --seeds)")
    ap.add_argument("--sweep-dir", default="runs/sweep", help="output folder; its name is the wandb group")
    ap.add_argument("--nproc", type=int, default=2, help="processes per local run (torchrun --nproc-per-node)")
    ap.add_argument(
        "--slurm",
        action="store_true",
        help="submit each run with sbatch scripts/slurm/pretrain.sbatch instead of running torchrun",
    )
    ap.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        help="extra sbatch option, e.g. --sbatch-arg=--nodes=64 (repeatable)",
    )
    ap.add_argument(
        "--skip-finished",
        action="store_true",
        help="old spelling of --resume (finished runs with the same arguments are always skipped)",
    )
    ap.add_argument(
        "--resume", action="store_true", help="continue run folders that record no arguments as this sweep's runs"
    )
    ap.add_argument(
        "--force",
        action="store_true",
        help="start new runs where a folder exists (moved to SWEEP_DIR/.replaced/, not deleted)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    ap.add_argument("overrides", nargs="*", help="section.key=value passed to every run")
    a = ap.parse_args(argv)

    # `--presets a b key=value` : argparse gives the trailing overrides to --presets; move them back
    presets = [x for item in a.presets if "=" not in item for x in item.split(",") if x]
    overrides = [item for item in a.presets if "=" in item] + a.overrides
    sweep_dir = Path(a.sweep_dir)
    seeds = a.seed_list if a.seed_list else list(range(1, a.seeds + 1))
    try:
        if a.nproc < 1:
            raise SweepError(f"--nproc {a.nproc} must be >= 1")
        runs = plan_runs(
            a.config or [os.path.relpath(ROOT / "configs" / "tiny.yaml")], presets, seeds, sweep_dir, overrides
        )
        if a.slurm and not SBATCH_SCRIPT.is_file():
            raise SweepError(f"--slurm needs {SBATCH_SCRIPT} (not found)")
        if a.slurm and not a.dry_run and shutil.which("sbatch") is None:
            raise SweepError("--slurm: 'sbatch' is not on PATH; run on a Slurm login node or drop --slurm")
        if a.resume and a.force:
            raise SweepError("--resume and --force contradict each other; pass one")
        dup = sorted({r["name"] for r in runs if sum(x["name"] == r["name"] for x in runs) > 1})
        if dup:
            raise SweepError(f"--presets names {dup[0].rsplit('-seed', 1)[0]} twice; pass each preset once")
        resolve_configs(runs, None if a.slurm else a.nproc)
        same = {}
        for r in runs:  # two presets that end as the same settings would be one mode twice in compare_runs
            other = same.setdefault((r["config"]["comm"]["label"], r["seed"]), r)
            if other is not r:
                raise SweepError(
                    f"presets {other['preset']} and {r['preset']} resolve to the same comm settings "
                    f"(label {r['config']['comm']['label']}) with these overrides; drop one"
                )
        existing = check_existing(runs, a.resume or a.skip_finished, a.force)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    cmds = [slurm_command(r, a.sbatch_arg) if a.slurm else local_command(r, a.nproc, sys.executable) for r in runs]
    if a.dry_run:
        for c in cmds:
            print(shlex.join(c))
        return 0
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if a.force:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for e in existing:
            d = Path(e["run"]["run_dir"])
            dest = sweep_dir / ".replaced" / f"{d.name}-{stamp}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(d), str(dest))
            print(f"{d.name}: the old run folder was moved to {dest}", flush=True)
    try:  # a re-run with fewer presets or seeds keeps the earlier ones in the record (and compare_runs' order)
        before = json.loads((sweep_dir / "sweep.json").read_text())
        prev_presets, prev_seeds = list(before.get("presets") or []), list(before.get("seeds") or [])
    except (OSError, ValueError, AttributeError):
        prev_presets, prev_seeds = [], []
    manifest = {
        "sweep": sweep_dir.name,
        "presets": list(dict.fromkeys(prev_presets + [r["preset"] for r in runs])),
        "seeds": sorted(set(prev_seeds) | set(seeds)),
        "launcher": "slurm" if a.slurm else f"torchrun x{a.nproc}",
        "argv": sys.argv,
        "runs": [
            {**{k: v for k, v in r.items() if k != "config"}, "command": shlex.join(c)} for r, c in zip(runs, cmds)
        ],
    }
    (sweep_dir / "sweep.json").write_text(json.dumps(manifest, indent=1))

    failed = []
    for i, (run, cmd) in enumerate(zip(runs, cmds), 1):
        run_dir = Path(run["run_dir"])
        if run_finished(run_dir):  # arguments checked above: the same (or --resume)
            print(
                f"[{i}/{len(runs)}] {run['name']}: ok (already complete with the same arguments; not run again)",
                flush=True,
            )
            continue
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / ARGS_FILE).write_text(
            json.dumps({"config_args": run["config_args"], "config": run["config"]}, indent=1) + "\n"
        )
        before = last_step(run_dir)
        if a.slurm:
            Path("logs").mkdir(exist_ok=True)  # pretrain.sbatch writes logs/%x-%j.out under the submit folder
            res = subprocess.run(cmd, capture_output=True, text=True)
            msg = (res.stdout + res.stderr).strip()
            print(f"[{i}/{len(runs)}] {run['name']}: {msg}", flush=True)
            if res.returncode:
                failed.append(run["name"])
            continue
        t0 = time.time()
        print(f"[{i}/{len(runs)}] {run['name']}: {shlex.join(cmd)}", flush=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(run_dir / "train.log", "a" if before else "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
        after = last_step(run_dir)
        how = f"trained steps {before + 1}-{after}" + (f" (resumed from step {before})" if before else "")
        status = f"ok ({how})" if rc == 0 else f"FAILED (exit {rc}; see {run_dir / 'train.log'})"
        print(f"[{i}/{len(runs)}] {run['name']}: {status} in {time.time() - t0:.0f} s", flush=True)
        if rc:
            failed.append(run["name"])
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"sweep done: {len(runs)} runs in {sweep_dir}/; next: {sys.executable} tools/compare_runs.py {sweep_dir}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the run in progress got the Ctrl-C too; its checkpoint (if any) is kept
        print(
            "\ninterrupted; run the same command again to continue the sweep (finished runs are not repeated, "
            "unfinished ones resume from their last checkpoint)",
            file=sys.stderr,
        )
        sys.exit(130)
