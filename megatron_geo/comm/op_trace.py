"""Record the aten ops of a piece of code and find the ones that force a host synchronisation.

:class:`OpRecorder` is a ``TorchDispatchMode``: every aten op run inside it is counted by name, with the bytes
of its tensor inputs and outputs (a memory-traffic estimate for unfused eager code), and the ops that make
the host wait for the device or produce data-dependent shapes are listed in ``bad``: ``.item()``
(``_local_scalar_dense``), ``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing,
``repeat_interleave`` with tensor repeats and no ``output_size``, and tensors made from host data
(``lift_fresh``: a blocking host-to-device copy on a GPU). Views launch no kernel and are not counted as work.
Used by ``tests/test_sync_free.py`` and ``benchmarks/codec.py``.
"""

from __future__ import annotations

from collections import Counter
from types import FrameType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# views and metadata ops launch no kernel: not counted as work
_VIEWS = {
    "aten::view",
    "aten::slice",
    "aten::select",
    "aten::alias",
    "aten::as_strided",
    "aten::_reshape_alias",
    "aten::expand",
    "aten::t",
    "aten::transpose",
    "aten::unsqueeze",
    "aten::squeeze",
    "aten::detach",
    "aten::reshape",
    "aten::permute",
    "aten::_unsafe_view",
    "aten::unbind",
    "aten::split",
    "aten::chunk",
    "aten::narrow",
    "aten::view_as",
    "aten::numpy_T",
    "aten::expand_as",
    "aten::unflatten",
    "aten::flatten",
}
# allocations touch no memory: no traffic
_ALLOC = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}
_SYNC = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique_dim",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::equal",
    "aten::is_nonzero",
    "aten::item",
    "aten::lift_fresh",
    "aten::masked_scatter",
}


class OpRecorder(TorchDispatchMode):
    """Counts aten ops by name and lists the ones that force a host sync or a data-dependent shape.

    Attributes:
        ops: ``Counter`` of op names (``aten::...``, ``c10d::...``).
        bad: names of the sync-forcing / data-dependent-shape ops seen, in order.
        traffic_bytes: bytes of the tensor inputs and outputs of every kernel-launching op (views, allocations
            and collectives excluded): the memory traffic of unfused eager execution.
        fused_traffic_bytes: the same, except that each call of a function wrapped with :meth:`fused` counts
            only its arguments and results: the traffic when each such function runs as one fused kernel.
    """

    def __init__(self, keep_events: bool = False):
        super().__init__()
        self.keep_events = keep_events
        self.events: list[tuple[str, str, bool]] = []  # (kind, name, in_backward), with keep_events
        self.ops: Counter = Counter()
        self.bad: list[str] = []
        self.traffic_bytes = 0
        self.fused_traffic_bytes = 0
        self._fused_depth = 0

    def fused(self, fn):
        """``fn`` wrapped so that its ops count, in ``fused_traffic_bytes``, as one fused kernel: the bytes of its
        distinct tensor arguments and results, each once (what a one-pass compiled graph of ``fn`` reads and
        writes). Ops outside such regions count there as they do in ``traffic_bytes``; ``ops``, ``bad`` and
        ``traffic_bytes`` still see every op inside."""

        def wrapper(*args, **kwargs):
            self._fused_depth += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                self._fused_depth -= 1
            if self._fused_depth == 0:
                self.fused_traffic_bytes += _distinct_bytes(tree_flatten((args, kwargs, out))[0])
            return out

        return wrapper

    def collective(self, fn):
        """``fn`` wrapped so that its ops are left out of ``fused_traffic_bytes``: the data movement of a collective
        emulated with aten ops (the fake backend's loopback), not codec work."""

        def wrapper(*args, **kwargs):
            before = self.fused_traffic_bytes
            try:
                return fn(*args, **kwargs)
            finally:
                self.fused_traffic_bytes = before

        return wrapper

    def mark(self, label: str) -> None:
        """Append a marker ``("mark", label, in_backward)`` to :attr:`events` (with ``keep_events``), so a test
        can tell which ops ran between two points of the code (e.g. a publish and the first forward wait)."""
        if self.keep_events:
            self.events.append(("mark", label, _in_backward()))

    @property
    def work(self) -> int:
        """Kernel-launching ops: all but views and collectives."""
        return sum(n for k, n in self.ops.items() if k not in _VIEWS and not k.startswith("c10d::"))

    @property
    def collectives(self) -> int:
        return sum(n for k, n in self.ops.items() if k.startswith("c10d::"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops[name] += 1
        if self.keep_events:
            kind = "sync" if name in _SYNC else "c10d" if name.startswith("c10d::") else "op"
            self.events.append((kind, name if kind != "sync" else f"{name} at {_call_site()}", _in_backward()))
        if name in _SYNC:
            self.bad.append(name)
        elif (
            name == "aten::repeat_interleave"
            and isinstance(args[1] if len(args) > 1 else None, torch.Tensor)
            and kwargs.get("output_size") is None
            and (len(args) < 4 or args[3] is None)
        ):
            self.bad.append("repeat_interleave without output_size")
        elif name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        ):
            self.bad.append(f"{name} with a boolean mask")
        out = func(*args, **kwargs)
        if name not in _VIEWS and name not in _ALLOC and not name.startswith("c10d::"):
            leaves = tree_flatten((args, kwargs, out))[0]
            nbytes = sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
            self.traffic_bytes += nbytes
            if self._fused_depth == 0:
                self.fused_traffic_bytes += nbytes
        return out


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass (its hooks included)."""
    return torch._C._current_graph_task_id() != -1


def _call_site() -> str:
    """Where a recorded op was called from: ``module:function`` of the innermost frame outside torch and this
    module, prefixed by the innermost ``torch.optim`` frame when the op ran inside a torch optimizer
    (``torch.optim.adamw:_single_tensor_adamw < megatron_geo.distributed.optimizer:step``)."""
    import sys

    f: FrameType | None = sys._getframe(2)
    optim: str | None = None
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod.startswith("torch.optim") and optim is None:
            optim = f"{mod}:{f.f_code.co_name}"
        if mod != __name__ and mod.split(".")[0] != "torch":
            site = f"{mod}:{f.f_code.co_name}"
            return site if optim is None else f"{optim} < {site}"
        f = f.f_back
    return "?"


def _distinct_bytes(leaves) -> int:
    """Bytes of the tensors among ``leaves``, a tensor seen twice (an output that is a mutated argument) once."""
    seen, total = set(), 0
    for t in leaves:
        if isinstance(t, torch.Tensor):
            key = (t.data_ptr(), t.numel(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total
