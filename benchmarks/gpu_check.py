#!/usr/bin/env python
"""Runner of benchmarks/gpu_check.sh: every phase in its own process with its own time limit, inside one overall limit.

    python3 benchmarks/gpu_check.py run [--dry-run] [--python CMD] [--overall-s 470] DIR
    python3 benchmarks/gpu_check.py phase NAME --out PART.json --work FOLDER [--dry-run]   (one phase; run starts it)

``run`` writes exactly two files into DIR, both rebuilt after every phase (and every 15 s while one runs), so a run
stopped at any point leaves the phases done so far: ``gpu_check.json`` (one entry per phase: ``status`` ok | failed |
timed_out | stopped | running | pending | skipped, its seconds and time limit, its figures and checks, and for a
phase that did not pass its ``error`` and the last lines of its log) and ``gpu_check_logs.tar.gz`` (every phase's
log as ``gpu_check_logs/<phase>.log``, and this runner's own as ``gpu_check_logs/gpu_check.log``). Top level:
``finished`` (the run got to its end), ``failed`` (the phases that did not pass), ``python``, ``overall_limit_s``,
``budgets_s``, ``launch``. The phases run with the optional packages (wandb, datasets, lm_eval) made absent, as on a
machine without them (the CUDA tests see the machine as it is). A phase that finds it cannot run on the machine
(``cuda_tests`` without pytest) is ``skipped`` with its ``reason``, not failed. Speeds relative to a device copy are
``time_over_copy`` throughout: the operation's time / the copy's (> 1: slower than the copy).

A phase's limit is its budget (:data:`PHASES`, seconds; they add up to 450) or what is left of the overall limit,
whichever is smaller; at its limit the phase's process group gets SIGTERM, then SIGKILL. SIGTERM / SIGINT to the
runner (the overall ``timeout`` of gpu_check.sh) stop the running phase, record it as ``stopped`` and the rest as
``pending``, and write both files. Exit code: 0 every phase passed, 1 some did not, 2 no CUDA device without
``--dry-run`` (or a bad setting), 124 stopped by a signal.

Settings (environment): ``GPU_CHECK_ONLY=a,b`` runs those phases only (``env`` always runs on a GPU);
``GPU_CHECK_LIMITS=a=30,b=60`` replaces budgets (seconds); ``GPU_CHECK_LAUNCH=exec`` starts every phase as a new
interpreter (the default on a GPU: a clean CUDA context each) and ``fork`` forks it from the runner after one import
of torch and megatron_geo (the dry run's default: the CPU time of eight imports saved; the runner never touches a
device); ``GPU_CHECK_KEEP_WORK=1`` keeps the work folder (run dirs, checkpoints; printed at the end);
``GPU_CHECK_STALL=a=20`` makes phase a sleep that long before it starts (to test the time limits).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name, budget (s), what it checks -- most valuable first: the code paths that never ran on a GPU before, then the
# CUDA tests, then the performance figures
PHASES: list[tuple[str, int, str]] = [
    ("env", 35, "interpreter, torch >= 2.9, the device; every module imports without wandb / datasets / lm_eval"),
    ("checkpoint", 50, "save and resume on the device (one process): resumed step count and losses continue"),
    ("geo", 35, "GeoFP8 refreshes under BF16 autocast at DP = 2: FP32 factors, refresh count; per-layer cost"),
    ("overlap", 30, "parameter all-gather with and without overlap at DP = 2: time to the first wait, the wait"),
    (
        "param_gather",
        20,
        "parameter gather of llama_600m buckets, plain BF16 vs fp8 / nvfp4 difference: encode, decode, bytes",
    ),
    ("compile", 80, "train.compile=true with GeoFP8 refreshes and overlap_param_gather: graphs, recompiles"),
    ("cuda_tests", 60, "python3 -m pytest on the tests that need CUDA"),
    ("train_600m", 50, "Llama-600M on one device: tokens/s, peak memory, TFLOP/s, MFU (DP 1 and a DP 64 rank)"),
    # every preset's eager row, then one compiled run per compile group (its graphs compiled once, in the background)
    ("codec", 90, "codec kernels and the reducers' bucket path (eager, compiled, bitwise) next to a device copy"),
]
NAMES = [p[0] for p in PHASES]
OPTIONAL_PACKAGES = ("wandb", "datasets", "lm_eval")
KILL_GRACE_S = 5.0  # SIGTERM -> SIGKILL of a phase at its limit
MIN_PHASE_S = 5.0  # a phase with less time left than this is skipped
REFRESH_S = 15.0  # how often the two files are rebuilt while a phase runs
LOG_TAIL = 20  # log lines kept in the JSON entry of a phase that did not pass


class SettingError(ValueError):
    """A bad GPU_CHECK_* setting (names it and the fix)."""


def parse_pairs(var: str, positive: bool = True) -> dict[str, float]:
    """``name=seconds,...`` from the environment variable ``var`` (names must be phases)."""
    text = os.environ.get(var, "").strip()
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, val = item.partition("=")
        try:
            secs = float(val)
        except ValueError:
            secs = float("nan")
        if not sep or name not in NAMES or not secs > 0:
            raise SettingError(
                f"{var}={text!r}: {item!r} must be PHASE=SECONDS with SECONDS > 0 and PHASE one of {', '.join(NAMES)}"
            )
        out[name] = secs
    return out


def parse_only() -> list[str] | None:
    text = os.environ.get("GPU_CHECK_ONLY", "").strip()
    if not text:
        return None
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in NAMES]
    if bad:
        raise SettingError(f"GPU_CHECK_ONLY={text!r}: unknown phase {bad[0]!r}; choose from {', '.join(NAMES)}")
    return names


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies (a phase never outlives a killed runner)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- not Linux: the runner's process-group kill still applies
        pass


def _tail(path: Path, n: int = LOG_TAIL) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


class Forked:
    """A phase process forked from the runner (``GPU_CHECK_LAUNCH=fork``, the dry run's default): the same as
    starting ``gpu_check.py phase ...`` with the interpreter, without importing torch and megatron_geo again (the
    runner imported them before the first fork; it never touches a device). ``wait`` / ``returncode`` / ``pid``
    as ``subprocess.Popen``; the child leads its own session, so ``os.killpg(pid, ...)`` stops it and its children."""

    def __init__(self, argv: list[str], env: dict, log: Path):
        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode = None
        self.pid = os.fork()
        if self.pid:
            return
        code = 1
        try:  # the child: never returns
            os.setsid()
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(s, signal.SIG_DFL)
            fd = os.open(log, os.O_WRONLY | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            sys.stdout.reconfigure(line_buffering=True)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(ROOT)
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"phase pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def preload() -> str | None:
    """Import torch and megatron_geo's training path into this process before the phases fork from it, with the
    optional packages blocked as in a phase; returns why not (then the phases are started as new processes)."""
    try:
        block_optional()
        sys.path.insert(0, str(HERE))
        import gpu_check_phases  # noqa: F401 -- imports torch

        import megatron_geo.training.trainer  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


class Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, _frame):
    raise Stopped(signum)


class Runner:
    def __init__(
        self,
        out_dir: Path,
        dry_run: bool,
        python: str,
        overall_s: float,
        only: list[str] | None,
        limits: dict[str, float],
        launch: str,
    ):
        self.t0 = time.monotonic()
        self.overall_s = overall_s
        # leave time inside the overall limit to stop the last phase and write both files
        self.deadline = self.t0 + overall_s - min(15.0, overall_s / 4)
        self.out_dir, self.dry_run, self.python, self.only, self.limits = out_dir, dry_run, python, only, limits
        self.fork = launch == "fork"
        self.self_skipped: list[str] = []  # phases that found they cannot run on this machine
        if dry_run:  # tiny CPU ops: threads only contend (10x slower on 2 shared cores); before torch is imported
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.installed = {p: importlib.util.find_spec(p) is not None for p in OPTIONAL_PACKAGES}
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.logs = self.work / "logs"
        self.parts = self.work / "parts"
        self.logs.mkdir()
        self.parts.mkdir()
        self.runlog = open(self.logs / "gpu_check.log", "w")  # noqa: SIM115 -- the run log, open for the whole run
        self.state: dict = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "dry_run": dry_run,
            "python": python,
            # finished: the run got to its end (not stopped by a signal, not refused for want of CUDA); failed: the
            # phases that did not pass (failed, timed out, stopped, or skipped for lack of time)
            "overall_limit_s": overall_s,
            "phase_order": NAMES,
            "finished": False,
            "failed": [],
            "budgets_s": {n: b for n, b, _ in PHASES},
            "launch": "fork" if self.fork else "exec",
        }
        for name, budget, what in PHASES:
            self.state[name] = {"status": "pending", "what": what, "budget_s": limits.get(name, budget)}

    # -- output ---------------------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.runlog.write(line + "\n")
        self.runlog.flush()

    def write(self) -> None:
        """Both output files, each replaced atomically."""
        self.state["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out_dir / ".gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.state, indent=1, allow_nan=False, default=str) + "\n")
        os.replace(tmp, self.out_dir / "gpu_check.json")
        tmp = self.out_dir / ".gpu_check_logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for log in sorted(self.logs.glob("*.log")):
                tar.add(log, arcname=f"gpu_check_logs/{log.name}")
        os.replace(tmp, self.out_dir / "gpu_check_logs.tar.gz")

    def _merge_part(self, name: str, entry: dict) -> dict:
        part = self.parts / f"{name}.json"
        try:
            figures = json.loads(part.read_text())
        except (OSError, ValueError):
            figures = {}
        return {**entry, **{k: v for k, v in figures.items() if k not in entry}}

    # -- one phase --------------------------------------------------------------------------------------------
    def run_phase(self, name: str, budget: float) -> None:
        log = self.logs / f"{name}.log"
        left = self.deadline - time.monotonic()
        if left < MIN_PHASE_S:
            self.state[name].update(
                status="skipped",
                reason=f"no time left in the overall limit of {self.overall_s:.0f} s (GPU_CHECK_TIMEOUT)",
            )
            self.state["failed"].append(name)
            self.say(f"{name}: skipped (no time left)")
            return
        limit = min(budget, left)
        by_overall = limit < budget
        cmd = [
            self.python,
            str(HERE / "gpu_check.py"),
            "phase",
            name,
            "--out",
            str(self.parts / f"{name}.json"),
            "--work",
            str(self.work),
        ] + (["--dry-run"] if self.dry_run else [])
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "disabled",
            "GPU_CHECK_PARENT": str(os.getpid()),
            "GPU_CHECK_INSTALLED": json.dumps(self.installed),
            "GPU_CHECK_PHASE_END": str(time.time() + limit),  # the phase drops optional pieces near its limit
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
        }
        if name == "compile":
            env.setdefault("TORCH_LOGS", "recompiles,graph_breaks")  # the reasons, in its log
        if name in ("checkpoint", "cuda_tests"):
            # deterministic cuBLAS for the bitwise comparisons (the resume; the CUDA tests' runs under
            # torch.use_deterministic_algorithms), set before the process makes its first cuBLAS handle
            env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        base = {
            "status": "running",
            "what": self.state[name]["what"],
            "budget_s": budget,
            "limit_s": round(limit, 1),
            "log": f"gpu_check_logs/{name}.log",
        }
        self.state[name] = dict(base)
        cut = ", cut to what is left of the overall limit" if by_overall else ""
        self.say(f"{name} (limit {limit:.0f} s{cut}) ...")
        t0 = time.monotonic()
        with open(log, "w") as f:
            f.write(f"$ {' '.join(cmd)}{'   (forked from the runner)' if self.fork else ''}\n")
            f.flush()
            if self.fork:
                proc = Forked(cmd[2:], env, log)
            else:
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
        self.write()
        timed_out, last_refresh = False, time.monotonic()
        try:
            while True:
                try:
                    rc = proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic()
                if now - t0 > limit:
                    timed_out = True
                    rc = self._kill(proc)
                    break
                if now - last_refresh > REFRESH_S:
                    self.state[name] = self._merge_part(name, {**base, "seconds": round(now - t0, 1)})
                    self.write()
                    last_refresh = now
        except Stopped as s:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            self._kill(proc)
            self.state[name] = self._merge_part(
                name,
                {
                    **base,
                    "status": "stopped",
                    "seconds": round(time.monotonic() - t0, 1),
                    "error": f"the run was stopped by {s} while this phase ran (the overall limit of gpu_check.sh, "
                    f"GPU_CHECK_TIMEOUT={self.overall_s:.0f} s, or the machine's command limit)",
                    "log_tail": _tail(log),
                },
            )
            raise
        secs = round(time.monotonic() - t0, 1)
        entry = {**base, "seconds": secs, "exit_code": rc}
        if timed_out:
            which = "what was left of the overall limit" if by_overall else "its budget"
            entry.update(
                status="timed_out",
                error=f"time limit {limit:.0f} s reached ({which}); the phase was "
                f"killed; the figures it had saved are kept",
            )
        elif rc == 0:
            entry["status"] = "ok"
        else:
            entry["status"] = "failed"
        entry = self._merge_part(name, entry)
        if entry["status"] == "ok" and entry.get("phase_skipped"):  # the phase found it cannot run here, and said why
            entry.update(status="skipped", reason=entry.pop("phase_skipped"))
            self.self_skipped.append(name)
        elif entry["status"] != "ok":
            if entry["status"] == "failed" and "error" not in entry:
                bad = entry.get("failed_checks")
                entry["error"] = f"failed checks: {'; '.join(bad)}" if bad else f"exit code {rc}"
            entry["log_tail"] = _tail(log)
            self.state["failed"].append(name)
        self.state[name] = entry
        why = entry.get("error") or (entry.get("reason") if entry["status"] == "skipped" else None)
        self.say(f"{name}: {entry['status']} in {secs:.1f} s" + (f" -- {why}" if why else ""))
        for line in entry.get("log_tail", [])[-6:]:
            self.say(f"    | {line[:300]}")
        head = headline(name, entry)
        if head:
            self.say(f"    {head}")

    def _kill(self, proc) -> int:
        for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                return proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        return proc.returncode if proc.returncode is not None else -9

    # -- the run ----------------------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        finally:
            if os.environ.get("GPU_CHECK_KEEP_WORK") == "1":
                print(f"[gpu_check] work folder kept: {self.work}", flush=True)
            else:
                shutil.rmtree(self.work, ignore_errors=True)

    def _run(self) -> int:
        self.say(
            f"{'dry run (CPU, small sizes)' if self.dry_run else 'GPU run'} with {self.python}; overall limit "
            f"{self.overall_s:.0f} s; output {self.out_dir}"
        )
        self.write()
        code = 0
        try:
            problem = preload() if self.fork else None
            if problem:
                self.fork = False
                self.state["launch"] = "exec"
                self.state["launch_note"] = (
                    f"fork was asked for but the runner could not import the phases "
                    f"({problem}); each phase started a new interpreter"
                )
            for name, budget, _ in PHASES:
                budget = self.limits.get(name, budget)
                if self.only is not None and name not in self.only and not (name == "env" and not self.dry_run):
                    self.state[name].update(status="skipped", reason=f"not in GPU_CHECK_ONLY={','.join(self.only)}")
                    continue
                try:
                    self.run_phase(name, budget)
                except (Stopped, KeyboardInterrupt):
                    raise
                except Exception as e:  # noqa: BLE001 -- a runner bug must not lose the other phases
                    self.state[name].update(
                        status="failed", error=f"the runner failed on this phase: {type(e).__name__}: {e}"
                    )
                    self.state["failed"].append(name)
                    self.say(f"{name}: the runner failed: {traceback.format_exc()}")
                self.write()
                # no CUDA (or no torch) is a refusal; an env phase cut by its limit (a cold first import of torch)
                # tells nothing, and the device phases say for themselves
                if (
                    name == "env"
                    and not self.dry_run
                    and self.state["env"].get("cuda_available") is not True
                    and self.state["env"]["status"] != "timed_out"
                ):
                    env = self.state["env"]
                    why = env.get("error") or (
                        f"torch {env.get('torch')} (CUDA build {env.get('torch_cuda_build')}) sees no CUDA device"
                    )
                    msg = (
                        f"no CUDA device visible to {self.python}: {why}; run on a GPU machine, set MG_PYTHON to "
                        f"a CUDA build's python, or use --dry-run"
                    )
                    print(f"error: {msg}", file=sys.stderr)
                    for n in NAMES[1:]:
                        self.state[n].update(status="skipped", reason="no CUDA device (see env)")
                    self.state["error"] = msg
                    code = 2
                    break
            self.state["finished"] = code == 0
        except Stopped as s:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)  # finish writing both files
            self.say(f"stopped by {s}: the phases not run are left as pending")
            self.state["error"] = (
                f"stopped by {s} (the overall limit of gpu_check.sh, GPU_CHECK_TIMEOUT="
                f"{self.overall_s:.0f} s, or the machine's command limit)"
            )
            self.state["failed"] += [n for n in NAMES if self.state[n]["status"] in ("stopped", "running")]
            for n in NAMES:
                if self.state[n]["status"] == "running":
                    self.state[n].update(status="stopped", error=self.state["error"])
            code = 124
        self.state["failed"] = list(dict.fromkeys(self.state["failed"]))
        if code == 0 and self.state["failed"]:
            code = 1
        self.say(f"figures: {self.out_dir / 'gpu_check.json'}; logs: {self.out_dir / 'gpu_check_logs.tar.gz'}")
        if code == 0:
            skipped = self.self_skipped
            self.say("all phases passed" + (f" (skipped: {', '.join(skipped)}; see their reason)" if skipped else ""))
        elif self.state["failed"]:
            self.say(f"phases that did not pass: {', '.join(self.state['failed'])}")
        self.runlog.flush()
        self.write()
        self.runlog.close()
        return code


def headline(name: str, e: dict) -> str:
    """One line of the phase's main figures for the console (empty when they are missing)."""
    try:
        if name == "env":
            return f"torch {e['torch']} python {e['python']} {e.get('gpu', 'no GPU')}"
        if name == "checkpoint":
            rows = []
            for k, v in e.items():
                if isinstance(v, dict) and "resumed_steps" in v:
                    devs = sorted({d for x in v["state_devices_after_resume"].values() for d in x})
                    rows.append(
                        f"{k}: resumed at {v['resumed_start_step']} -> {v['resumed_steps']}, loss diff "
                        f"{v['max_rel_loss_diff_after_the_resume']}, state on {devs}"
                    )
            return "; ".join(rows)
        if name == "geo":
            return (
                f"factors {e['factor_dtypes']}, transforms {e['transform_dtypes']}, refreshes "
                f"{e['refreshes_in_metrics']}/{e['expected_refreshes']}, autocast in hook {e['autocast_in_hook']}"
            )
        if name == "overlap":
            on, off = e["overlap_on"]["median"], e["overlap_off"]["median"]
            nan = float("nan")
            return (
                f"overlap on: publish -> first wait {on.get('publish_to_first_wait_ms', nan):.2f} ms, wait "
                f"{on.get('first_wait_ms', nan):.3f} ms; off: wait in publish "
                f"{off.get('wait_in_publish_ms', nan):.3f} ms"
            )
        if name == "param_gather":  # the median bucket at each DP: encode + decode/apply, each x the copy's time
            rows = []
            for dp in e["dp_sizes"]:
                row = e.get(f"dp{dp}", {}).get("median", {})
                if "modes" in row:
                    bits = [
                        f"{m} {r['encode']['time_over_copy']:.1f} + {r['decode_apply']['time_over_copy']:.1f}"
                        for m, r in row["modes"].items()
                    ]
                    rows.append(f"DP {dp}, {row['numel']:,} elements: {', '.join(bits)}")
            skipped = f"; out of budget: {len(e['out_of_budget'])}" if e.get("out_of_budget") else ""
            return "; ".join(rows) + (" (encode + decode/apply, x the copy's time)" if rows else "") + skipped
        if name == "compile":
            return (
                f"{e['compiled_blocks']} blocks, unique graphs {e['unique_graphs']}, graph breaks "
                f"{e['graph_breaks']}, recompiles {e['recompiles']}, "
                f"loss diff vs eager {e.get('max_rel_loss_diff_vs_eager')}"
            )
        if name == "cuda_tests":
            return (
                f"{e['tests']} tests: {e['passed']} passed, {e['failed']} failed, {e['errors']} errors, "
                f"{e['skipped']} skipped"
            )
        if name == "train_600m":
            mfu = f"{100 * e['mfu']:.1f}%" if e.get("mfu") is not None else f"n/a ({e['peak_source']})"
            mem = f", peak {e['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in e else ""
            eq = e.get("dp64_equivalent") or {}
            dp64 = ""
            if "tflops_per_gpu" in eq:
                m64 = f"{100 * eq['mfu']:.1f}%" if eq.get("mfu") is not None else "n/a"
                dp64 = f"; with a DP 64 rank's Newton-Schulz: {eq['tflops_per_gpu']:.1f} TFLOP/s, MFU {m64}"
            return (
                f"{e['tokens_per_sec']:,.0f} tok/s, {e['tflops_per_gpu']:.1f} TFLOP/s, MFU {mfu} (DP 1, every "
                f"Newton-Schulz){dp64}{mem}; FLOPs: Megatron-LM's 6 W + 12 L s h"
            )
        if name == "codec":
            rows = []
            for p, r in e["reducer"]["presets"].items():
                if "eager" not in r:
                    rows.append(f"{p} {'skipped' if 'skipped' in r else 'failed'}")
                    continue
                bits = [f"{m} x{r[m]['time_over_copy']:.2f}" for m in ("eager", "compiled") if m in r]
                rows.append(f"{p} {'/'.join(bits)} the copy's time")
            counts = [
                v[k]
                for per_dp in (e.get("decode_dp", {}).get("codecs") or {}).values()
                for v in per_dp.values()
                for k in ("eager_differing_from_reference", "compiled_differing_from_eager")
                if k in v
            ]
            if counts:
                dps = "/".join(str(d) for d in e["decode_dp"]["dp_sizes"])
                which = "eager vs FP64 reference" + (", compiled vs eager" if e["decode_dp"].get("compiled") else "")
                rows.append(f"decoded DP means differing ({which}) at DP {dps}: {sum(counts)}")
            return "; ".join(rows)
    except Exception:  # noqa: BLE001 -- a figure missing from a phase that did not finish
        return ""
    return ""


# -- the phase process ---------------------------------------------------------------------------------------------


def block_optional() -> None:
    """Make the optional packages absent in this process, as on a machine without them: ``import wandb`` raises
    ModuleNotFoundError and ``importlib.util.find_spec("wandb")`` is None (a None entry in ``sys.modules``)."""
    for name in OPTIONAL_PACKAGES:
        if sys.modules.get(name, "absent") is not None:
            sys.modules[name] = None


def phase_main(a) -> int:
    die_with_parent()
    parent = os.environ.get("GPU_CHECK_PARENT")
    if parent and os.getppid() != int(parent):
        return 1  # the runner died before this process armed the parent-death signal
    stall = parse_pairs("GPU_CHECK_STALL").get(a.name)
    if stall:
        print(f"[gpu_check] {a.name}: sleeping {stall:.0f} s first (GPU_CHECK_STALL)", flush=True)
        time.sleep(stall)
    installed = os.environ.get("GPU_CHECK_INSTALLED")
    a.installed = (
        json.loads(installed) if installed else {p: importlib.util.find_spec(p) is not None for p in OPTIONAL_PACKAGES}
    )
    block_optional()
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import gpu_check_phases as P

    rec = P.Record(a.out)
    t0 = time.perf_counter()

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name} (time limit)")

    signal.signal(signal.SIGTERM, on_term)
    try:
        P.run(a.name, a, rec)
    except BaseException as e:  # noqa: BLE001 -- recorded in the part file, then the exit code says it
        rec["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        rec["traceback"] = traceback.format_exc().splitlines()[-25:]
        traceback.print_exc()
        rec["phase_seconds"] = time.perf_counter() - t0
        rec.save()
        return 1
    rec["phase_seconds"] = time.perf_counter() - t0
    failed = [k for k, v in rec["checks"].items() if not v]
    if failed:
        rec["failed_checks"] = failed
    rec.save()
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="all phases (what gpu_check.sh runs)")
    r.add_argument("dir", help="output folder: gpu_check.json and gpu_check_logs.tar.gz")
    r.add_argument("--dry-run", action="store_true", help="no CUDA needed: the CPU with small sizes")
    r.add_argument("--python", default=sys.executable, help="interpreter of the phases (default: this one)")
    r.add_argument("--overall-s", type=float, default=470.0, help="overall limit in seconds (default 470)")
    p = sub.add_parser("phase", help="one phase (the runner starts these)")
    p.add_argument("name", choices=NAMES)
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "phase":
            return phase_main(a)
        only, limits = parse_only(), parse_pairs("GPU_CHECK_LIMITS")
        parse_pairs("GPU_CHECK_STALL")
        launch = os.environ.get("GPU_CHECK_LAUNCH", "fork" if a.dry_run else "exec")
        if launch not in ("fork", "exec"):
            raise SettingError(
                f"GPU_CHECK_LAUNCH={launch!r}: use exec (a new interpreter per phase, the GPU run's "
                f"default) or fork (from the runner, the dry run's default)"
            )
    except SettingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not a.overall_s > 0:
        print(f"error: --overall-s {a.overall_s} must be > 0 (seconds)", file=sys.stderr)
        return 2
    out = Path(a.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(
            f"error: cannot create the output folder {a.dir!r} ({e.strerror or e}); choose a writable one",
            file=sys.stderr,
        )
        return 2
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, _raise_stopped)
    return Runner(out.resolve(), a.dry_run, a.python, a.overall_s, only, limits, launch).run()


if __name__ == "__main__":
    sys.exit(main())
