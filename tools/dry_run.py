#!/usr/bin/env python
"""Scale dry run: DP rank 0 of a large data-parallel job, on one device, with torch's fake process group.

    python tools/dry_run.py --config configs/llama_600m.yaml --dp 64 [--tp N] [--steps 2] [--json OUT] [key=value ...]

torchtitan's "fake backend" idea: ``torch.distributed`` is initialised with the ``fake`` backend (every
collective returns at once and moves no data; an all-to-all delivers this rank's own part and zeros from the
others), so rank 0 of a ``dp x tp`` job builds exactly the buckets, shard plan, reducer state, GeoFP8 state
and optimizer it would build in the real job and runs real forward / backward / reduction / optimizer steps
on its own data -- the shapes, plans, memory and op counts of the 64-rank job, on one CPU or GPU. What it
cannot show: the values other ranks would have sent (the reduced gradient is this rank's own contribution,
as if the others' were zero, for every reducer alike), and communication time.

The gathers follow the same rule (:func:`loopback_gathers`): the parameter all-gather after a step leaves the
ranges other ranks own as they were (this rank's own range holds its update), for even plans (AdamW) as for
whole-parameter plans (Muon), where the fake broadcasts already do so; an all-gather into a fresh buffer
(the all-reduce path, ``parallel.distributed_optimizer=false``) delivers this rank's part and zeros. Without
this the fake all-gather would copy this rank's range into every other one.

Data are random tokens; shrink ``model.seq_length``, ``train.global_batch_size`` and
``train.micro_batch_size`` to fit the device. Prints per step the time; for step 1 also rank 0's loss (mean
per-token loss of its own micro-batches at the initial parameters: the one loss figure that does not depend
on other ranks' data). The global loss of later steps and the gradient norm do depend on it (through the
reduced gradient and the update) and are not printed. Then the persistent memory of the rank (FP32 gradient
buffer, parameter buffer, main params, optimizer state, error feedback, GeoFP8 state: the storages the trainer
holds after a step, counted once each; on CUDA also ``torch.cuda.memory_allocated`` and the peak) next to
``tools/plan_report.py``'s figure for rank 0. ``--json``: ``steps`` (``step``, ``time_s``, ``updated``: the
update ran on this rank, i.e. its part of the gradient norm was finite), ``rank0_step1_loss``,
``optimizer_steps``, the memory figures, ``muon_split_blocks`` (rank 0's row blocks of Muon matrices split over a
group, whose Gram all-reduces and re-layouts run on the fake group too) and ``muon_split_group_size``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_geo.analysis.plan_report import resolve_tensor_parallel  # noqa: E402
from megatron_geo.config import ConfigError, load_config  # noqa: E402
from megatron_geo.training.validate import (
    output_file_problem,  # noqa: E402
    validate_config,  # noqa: E402
)

GiB = 2**30


def persistent_bytes(model, buckets, optimizer, reducer) -> dict:
    """Bytes of every storage the trainer keeps between steps, each storage counted once, by kind."""
    seen: set[int] = set()
    out: dict[str, int] = {}

    def add(kind: str, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            return
        seen.add(st.data_ptr())
        out[kind] = out.get(kind, 0) + st.nbytes()

    for b in buckets:
        add("grad_buffer", b.grad_data)
        add("param_buffer", b.param_data)
    for p in model.parameters():
        add("param_buffer", p)
    for m in optimizer.mains:
        add("main_params", m.main)
    for opt in optimizer.optimizers:
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:
                    add("optimizer_state", v)
    for r in reducer.state_dict().get("residuals", {}).values():
        add("error_feedback", r)
    if reducer.geo is not None:
        for t in reducer.geo.tensors():
            add("geo_state", t)
    out["total"] = sum(out.values())
    return out


class _Done:
    """A finished collective (``wait`` returns at once)."""

    def wait(self) -> bool:
        return True


@contextlib.contextmanager
def loopback_gathers():
    """On the fake process group: a parameter all-gather (``all_gather_ranges``) leaves the other ranks' ranges of
    the buffer as they are, and an all-gather into a fresh buffer (``all_gather_into``) delivers this rank's own
    part and zeros from the others, as the fake all-to-all does (see the module docstring)."""
    import torch.distributed as dist

    from megatron_geo.parallel import collectives as C

    saved_ranges, saved_into = C.all_gather_ranges, C.all_gather_into

    def gather_ranges(buf, bounds, group, async_op=True):
        return _Done()  # this rank's range already holds its new values; the others keep theirs

    def gather_into(out, inp, group, async_op=False):
        saved_into(out, inp, group, async_op=False)
        me = dist.get_rank(group)
        out.zero_()
        out[me * inp.numel() : (me + 1) * inp.numel()].copy_(inp.reshape(-1))
        return _Done()

    C.all_gather_ranges, C.all_gather_into = gather_ranges, gather_into
    try:
        yield
    finally:
        C.all_gather_ranges, C.all_gather_into = saved_ranges, saved_into


def rank0_micro_batches(cfg, dp: int, steps: int) -> list[list[dict]]:
    """Per step, rank 0's micro-batches of random tokens (``train.seed``; ``global_batch_size / (dp * micro)`` of
    ``micro_batch_size`` sequences, at least one)."""
    micro, seq, v = cfg.train.micro_batch_size, cfg.model.seq_length, cfg.model.vocab_size
    n_micro = max(1, cfg.train.global_batch_size // (dp * micro))
    g = torch.Generator().manual_seed(cfg.train.seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(n_micro):
            data = torch.randint(0, v, (micro, seq + 1), generator=g)
            mbs.append({"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": torch.ones(micro, seq)})
        out.append(mbs)
    return out


def run_steps(cfg, pctx, dp: int, steps: int) -> tuple[list[dict], dict]:
    """Build rank 0's model, buckets, reducer and optimizer and run ``steps`` optimizer steps on the fake process
    group that the caller initialised (``dp * tp`` ranks).

    Returns:
        ``(records, state)``: per step ``{"step", "time_s", "updated"}`` and, for step 1, ``"loss"`` (rank 0's
        mean per-token loss of its micro-batches at the initial parameters, nats); ``state``: ``model``,
        ``buckets``, ``reducer``, ``optimizer`` and ``build_s`` (seconds to build them).
    """
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    dev = pctx.device
    torch.manual_seed(cfg.train.seed)
    t0 = time.perf_counter()
    model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    state = {
        "model": model,
        "buckets": buckets,
        "reducer": reducer,
        "optimizer": opt,
        "build_s": time.perf_counter() - t0,
    }
    ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad, cfg.train.autocast_dtype, geo=reducer.geo)
    records = []
    with loopback_gathers():
        for step, mbs in enumerate(rank0_micro_batches(cfg, dp, steps)):
            t = time.perf_counter()
            res = train_step(ctx, step, mbs)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            rec = {"step": step + 1, "time_s": time.perf_counter() - t, "updated": not res.skipped}
            # the fake all-reduces leave rank 0's own sums: its own mean loss, at TP = 1 only (with TP > 1 the
            # fake group also skips the tensor-parallel all-reduces inside the forward, so no loss is meaningful)
            if step == 0 and pctx.tp_size == 1:
                rec["loss"] = res.loss
            records.append(rec)
    opt.wait_param_gather()
    return records, state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", required=True, metavar="FILE")
    ap.add_argument("--dp", type=int, required=True, help="data-parallel size of the job to imitate")
    ap.add_argument(
        "--tp", type=int, default=None, help="tensor-parallel size of the job (default: parallel.tensor of the config)"
    )
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps to run (default 2)")
    ap.add_argument("--json", default=None, metavar="OUT")
    ap.add_argument(
        "--exact-init",
        action="store_true",
        help="the trainer's truncated-normal initialisation (slow on CPU for large models); by default a "
        "plain normal draw of the same std, which changes values only",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    for flag, v in (("--dp", args.dp), ("--steps", args.steps)):
        if v < 1:
            print(f"error: {flag} {v} must be >= 1", file=sys.stderr)
            return 2
    problem = output_file_problem("--json", args.json)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        tp = resolve_tensor_parallel(cfg, args.tp, args.overrides)
        validate_config(cfg, args.dp * tp)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_geo.analysis.plan_report import meta_model_params, plan_figures
    from megatron_geo.parallel import build_groups, indexed_device

    if not args.exact_init:
        import megatron_geo.model.llama as llama

        def fast_init(seed, name, kind, std):
            return lambda t: t.normal_(0.0, std)

        llama._init = fast_init
    world = args.dp * tp
    dev = indexed_device("cuda" if cfg.train.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    plan = plan_figures(cfg, args.dp, meta_model_params(cfg, tp), tp)  # before the job's process group
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    pctx = build_groups(0, world, tp, dev, "fake")
    steps, state = run_steps(cfg, pctx, args.dp, args.steps)
    buckets = state["buckets"]
    split_blocks = sum(1 for m in state["optimizer"].mains if m.split is not None)
    groups = state["optimizer"].muon_groups
    split_text = (
        f"; {split_blocks} Muon row blocks of matrices split over groups of {groups.size} DP ranks"
        if groups is not None
        else ""
    )
    print(
        f"dry run: rank 0 of DP={args.dp} x TP={tp} on {dev} (fake process group); {len(buckets)} buckets, "
        f"{sum(1 for b in buckets if not b.plan.even)} with uneven owner ranges{split_text}; "
        f"built in {state['build_s']:.1f} s. "
        + (
            "Shown: step times and rank 0's step-1 loss; the global loss and the gradient norm depend on other ranks' "
            "data, which the fake process group does not move"
            if tp == 1
            else "Shown: step times; no loss at TP > 1 (the fake process group skips the tensor-parallel all-reduces "
            "of the forward, so no loss it computes is the model's)"
        ),
        flush=True,
    )
    for rec in steps:
        loss = f" rank 0 loss {rec['loss']:.4f} (its micro-batches, initial parameters)" if "loss" in rec else ""
        print(
            f"step {rec['step']}:{loss} {rec['time_s']:.2f} s{'' if rec['updated'] else ' (update skipped)'}",
            flush=True,
        )
    mem = persistent_bytes(state["model"], buckets, state["optimizer"], state["reducer"])
    out = {
        "dp": args.dp,
        "tp": tp,
        "device": str(dev),
        "steps": [{k: v for k, v in r.items() if k != "loss"} for r in steps],
        "rank0_step1_loss": steps[0].get("loss"),  # None at TP > 1
        "persistent_bytes": mem,
        "optimizer_steps": sum(1 for s in steps if s["updated"]),
        "muon_split_blocks": split_blocks,
        "muon_split_group_size": groups.size if groups is not None else 1,
    }
    line = (
        f"persistent memory of rank 0: {mem['total'] / GiB:.3f} GiB ("
        + ", ".join(f"{k} {v / GiB:.3f}" for k, v in mem.items() if k != "total")
        + ")"
    )
    if plan is not None:
        out["plan_persistent_bytes_rank0"] = plan["rank0"]["persistent_bytes"]
        out["measured_over_plan"] = mem["total"] / plan["rank0"]["persistent_bytes"]
        line += (
            f"; plan_report says {plan['rank0']['persistent_bytes'] / GiB:.3f} GiB (x{out['measured_over_plan']:.3f})"
        )
    print(line)
    if dev.type == "cuda":
        out["cuda_memory_allocated"] = torch.cuda.memory_allocated(dev)
        out["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
        print(
            f"CUDA memory allocated {out['cuda_memory_allocated'] / GiB:.2f} GiB, peak "
            f"{out['cuda_max_memory_allocated'] / GiB:.2f} GiB"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
