"""``train.compile=true`` with the features that hook the forward: GeoFP8's statistics (armed on refresh steps)
and the overlapped parameter gather's waits. Each block must compile to one graph (no graph breaks, no
recompiles) and the run must equal the uncompiled one."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_distributed
from helpers import global_batch, pctx_for, rank_micro_batches, tiny_cfg

GEO = [
    "comm.dtype=fp8_e4m3",
    "comm.transform=geo",
    "comm.error_feedback=true",
    "geo.layers=layers.*.mlp.*_proj.weight",
    "geo.rank=4",
    "geo.refresh_interval=2",
]
STEPS = 4  # refreshes at steps 0 and 2


@pytest.fixture(autouse=True)
def fresh_dynamo(one_thread):
    """One thread, and no compiled code or counters carried into the next test."""
    yield
    torch._dynamo.reset()  # no compiled code or counters carried into the next test
    torch._dynamo.utils.counters.clear()


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo hands it, then runs them with ``inner``."""

    def __init__(self, inner: str):
        self.inner, self.graphs = inner, 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        if self.inner == "eager":
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.inner)(gm, example_inputs)


def _train(cfg, pctx, compile_backend, steps):
    """``steps`` train steps; per refresh the DP-averaged factors GeoFP8 built its transforms from."""
    from megatron_geo.model.compile import compile_blocks
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model, buckets, reducer, sync, opt = build_model_and_optimizer(cfg, pctx)
    geo = reducer.geo
    if compile_backend is not None:
        compile_blocks(model, backend=compile_backend)
    factors, graphs_after = [], []
    if geo is not None:
        reduce = geo.stats.reduce

        def recording_reduce(group, owners=None):
            out = reduce(group, owners)
            factors.append({n: None if f is None else f.clone() for n, f in out.items()})
            return out

        geo.stats.reduce = recording_reduce  # the statistics instance is rebuilt only by geo.select=auto
    ctx = StepContext(model, sync, opt, pctx, cfg.optimizer.clip_grad, geo=geo)
    losses = []
    for step in range(steps):
        mbs = rank_micro_batches(global_batch(cfg, step), 2, pctx.dp_rank, pctx.dp_size)
        losses.append(train_step(ctx, step, mbs).loss)
        graphs_after.append(getattr(compile_backend, "graphs", 0))
    opt.wait_param_gather()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return {
        "losses": losses,
        "params": params,
        "factors": factors,
        "graphs": graphs_after,
        "breaks": breaks,
        "blocks": len(model.layers),
        "hooks": len(opt._hooks),
        "overlap": opt.overlap_param_gather,
        "refreshes": geo.last_refresh if geo else None,
    }


def _assert_one_graph_per_block(run):
    g = run["graphs"]
    # the blocks share their code: one graph, reused by every block (at most one per block), built in the first
    # step and never again (no recompiles at the later refreshes or steps), no graph breaks
    assert 1 <= g[0] <= run["blocks"], g
    assert g == [g[0]] * len(g), f"recompiled: graphs after each step {g}"
    assert run["breaks"] == 0, run["breaks"]


def _inductor_ok() -> bool:
    from megatron_geo.comm.compiled import compiler_problem

    return compiler_problem("cpu") is None  # inductor's CPU code needs a C++ compiler


BACKENDS = ["eager", "aot_eager"] + (["inductor"] if _inductor_ok() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_geofp8_collects_statistics_at_every_refresh(world, backend):
    cfg = tiny_cfg(*GEO)
    pctx = pctx_for(1)
    ref = _train(cfg, pctx, None, STEPS)
    run = _train(cfg, pctx, CountingBackend(backend), STEPS)
    assert len(ref["factors"]) == len(run["factors"]) == 2 and run["refreshes"] == 2
    _assert_one_graph_per_block(run)
    tol = dict(rtol=0, atol=0) if backend == "eager" else dict(rtol=1e-4, atol=1e-6)
    for i, (fr, fc) in enumerate(zip(ref["factors"], run["factors"])):
        assert fr.keys() == fc.keys() and len(fc) == 3 * cfg.model.num_layers
        for n in fr:
            torch.testing.assert_close(fc[n], fr[n], **tol, msg=f"refresh {i}: {n}")
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5 if backend != "eager" else 0)


def _overlap(rank, world, backend, cases):
    out = {}
    for name, overrides in cases.items():
        cfg = tiny_cfg("parallel.overlap_param_gather=true", *overrides)
        pctx = pctx_for(1)
        out[name] = (_train(cfg, pctx, None, 3), _train(cfg, pctx, CountingBackend(backend), 3))
    return out


def test_compiled_blocks_with_overlapped_param_gather():
    """gloo DP = 2 (real asynchronous parameter all-gathers), AdamW and AdamW + GeoFP8, in one launch."""
    cases = {"adamw": [], "geofp8": GEO}
    for per_rank in run_distributed(_overlap, 2, "eager", cases):
        for name, (ref, run) in per_rank.items():
            assert ref["overlap"] and run["overlap"] and run["hooks"] > 0, name
            _assert_one_graph_per_block(run)
            assert run["losses"] == ref["losses"], name  # every gather waited before its parameters were read
            for n in ref["params"]:
                assert torch.equal(run["params"][n], ref["params"][n]), (name, n)
            if name == "geofp8":
                assert run["refreshes"] == 2 and len(run["factors"]) == 2


def test_block_pre_forward_waits_before_each_block_in_eager_mode(world):
    """Uncompiled, the block-level waits still run before each block (and the embedding / output hooks before
    theirs): every bucket holding a block's parameters is waited before the block starts."""
    from megatron_geo.distributed.optimizer import DistributedOptimizer
    from megatron_geo.training.setup import build_model_and_optimizer

    cfg = tiny_cfg("parallel.bucket_size=600")
    pctx = pctx_for(1)
    model, buckets, _, _, opt = build_model_and_optimizer(cfg, pctx)
    opt.overlap_param_gather = True  # one process: no gather is in flight; record the waits instead
    waited: list[int] = []
    opt.wait_param_gather = lambda idx=None: waited.extend(idx or [])
    DistributedOptimizer.register_forward_hooks(opt, model)
    where = {id(p): b.index for b in buckets for p in b.params}
    seen_before: dict[str, set] = {}

    def check(mod, _args, name):
        seen_before[name] = set(waited)

    handles = [
        m.register_forward_pre_hook(lambda mod, a, name=n: check(mod, a, name))
        for n, m in model.named_modules()
        if list(m.parameters(recurse=False))
    ]
    x = torch.randint(0, cfg.model.vocab_size, (2, 8))
    model(x, x)
    for h in handles:
        h.remove()
    mods = dict(model.named_modules())
    for name, before in seen_before.items():
        need = {where[id(p)] for p in mods[name].parameters(recurse=False)}
        assert need <= before, (name, need, before)
    assert len(buckets) > 2
    # and no hook inside a block: a compiled block would trace it into its graph
    for block in model.layers:
        assert not any(m._forward_pre_hooks for m in block.modules()), "a forward pre-hook inside a block"
