"""Recorded behaviour of the reduction path: what every comm preset hands to the collectives, and a
checkpoint to resume from.

:func:`record_wire` (a ``run_distributed`` worker) trains the small test model for a few steps at DP = 2
with one preset and returns, in call order, a SHA-256 of every tensor the package hands to a collective
(the gradient codes, their scales, the parameter all-gather, the norms) with the losses. The committed
``tests/data/golden/wire_codes.json`` holds these records made by an earlier version of the code;
``tests/test_golden.py`` asserts the current code hands over the same bytes. Regenerate (only when a
change of the wire bytes is intended, and say so in the commit) with::

    python tests/golden.py --out tests/data/golden

Bitwise records hold for one CPU kernel family. The ranks pin PyTorch's and MKL's code paths to AVX2
(``cpu_pin.py``), but some hosts still round differently (an AVX-512 Intel Xeon's MKL GEMMs differ in the last bits
from the AMD EPYC and AVX2 hosts the committed records match), and the GeoFP8 presets' FP64 eigendecomposition differs
between LAPACK families even pinned. So records are also kept per host family:

- ``host_kernels.json``, keyed by :func:`kernel_fingerprint` (GEMMs, elementwise kernels and LAPACK under the pin):
  every preset and both resumes; add the current host's family (without touching the other records) with::

      python tests/golden.py --host-variant

- ``host_lapack.json``, keyed by :func:`lapack_fingerprint`: the GeoFP8 presets of a family whose other kernels
  match the committed records (made before the kernel-family file; read only).

``tests/test_golden.py`` compares bitwise against the records of this host's family, else against the committed
ones; where a host of an unrecorded family differs from them it compares the sequence of calls (operation, dtype,
size) and the losses and gradient norms to a relative 1e-6, and warns with the fingerprint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cpu_pin import pinned_env

if __name__ == "__main__":  # regenerating: this process and its ranks run the recorded kernel family
    os.environ.update(pinned_env())

# isort: split
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GOLDEN = HERE / "data" / "golden"
CORPUS_TOKEN = "@CORPUS@"  # the corpus folder in the committed checkpoint's meta.json / config.yaml

# the layer selection the tensor-scaled GeoFP8 records were made with (the preset's default then): a preset whose
# default selection changes keeps its records, which pin the reduction path of that selection
GEOFP8_DOWN = ["geo.layers=layers.*.mlp.down_proj.weight"]
# preset file (configs/comm) -> extra overrides
RUNS: dict[str, tuple[str, list[str]]] = {
    **{p.stem: (p.name, []) for p in sorted((ROOT / "configs" / "comm").glob("*.yaml"))},
    "geofp8_tensor": ("geofp8_tensor.yaml", GEOFP8_DOWN),
    "fp8_allreduce": ("fp8.yaml", ["parallel.distributed_optimizer=false"]),
    "fp8_wire_sum": ("fp8.yaml", ["comm.reduce_op=wire_sum"]),
    "muon_fp8_ef": ("fp8_ef.yaml", ["optimizer.name=muon"]),
    "muon_geofp8": ("geofp8_tensor.yaml", ["optimizer.name=muon", *GEOFP8_DOWN]),
}
STEPS = 4
# checkpointed at step 2 of STEPS (its meta.json / config.yaml with the corpus and run folder as placeholders)
CHECKPOINTS = {
    "adamw_geofp8": ("geofp8.yaml", GEOFP8_DOWN),
    "muon_geofp8": ("geofp8_tensor.yaml", ["optimizer.name=muon", *GEOFP8_DOWN]),
}
RUN_TOKEN = "@RUN@"
HOST_RECORDS = GOLDEN / "host_lapack.json"
HOST_KERNELS = GOLDEN / "host_kernels.json"


def uses_eigh(preset: str) -> bool:
    """Whether a preset file transforms gradients with GeoFP8 (its refresh runs ``torch.linalg.eigh``)."""
    return "geo" in preset


def lapack_fingerprint() -> str:
    """16 hex digits of the FP64 eigendecomposition and QR factorisation of fixed, exactly representable
    matrices (64 x 64 and 128 x 128 Gram matrices, as the tiny model's K-FAC factors): equal on hosts whose
    LAPACK gives the GeoFP8 refresh the same bits."""
    h = hashlib.sha256()
    for n in (64, 128):
        i = torch.arange(n, dtype=torch.float64)
        m = torch.remainder(i[:, None] * 37 + i[None, :] * 101, 97) - 48  # integers: exact in FP64
        a = (m @ m.T) / (48.0 * 48.0 * n)
        evals, evecs = torch.linalg.eigh(a)
        q, _ = torch.linalg.qr(m[:, : n // 2])
        for t in (evals, evecs, q):
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def kernel_fingerprint() -> str:
    """16 hex digits of the kernels a training step of the tiny model runs, on fixed inputs: FP32 and BF16 GEMMs, a
    linear layer's forward and backward (one and two threads), softmax, exp, SiLU, rsqrt and a sum, and
    :func:`lapack_fingerprint`. Equal on hosts whose kernels give the recorded runs the same bits."""
    h = hashlib.sha256(lapack_fingerprint().encode())
    for threads in (1, 2):
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        x = torch.randn(64, 300, requires_grad=True)
        lin = torch.nn.Linear(300, 96)
        b = torch.randn(300, 96)
        y = lin(x)
        y.square().mean().backward()
        outs = (x.detach() @ b, (x.detach().bfloat16() @ b.bfloat16()).float(), y.detach(), lin.weight.grad, x.grad)
        outs += (torch.softmax(y.detach(), -1), y.detach().exp(), torch.nn.functional.silu(y.detach()))
        outs += (torch.rsqrt(y.detach().square().mean(-1)), y.detach().sum(0))
        for t in outs:
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def pinned_fingerprint(kind: str = "lapack") -> str:
    """:func:`lapack_fingerprint` (``kind="lapack"``) or :func:`kernel_fingerprint` (``"kernel"``) in a fresh
    interpreter under the recorded kernel family (``cpu_pin.py``; MKL fixes its code path once per process, so this
    process may run another)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", f"import golden; print(golden.{kind}_fingerprint())"],
        cwd=HERE,
        env={**os.environ, **pinned_env()},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def host_records(path: Path = HOST_RECORDS) -> dict | None:
    """This host's LAPACK family's records ``{"wire": {name: record}, "resume": {name: losses}}`` of the GeoFP8
    presets, or None."""
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(pinned_fingerprint("lapack"))


def kernel_records(path: Path = HOST_KERNELS) -> dict | None:
    """This host's kernel family's records ``{"wire": {name: record}, "resume": {name: losses}}`` of every preset,
    or None."""
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(pinned_fingerprint("kernel"))


def overrides(corpus: Path, run_dir: Path, preset: str, extra: list[str]) -> list[str]:
    """The small test model of ``ckpt_helpers.tiny_train_overrides`` on the committed corpus, without validation,
    for ``STEPS`` steps with a GeoFP8 refresh every 2, under the preset ``configs/comm/<preset>``."""
    from ckpt_helpers import golden_corpus_data, tiny_train_overrides

    data = [
        *golden_corpus_data(corpus),
        "data.sample_order=stream",  # the order the records were made with (before Megatron's became the default)
    ]
    return tiny_train_overrides(
        run_dir,
        data,
        "train.eval_batches=0",
        f"train.steps={STEPS}",
        "geo.refresh_interval=2",
        "--config",
        str(ROOT / "configs" / "comm" / preset),
        *extra,
    )


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _install_recorder(log: list) -> None:
    """Wrap the package's collective helpers: each call appends ``[op, dtype, numel, digest of the input]``."""
    from megatron_geo.parallel import collectives as C

    def wrap(name, fn, pick):
        def inner(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron_geo."):
                t = pick(*args)
                log.append([name, str(t.dtype).replace("torch.", ""), t.numel(), _digest(t)])
            return fn(*args, **kwargs)

        return inner

    first, second = (lambda t, *a: t), (lambda out, inp, *a: inp)
    for name, pick in (
        ("all_reduce", first),
        ("broadcast", first),
        ("reduce", first),
        ("all_gather_into", second),
        ("reduce_scatter_into", second),
        ("all_gather_list", second),
        ("all_to_all_single", second),
        ("reduce_ranges", first),
        ("all_gather_ranges", first),
    ):
        setattr(C, name, wrap(name, getattr(C, name), pick))


def record_wire(rank, world, corpus, run_dir, preset, extra):
    from helpers import pctx_for
    from megatron_geo.training.trainer import train
    from megatron_geo.training.validate import validate_config

    log: list = []
    _install_recorder(log)
    cfg = load_cfg(overrides(Path(corpus), Path(run_dir), preset, extra))
    validate_config(cfg, world)
    train(cfg, pctx_for(cfg.parallel.tensor))
    losses = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    losses = [[r["step"], r.get("loss"), r.get("grad_norm")] for r in losses if r.get("loss") is not None]
    return {"calls": log, "losses": losses}


def load_cfg(ov: list[str]):
    from megatron_geo.config import load_config

    cfg_files = [ov[i + 1] for i, o in enumerate(ov) if o == "--config"]
    plain = [o for i, o in enumerate(ov) if o != "--config" and (i == 0 or ov[i - 1] != "--config")]
    return load_config(cfg_files, plain)


def make_corpus_into(root: Path) -> None:
    sys.path.insert(0, str(HERE))
    from ckpt_helpers import make_corpus

    make_corpus(root)
    for p in root.iterdir():
        if p.name not in ("train.bin", "train.idx", "valid.bin", "valid.idx", "tok.model"):
            p.unlink()


def resume_committed(run_distributed, corpus: Path, run: Path, name: str) -> list:
    """Resume the committed step-2 checkpoint ``name`` in the run folder ``run`` to step ``STEPS``: rank 0's
    ``[step, loss, grad norm]`` of steps 3 and 4 (what tests/test_golden.py compares)."""
    recorded = json.loads((GOLDEN / "resume.json").read_text())[name]
    shutil.copytree(GOLDEN / "ckpt" / name, run / "checkpoints")
    for f in (run / "checkpoints" / "step_00000002").glob("*.json"):
        f.write_text(f.read_text().replace(CORPUS_TOKEN, str(corpus)).replace(RUN_TOKEN, str(run)))
    out = run_distributed(  # fresh interpreters: the kernel family of this process's environment (cpu_pin.py)
        record_wire,
        2,
        str(corpus),
        str(run),
        recorded["preset"],
        [*recorded["extra"], "checkpoint.interval=2", "checkpoint.keep_latest=0"],
        start="spawn",
    )
    return out


def record_host_variant(work: Path) -> None:
    """Add this host's kernel family's records of every preset and both resumes to ``host_kernels.json``."""
    from dist_harness import run_distributed

    corpus = (GOLDEN / "corpus").resolve()
    wire = {}
    for name, (preset, extra) in RUNS.items():
        wire[name] = {
            "preset": preset,
            "extra": extra,
            "ranks": run_distributed(record_wire, 2, str(corpus), str(work / name), preset, extra, start="spawn"),
        }
        print(name, wire[name]["ranks"][0]["losses"][-1])
    resume = {}
    for name in CHECKPOINTS:
        resume[name] = resume_committed(run_distributed, corpus, work / f"resume_{name}", name)[0]["losses"]
    have = json.loads(HOST_KERNELS.read_text()) if HOST_KERNELS.exists() else {}
    have[pinned_fingerprint("kernel")] = {"cpu": _cpu_name(), "wire": wire, "resume": resume}
    HOST_KERNELS.write_text(json.dumps(have, indent=1) + "\n")


def add_preset(name: str, work: Path) -> None:
    """Record a preset that has no records yet (a new ``configs/comm`` file) into ``wire_codes.json`` and into this
    host's kernel-family entry of ``host_kernels.json``, without touching any other record. A host of another
    family then compares it by its calls and losses until its family records it (``--host-variant``)."""
    from dist_harness import run_distributed

    preset, extra = RUNS[name]
    wire_file = GOLDEN / "wire_codes.json"
    wire = json.loads(wire_file.read_text())
    if name in wire:
        raise SystemExit(f"{name} has records already; regenerate them all (--out) if its wire bytes should change")
    corpus = (GOLDEN / "corpus").resolve()
    ranks = run_distributed(record_wire, 2, str(corpus), str(work / name), preset, extra, start="spawn")
    wire[name] = {"preset": preset, "extra": extra, "ranks": ranks}
    wire_file.write_text(json.dumps(wire, indent=1) + "\n")
    have = json.loads(HOST_KERNELS.read_text()) if HOST_KERNELS.exists() else {}
    family = have.get(pinned_fingerprint("kernel"))
    if family is not None:
        family["wire"][name] = wire[name]
        HOST_KERNELS.write_text(json.dumps(have, indent=1) + "\n")
    print(name, ranks[0]["losses"][-1])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(GOLDEN))
    ap.add_argument("--work", default=None, help="scratch folder for the runs (default: a new temporary folder)")
    ap.add_argument(
        "--host-variant", action="store_true", help="add this host's kernel family's records (host_kernels.json)"
    )
    ap.add_argument("--add-preset", metavar="NAME", help="record a new preset's runs (wire_codes.json, this family)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from dist_harness import run_distributed

    if args.add_preset:
        add_preset(
            args.add_preset, Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="golden-"))
        )
        return
    if args.host_variant:
        work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="golden-"))
        record_host_variant(work)
        return

    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else Path(tempfile.mkdtemp(prefix="golden-"))
    shutil.rmtree(work, ignore_errors=True)
    corpus = out / "corpus"  # absolute: the checkpoints' meta.json gets the placeholder in its place
    if not (corpus / "tok.model").exists():
        make_corpus_into(corpus)
    records = {}
    for name, (preset, extra) in RUNS.items():
        res = run_distributed(record_wire, 2, str(corpus), str(work / name), preset, extra)
        records[name] = {"preset": preset, "extra": extra, "ranks": res}
        print(name, len(res[0]["calls"]), "calls", res[0]["losses"][-1])
    (out / "wire_codes.json").write_text(json.dumps(records, indent=1) + "\n")
    resumes = {}
    for name, (preset, extra) in CHECKPOINTS.items():
        run = work / f"ckpt_{name}"
        res = run_distributed(
            record_wire, 2, str(corpus), str(run), preset, [*extra, "checkpoint.interval=2", "checkpoint.keep_latest=0"]
        )
        dst = out / "ckpt" / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(run / "checkpoints" / "step_00000002", dst / "step_00000002")
        (dst / "latest").write_text("step_00000002\n")
        for f in (dst / "step_00000002").glob("*.json"):
            f.write_text(f.read_text().replace(str(corpus.resolve()), CORPUS_TOKEN).replace(str(run), RUN_TOKEN))
        resumes[name] = {"preset": preset, "extra": extra, "losses": res[0]["losses"]}
    (out / "resume.json").write_text(json.dumps(resumes, indent=1) + "\n")


if __name__ == "__main__":
    main()
