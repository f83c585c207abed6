"""Small data and state-gathering helpers for the checkpoint tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch


def make_corpus(root: Path, vocab_size: int = 96) -> list[str]:
    """A tokenizer and train/valid indexed datasets in ``root``; returns the config overrides that use them."""
    from megatron_geo.data import IndexedDatasetBuilder, Tokenizer, train_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "sigma", "omega", "kappa", "theta", "lambda", "zeta"]
    lines = [" ".join(rng.choice(words) + str(rng.randrange(40)) for _ in range(12)) for _ in range(600)]
    (root / "text.txt").write_text("\n".join(lines))
    model = train_tokenizer([str(root / "text.txt")], str(root / "tok"), vocab_size=vocab_size)
    tok = Tokenizer(model)
    for split, part in (("train", lines[:500]), ("valid", lines[500:])):
        with IndexedDatasetBuilder(str(root / split), vocab_size=tok.vocab_size) as b:
            for line in part:
                b.add_document(tok.encode(line) + [tok.eod_id])
    return [
        "data.source=indexed",
        f"data.train_prefix={root}/train",
        f"data.valid_prefix={root}/valid",
        f"data.tokenizer_model={model}",
        f"model.vocab_size={tok.vocab_size}",
    ]


# the small test model: 2 layers of width 32, 16-token samples, buckets of 3,000 elements
TINY_MODEL = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.ffn_hidden_size=64",
    "model.seq_length=16",
    "model.make_vocab_size_divisible_by=1",
    "parallel.bucket_size=3000",
]
GOLDEN_CORPUS = Path(__file__).resolve().parent / "data" / "golden" / "corpus"  # the committed test corpus


def golden_corpus_data(corpus: Path = GOLDEN_CORPUS) -> list[str]:
    """The data overrides for the committed test corpus (indexed train/valid files, its tokenizer, vocabulary 96)."""
    return [
        "data.source=indexed",
        f"data.train_prefix={corpus}/train",
        f"data.valid_prefix={corpus}/valid",
        f"data.tokenizer_model={corpus}/tok.model",
        "model.vocab_size=96",
    ]


def trap_process_group(monkeypatch) -> None:
    """Make ``pretrain_llama.py``'s process-group start fail the test: what follows must be refused before it."""
    from megatron_geo.training import cli

    def no_group(*args, **kwargs):
        raise AssertionError("the process group started before the bad input was found")

    monkeypatch.setattr(cli, "init_parallel", no_group)


def tiny_train_overrides(run_dir: Path, data: list[str], *extra: str) -> list[str]:
    return [
        *TINY_MODEL,
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.warmup_steps=2",
        "train.eval_interval=4",
        "train.eval_batches=1",
        "train.progress=false",
        "logging.wandb=disabled",
        f"train.run_dir={run_dir}",
        *data,
        *extra,
    ]


def train_jobs(rank, world, jobs):
    """``run_distributed`` worker: train each override list of ``jobs`` in turn; returns the train results."""
    from helpers import pctx_for
    from megatron_geo.config import load_config
    from megatron_geo.training.trainer import train
    from megatron_geo.training.validate import validate_config

    out = []
    for overrides in jobs:
        cfg = load_config([], overrides)
        validate_config(cfg, world)
        out.append(train(cfg, pctx_for(cfg.parallel.tensor)))
    return out


def local_state(optimizer) -> list[dict]:
    """Every main param piece of this rank with its optimizer state (for reassembly in the parent)."""
    out = []
    for m in optimizer.mains:
        st = optimizer.optimizer_of(m).state.get(m.main, {})
        out.append(
            {
                "name": m.name,
                "start": m.param_start,
                "shape": tuple(m.param.shape),
                "partition_dim": getattr(m.param, "partition_dim", None)
                if getattr(m.param, "tensor_model_parallel", False)
                else None,
                "main": m.main.detach().reshape(-1).clone(),
                "state": {
                    k: (v.detach().reshape(-1).clone() if v.numel() == m.main.numel() else v.clone())
                    for k, v in st.items()
                },
            }
        )
    return out


def assemble(per_rank: list[list[dict]], tp_size: int, vocab_rows: int | None = None) -> dict:
    """Full (TP = 1, unpadded) tensors ``{name: {"main": t, "<state>": t}}`` from every rank's pieces.

    ``per_rank[rank]`` lists the pieces of global rank ``rank = dp_rank * tp_size + tp_rank``. Pieces are
    placed into TP-local flat tensors, which are concatenated along the partition dim (torch.cat).
    """
    local: dict[tuple[str, int], dict] = {}
    meta: dict[str, tuple] = {}
    for rank, pieces in enumerate(per_rank):
        tp_rank = rank % tp_size
        for pc in pieces:
            numel = 1
            for s in pc["shape"]:
                numel *= s
            entry = local.setdefault((pc["name"], tp_rank), {})
            meta[pc["name"]] = (pc["shape"], pc["partition_dim"])
            for key, val in [("main", pc["main"])] + [(k, v) for k, v in pc["state"].items() if v.dim() > 0]:
                flat = entry.setdefault(key, torch.full((numel,), float("nan"), dtype=val.dtype))
                flat[pc["start"] : pc["start"] + val.numel()] = val
            for k, v in pc["state"].items():
                if v.dim() == 0:
                    entry["scalar_" + k] = v.item()
    out = {}
    for name, (shape, pdim) in meta.items():
        keys = local[(name, 0)].keys()
        full = {}
        for key in keys:
            if key.startswith("scalar_"):
                full[key] = local[(name, 0)][key]
                continue
            if pdim is None:
                t = local[(name, 0)][key].view(shape)
            else:
                t = torch.cat([local[(name, r)][key].view(shape) for r in range(tp_size)], dim=pdim)
            if vocab_rows is not None and name in ("embed.weight", "output.weight"):
                t = t[:vocab_rows]
            full[key] = t
        out[name] = full
    return out


# ---------------------------------------------------------------------------------------------------
# fake CUDA on a CPU-only torch: FakeTensorMode tensors on ``cuda:0`` (shapes, dtypes and devices, no data)


def _names_cuda(v) -> bool:
    return (isinstance(v, torch.device) and v.type == "cuda") or (isinstance(v, str) and v.startswith("cuda"))


class FakeCuda(torch.overrides.TorchFunctionMode):
    """A fake ``cuda`` device on a CPU-only torch: every tensor created on (or moved to) a CUDA device is a
    FakeTensor of its own FakeTensorMode (shape, dtype and device ``cuda:<index>``, no data); CPU tensors stay
    real, and ops that mix both run under the fake mode.

    Also routes the Python bindings that need the CUDA runtime (``Tensor.__getitem__`` / ``__setitem__`` with
    basic indices and ``Tensor.copy_`` take a CUDA device guard, ``torch.as_tensor`` initialises CUDA) to the
    ATen ops FakeTensorMode implements: a CPU-only torch has neither, so they fail before dispatch.
    """

    def __init__(self):
        super().__init__()
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    @staticmethod
    def _basic(t: torch.Tensor, idx):
        out, dim = t, 0
        for i in idx if isinstance(idx, tuple) else (idx,):
            if isinstance(i, slice) and i.step in (None, 1):
                lo, hi, _ = i.indices(out.shape[dim])
                out = torch.ops.aten.slice.Tensor(out, dim, lo, max(lo, hi))
                dim += 1
            elif isinstance(i, int) and not isinstance(i, bool):
                out = torch.ops.aten.select.int(out, dim, i)
            elif i is Ellipsis and not isinstance(idx, tuple):
                pass
            else:
                raise NotImplementedError(f"fake CUDA indexing supports slices and ints, not {i!r}")
        return out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else None
        on_cuda = isinstance(t, torch.Tensor) and t.device.type == "cuda"
        if on_cuda and func is torch.Tensor.__getitem__:
            return self._basic(t, args[1])
        if on_cuda and func is torch.Tensor.__setitem__:
            dst, v = self._basic(t, args[1]), args[2]
            if isinstance(v, torch.Tensor):
                torch.ops.aten.copy_.default(dst, v)
            else:
                torch.ops.aten.fill_.Scalar(dst, v)
            return None
        if on_cuda and func is torch.Tensor.copy_:
            return torch.ops.aten.copy_.default(*args, **kwargs)
        if on_cuda and func is torch.as_tensor and len(args) == 1 and not kwargs:
            return t  # as_tensor of a tensor is that tensor
        if any(_names_cuda(v) for v in (*args, *kwargs.values())):
            with self.fake:
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _NoStream:
    """``torch.cuda.Stream`` stand-in: host-side stream bookkeeping is a no-op (one stream, in order)."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return None

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def install_fake_cuda_runtime() -> None:
    """Process-wide stand-ins for the CUDA runtime calls a CPU-only torch cannot make (streams, the CUDA RNG
    state as an opaque byte tensor, the model's data-dependent truncated-normal init replaced by a plain
    normal draw of the same std, as tools/dry_run.py does) and for the host read of rank-agreement flags
    (fake tensors hold no values: the flags and the error text travel in CPU tensors over the same process group).
    For a subprocess of its own: nothing is restored."""
    import importlib

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    import megatron_geo.model.llama as llama

    torch.cuda.Stream = _NoStream
    rng = {}
    torch.cuda.get_rng_state = lambda device="cuda": rng.get(str(device), torch.zeros(16, dtype=torch.uint8)).clone()
    torch.cuda.set_rng_state = lambda s, device="cuda": rng.__setitem__(str(device), s.clone())
    llama._init = lambda seed, name, kind, std: lambda t: t.normal_(0.0, std)
    try:
        agreement = importlib.import_module("megatron_geo.checkpoint.agreement")
    except ImportError:  # a package without rank agreement: nothing to route
        agreement = None
    if agreement is not None:
        real, real_text = agreement.all_gather_ints, agreement._broadcast_text

        def host_gather(values, group, device):
            with unset_fake_temporarily():
                return real(values, group, torch.device("cpu"))

        def host_text(text, group, group_src, device):
            with unset_fake_temporarily():
                return real_text(text, group, group_src, torch.device("cpu"))

        for name in (
            "megatron_geo.checkpoint.agreement",
            "megatron_geo.checkpoint.state",
            "megatron_geo.training.checkpointing",
        ):
            mod = importlib.import_module(name)
            if hasattr(mod, "all_gather_ints"):
                mod.all_gather_ints = host_gather
        agreement._broadcast_text = host_text

    # DCP writes the bytes of each tensor: a fake tensor has none, it is written as zeros of its shape
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    resolve = DefaultSavePlanner.resolve_data

    def resolve_data(self, write_item):
        out = resolve(self, write_item)
        if isinstance(out, FakeTensor):
            with unset_fake_temporarily():
                return torch.zeros(out.shape, dtype=out.dtype)
        return out

    DefaultSavePlanner.resolve_data = resolve_data
