"""K-FAC input statistics A = E[a a^T] of the selected linear layers, collected only when armed.

Forward pre-hooks are registered on the selected modules by :meth:`InputStats.arm` and removed by
:meth:`InputStats.disarm`, so steps between refreshes pay nothing. :meth:`InputStats.reduce` sums the
statistics and token counts over the DP group (never over TP: a row-parallel layer's input is its own
d_in slice and gets its own factor, i.e. a block-diagonal transform of the full layer).

Everything here is FP32 whatever the forward runs in: the hooks fire inside the forward's autocast region
(BF16 on CUDA), so they run under :func:`~megatron_geo.parallel.precision.exact_fp32` (autocast off for every
device type, IEEE FP32 matmuls, never TF32) with explicit dtypes, and the DP sum travels as FP32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import collectives as C
from ..parallel.precision import exact_fp32


class InputStats:
    """Accumulates ``sum_t a_t a_t^T`` (FP32, ``[d_in, d_in]``) and the token count per module name.

    With ``sketches`` (module name -> test matrix Omega ``[d_in, k]``), those modules accumulate the
    randomized sketch ``sum_t a_t (a_t^T Omega)`` (``[d_in, k]``) and ``sum_t |a_t|^2`` (the trace)
    instead, O(d_in k) memory (see :func:`~megatron_geo.geometry.transform.build_transform_from_sketch`).
    """

    def __init__(self, modules: dict[str, nn.Module], sketches: dict[str, torch.Tensor] | None = None):
        self.modules = modules
        self.sketches = sketches or {}
        self.sums: dict[str, torch.Tensor] = {}
        self.traces: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self._handles = []

    def arm(self) -> None:
        """Register the hooks (idempotent) and clear the previous statistics."""
        self.disarm()
        self.sums.clear()
        self.counts.clear()
        self.traces.clear()  # per refresh, like the sums (kept across refreshes, a resumed run would diverge)
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_pre_hook(self._hook(name)))

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, args):
            with exact_fp32():  # the forward's autocast would make these BF16 matmuls
                a = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
                omega = self.sketches.get(name)
                if omega is None:
                    s = a.T @ a
                else:
                    s = a.T @ (a @ omega.to(device=a.device, dtype=torch.float32))
                    self.traces[name] = self.traces.get(name, 0.0) + float(a.pow(2).sum(dtype=torch.float32))
                if name in self.sums:
                    self.sums[name] += s
                    self.counts[name] += a.shape[0]
                else:
                    self.sums[name], self.counts[name] = s, float(a.shape[0])

        return hook

    def reduce(self, dp_group, owners: dict[str, int] | None = None) -> dict[str, torch.Tensor | None]:
        """DP-averaged factors ``A = sum a a^T / count`` per module; for sketched modules
        ``(Y = A Omega, trace(A))``.

        Without ``owners`` every DP rank gets every factor (all-reduce). With ``owners`` (module name ->
        rank within ``dp_group``) each factor is summed onto its owner only (reduce) and the other ranks
        get ``None`` for it: the owner builds that layer's transform and broadcasts it.

        Every rank must have collected the same module names (same model, same armed micro-batch).

        Returns float32 factors (``[d_in, d_in]``, or ``[d_in, k]`` and a Python float), summed over DP in FP32.

        Raises:
            RuntimeError: a module saw no input since :meth:`arm`.
        """
        with exact_fp32():
            return self._reduce(dp_group, owners)

    def _reduce(self, dp_group, owners: dict[str, int] | None) -> dict[str, torch.Tensor | None]:
        out = {}
        me = dist.get_rank(dp_group)
        for name in sorted(self.modules):
            if name not in self.sums:
                raise RuntimeError(
                    f"no input statistics were collected for {name}; was the module used in forward? "
                    f"(a block compiled in place must run eagerly while the statistics are armed: "
                    f"GeoState.arm does that)"
                )
            s = self.sums[name].to(torch.float32)
            # one collective per layer: the FP32 sums, then the token count and trace (FP32 holds the count
            # exactly up to 2^24 tokens summed over the DP group per refresh; the trace only scales the damping)
            tail = torch.tensor([self.counts[name], self.traces.get(name, 0.0)], dtype=torch.float32, device=s.device)
            buf = torch.cat([s.reshape(-1), tail])
            if owners is None:
                C.all_reduce(buf, dp_group)
            else:
                C.reduce(buf, dp_group, owners[name])
                if owners[name] != me:
                    out[name] = None
                    continue
            s = buf[:-2].view(s.shape)
            count, trace = buf[-2:].double().tolist()
            out[name] = s / count if name not in self.sketches else (s / count, trace / count)
        return out
