"""GPU-path pieces checked on CPU: MFU arithmetic, per-block compile, the Transformer Engine switch
(with a stand-in TE module), and the CUDA-only parts skipped with the reason when there is no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import dp_pctx, tiny_cfg
from megatron_geo.config import ConfigError, load_config
from megatron_geo.model import Llama, flops_per_token
from megatron_geo.model.compile import compile_blocks, is_compiled
from megatron_geo.model.te import use_transformer_engine
from megatron_geo.training.mfu import gpu_flops_metrics, mfu, peak_bf16_flops, tflops_per_gpu
from megatron_geo.training.validate import validate_config

ROOT = Path(__file__).resolve().parent.parent


# -- MFU ---------------------------------------------------------------------------------------------------------


def test_peak_table_matches_device_names():
    assert peak_bf16_flops("NVIDIA GH200 480GB") == ("GH200 (H100/H200 die)", 989.4e12)
    assert peak_bf16_flops("NVIDIA H200")[1] == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3")[1] == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe")[1] == 756.0e12
    assert peak_bf16_flops("NVIDIA H100 NVL")[1] == 835.5e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB")[1] == 312.0e12
    assert peak_bf16_flops("NVIDIA L40S")[1] == 362.05e12
    assert peak_bf16_flops("Tesla T4") is None


def test_mfu_values_for_llama_600m():
    cfg = load_config([str(ROOT / "configs/llama_600m.yaml")])
    fpt = flops_per_token(cfg.model)
    # Megatron-LM's count: 6 x (20 x (q, o 1536 x 1536; k, v 1536 x 768; MLP 3 x 1536 x 4096) + output 32000 x 1536)
    # + 12 x 20 layers x 2048 seq x 1536
    assert fpt == 6 * (20 * (2 * 1536 * 1536 + 2 * 1536 * 768 + 3 * 1536 * 4096) + 32000 * 1536) + 12 * 20 * 2048 * 1536
    assert fpt == 4_164_157_440
    # 100k tokens/s on one GPU of an H100: fpt * 1e5 FLOP/s
    assert tflops_per_gpu(1e5, fpt) == pytest.approx(fpt * 1e5 / 1e12)
    assert mfu(1e5, fpt, 989.4e12) == pytest.approx(fpt * 1e5 / 989.4e12)
    m = gpu_flops_metrics(64e5, 64, fpt, "NVIDIA GH200 480GB")
    assert m["tflops_per_gpu"] == pytest.approx(fpt * 1e5 / 1e12)
    assert m["mfu"] == pytest.approx(fpt * 1e5 / 989.4e12) and m["peak_tflops"] == pytest.approx(989.4)
    unknown = gpu_flops_metrics(1e5, 1, fpt, "Tesla T4")
    assert unknown["mfu"] is None and unknown["gpu"] == "Tesla T4"
    assert gpu_flops_metrics(1e5, 1, fpt, "Tesla T4", peak_flops=65e12)["mfu"] == pytest.approx(fpt * 1e5 / 65e12)


def test_flops_per_token_is_megatrons_count_by_hand():
    """A small config counted by hand in Megatron-LM's convention: 6 FLOPs per GEMM weight and token (forward 2,
    backward 4; no embedding lookup, no norms) plus 12 L s h for the attention square (no causal halving)."""
    from megatron_geo.config.schema import ModelConfig

    m = ModelConfig(
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=128,
        seq_length=64,
        vocab_size=512,
        make_vocab_size_divisible_by=128,
    )
    # per layer: q 64x64 + o 64x64 + k 64x32 + v 64x32 = 12288, MLP 3 x 64 x 128 = 24576; output 512 x 64 = 32768
    gemm = 2 * (12288 + 24576) + 32768
    assert gemm == 106_496
    attention = 12 * 2 * 64 * 64  # 12 L s h
    assert flops_per_token(m) == 6 * gemm + attention == 737_280
    # the causal-half count (6 L s h) would be 49,152 FLOPs lower: MFU differs by 7% here, 10% for Llama-600M
    assert flops_per_token(m) - 6 * 2 * 64 * 64 == 688_128


def test_mfu_rejects_bad_input():
    with pytest.raises(ValueError, match="peak_flops=0"):
        mfu(1.0, 1.0, 0)
    with pytest.raises(ValueError, match="tokens_per_sec_per_gpu=-1"):
        tflops_per_gpu(-1, 1.0)
    with pytest.raises(ValueError, match="num_gpus=0"):
        gpu_flops_metrics(1.0, 0, 1.0, "H100")


# -- per-block compile -------------------------------------------------------------------------------------------


def test_compile_blocks_keeps_names_outputs_and_gradients(world):
    cfg = tiny_cfg()
    ref, comp = Llama(cfg.model, world, 3), Llama(cfg.model, world, 3)
    names = [n for n, _ in comp.named_parameters()]
    assert compile_blocks(comp, backend="eager") == cfg.model.num_layers
    assert all(is_compiled(b) for b in comp.layers) and not is_compiled(ref.layers[0])
    assert [n for n, _ in comp.named_parameters()] == names
    assert list(comp.state_dict()) == list(ref.state_dict())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 131, (2, 16), generator=g), torch.randint(0, 131, (2, 16), generator=g)
    a, b = ref(x, y), comp(x, y)
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    a.sum().backward()
    b.sum().backward()
    for (n, p), q in zip(ref.named_parameters(), comp.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=n)


def test_compile_blocks_rejects_other_models():
    with pytest.raises(ValueError, match="non-empty `layers` ModuleList"):
        compile_blocks(nn.Linear(2, 2))


# -- Transformer Engine switch -----------------------------------------------------------------------------------


def _fake_te():
    """A stand-in for transformer_engine.pytorch with the same constructor arguments (CPU, plain torch)."""
    calls = {"linear": 0, "norm": 0}

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__()
            assert bias is False
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))

        def forward(self, x):
            calls["linear"] += 1
            return F.linear(x, self.weight)

    class RMSNorm(nn.Module):
        def __init__(self, hidden, eps=1e-5, params_dtype=None, device=None):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.empty(hidden, dtype=params_dtype, device=device))

        def forward(self, x):
            calls["norm"] += 1
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    return types.SimpleNamespace(Linear=Linear, RMSNorm=RMSNorm), calls


def test_te_swap_shares_parameters_and_matches_local(world):
    cfg = tiny_cfg()
    ref, te_model = Llama(cfg.model, world, 5), Llama(cfg.model, world, 5)
    params_before = dict(te_model.named_parameters())
    te, calls = _fake_te()
    L = cfg.model.num_layers
    assert use_transformer_engine(te_model, te_pt=te, require_cuda=False) == L * 7 + 1 + L * 2 + 1
    after = dict(te_model.named_parameters())
    assert list(after) == list(params_before) and all(after[k] is params_before[k] for k in after)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 131, (2, 16), generator=g), torch.randint(0, 131, (2, 16), generator=g)
    out = te_model(x, y)
    assert calls["linear"] == L * 7 + 1 and calls["norm"] == L * 2 + 1
    torch.testing.assert_close(out, ref(x, y), rtol=1e-6, atol=1e-6)


def test_te_requested_without_cuda_or_package_is_a_config_error(world):
    cfg = tiny_cfg("model.transformer_impl=transformer_engine")
    validate_config(cfg, 1)  # a valid choice
    with pytest.raises(ConfigError, match="transformer_impl"):
        Llama(cfg.model, world, 0)  # either TE is missing here, or it needs CUDA: both name the key and the fix
    with pytest.raises(ConfigError, match="choose one of local, transformer_engine"):
        tiny_cfg("model.transformer_impl=te")  # refused as the config is read
    bad = tiny_cfg()
    bad.model.transformer_impl = "te"  # set in code: validation refuses it too
    with pytest.raises(ConfigError, match="model.transformer_impl='te' is not supported; choose one of local, tr"):
        validate_config(bad, 1)


def test_local_impl_never_imports_transformer_engine(tmp_path):
    # a transformer_engine package that fails loudly if anything imports it
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('transformer_engine was imported')\n")
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "from megatron_geo.config import load_config\nfrom megatron_geo.model import Llama\n"
        "m = Llama(load_config([], ['model.num_layers=1']).model, dist.group.WORLD, 0)\n"
        "assert 'transformer_engine' not in sys.modules\n"
        "cfg = load_config([], ['model.num_layers=1', 'model.transformer_impl=transformer_engine'])\n"
        "try:\n    Llama(cfg.model, dist.group.WORLD, 0)\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(
        "ConfigError model.transformer_impl=transformer_engine but Transformer Engine cannot "
        "be imported (RuntimeError: transformer_engine was imported)"
    ), r.stdout
    assert "model.transformer_impl=local" in r.stdout


# -- CUDA only ---------------------------------------------------------------------------------------------------
#
# The CUDA tests run their bodies in a Python process of their own: this module's ``world`` fixture leaves a
# gloo default process group in the test process, and init_parallel refuses to build NCCL groups over it.


def _run_alone(body: str) -> str:
    """Run ``body()``, a function of this module, in a fresh Python process (no process group yet); returns its
    stdout. Fails the test with the child's output when it exits non-zero."""
    path = os.pathsep.join(p for p in (str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    r = subprocess.run(
        [sys.executable, "-c", f"import test_gpu_path as t; t.{body}()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONPATH": path, "WANDB_MODE": "disabled"},
    )
    assert r.returncode == 0, f"{body} failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def _fresh_process_probe() -> None:
    import torch.distributed as dist

    from megatron_geo.parallel import destroy_parallel, init_parallel
    from megatron_geo.parallel.launch_env import LaunchEnv

    assert not dist.is_initialized()
    pctx = init_parallel(1, "cpu", "auto", env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    print(f"backend={pctx.backend} group={dist.get_backend(pctx.dp_group)}")
    destroy_parallel()


def test_cuda_bodies_run_without_the_modules_gloo_world(world):
    """The mechanism the CUDA tests use, checked on CPU: with this process's gloo world alive, the body still
    starts without a process group and builds its own."""
    import torch.distributed as dist

    assert dist.is_initialized()
    assert _run_alone("_fresh_process_probe").strip() == "backend=gloo group=gloo"


def _cuda_step_body() -> None:
    import torch.distributed as dist

    from helpers import global_batch, rank_micro_batches
    from megatron_geo.parallel import destroy_parallel, init_parallel
    from megatron_geo.parallel.launch_env import LaunchEnv
    from megatron_geo.training.setup import build_model_and_optimizer
    from megatron_geo.training.step import StepContext, train_step

    pctx = init_parallel(1, "cuda", "auto", env=LaunchEnv(0, 1, 0, "127.0.0.1", 0, "single"))
    assert pctx.device.type == "cuda" and pctx.backend == "nccl" and dist.get_backend(pctx.dp_group) == "nccl"
    cfg = tiny_cfg()
    model, _, _, sync, opt = build_model_and_optimizer(cfg, pctx)
    ctx = StepContext(model, sync, opt, pctx, 1.0)
    losses = []
    for s in range(3):
        mbs = rank_micro_batches(global_batch(cfg, s), cfg.train.micro_batch_size, 0, 1)
        res = train_step(ctx, s, mbs)
        losses.append(res.loss)
        assert not res.skipped
    assert all(p.dtype == torch.float32 for p in model.parameters())  # FP32 params, BF16 autocast compute
    assert losses[-1] < losses[0]
    sync.remove_hooks()
    destroy_parallel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run benchmarks/gpu_check.sh on a GPU machine)")
def test_cuda_step_on_one_gpu_bf16_autocast():
    _run_alone("_cuda_step_body")


# -- GradSync side stream ----------------------------------------------------------------------------------------


def _sync_for(pctx, comm_stream):
    """The tiny model (its layers over ``pctx.dp_group``), an FP8 reducer over the DP group and the gradient sync of
    its buckets on ``pctx.device``."""
    from megatron_geo.comm import build_reducer
    from megatron_geo.distributed import GradSync, build_buckets, register_buckets

    device = pctx.device
    cfg = tiny_cfg("comm.dtype=fp8_e4m3")
    model = Llama(cfg.model, pctx.dp_group, 0, device=device)
    reducer = build_reducer(cfg.comm, pctx, seed=0, device=device)
    buckets = build_buckets(
        list(model.named_parameters()), 3000, pctx.dp_size, atomic_fn=lambda p: False, align=reducer.alignment()
    )
    register_buckets(reducer, buckets, device)
    return cfg, model, buckets, GradSync(buckets, reducer, sharded=True, comm_stream=comm_stream)


def test_grad_sync_has_no_side_stream_on_cpu(world):
    _, _, _, sync = _sync_for(dp_pctx(1, group=world), None)
    assert sync._stream is None
    sync.remove_hooks()
    with pytest.raises(ValueError, match="comm_stream=True needs gradient buffers on a CUDA device"):
        _sync_for(dp_pctx(1, group=world), True)


def _grad_sync_side_stream_body() -> None:
    """DP = 2 on the fake process group (rank 0 of 2 on the one GPU), so the FP8 codec really encodes, exchanges
    (the fake all-to-all's loopback) and decodes on the side stream."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_geo.parallel import build_groups

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    pctx = build_groups(0, 2, 1, torch.device("cuda", 0), "fake")
    dev = pctx.device
    out = {}
    for comm_stream in (False, True):
        cfg, model, buckets, sync = _sync_for(pctx, comm_stream)
        assert (sync._stream is not None) == comm_stream
        g = torch.Generator().manual_seed(2)
        x, y = torch.randint(0, 131, (4, 16), generator=g).to(dev), torch.randint(0, 131, (4, 16), generator=g).to(dev)
        sync.start_step()
        sync.set_last_micro_batch(True)
        model(x, y).sum().backward()
        sync.finish()
        out[comm_stream] = [b.grad_data.clone() for b in buckets]
        sync.remove_hooks()
    for a, b in zip(out[False], out[True]):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        assert a.abs().sum() > 0
    dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run benchmarks/gpu_check.sh on a GPU machine)")
def test_grad_sync_side_stream_gives_the_same_reduction():
    _run_alone("_grad_sync_side_stream_body")
