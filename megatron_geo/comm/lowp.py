"""Low-precision reducer: FP8 (E4M3/E5M2) with tensor or block scaling, NVFP4; optional error
feedback, Hadamard rotation, stochastic rounding and shared (MAX-synchronised) scales.

Reduce-scatter of a bucket buffer (FP32; DP rank r owns ``[bounds[r], bounds[r + 1])``, equal chunks or
uneven whole-parameter ranges, see :mod:`megatron_geo.distributed.shard_plan`):

1. optional fixed block-Hadamard rotation (``comm.transform=hadamard``);
2. optional error feedback: ``r = x + e`` (residual kept in the coordinates that are quantised);
3. local scales from the amax of each scale group (:mod:`.scale_layout`), or, with
   ``comm.scale_sync=max``, the MAX over the DP group (NaN mapped to +inf so it survives the MAX);
4. encode the buffer; a uint8 all-to-all with split sizes moves range r's codes to rank r, and a small
   FP32 all-to-all its scales (FP8: one per segment; NVFP4: the E4M3 block scales travel with the codes,
   the FP32 per-parameter global scales here, one per segment; every segment is a whole number of 16- or
   128-element blocks, so scales reach the elements one per block, see :mod:`.scale_layout`);
5. decode each source's copy of this rank's range with that source's scales, sum in FP32 in rank order, divide by
   ``dp_size`` once; undo the rotation. ``e <- r - decode(encode(r))`` (what this rank's quantiser lost).

The all-reduce path re-encodes the averaged shard (no error feedback on that stage), all-gathers the
uint8 payloads and decodes every chunk on every rank, so all ranks hold bitwise identical values.

NVFP4 (E2M1 + one E4M3 scale per 16 elements) takes its FP32 "tensor" scale per parameter (its amax over the
whole bucket, like tensor-scaled FP8), and parameters start 16-aligned, so no block or scale spans two
parameters (a TP-replicated norm weight is encoded the same on every TP rank). The all-reduce path needs an
even plan.

Non-finite inputs are never hidden: a NaN/inf in a group makes that group's scale NaN, the decoded
values NaN, and the global gradient norm (all-reduced) non-finite on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .codecs import FP8_FORMATS, NVFP4_BLOCK, fp8_max
from .compiled import resolve_compile
from .hadamard import exact_fp32, hadamard_matrix, hadamard_signs
from .reducer import PendingReduction, Reducer
from .scale_layout import ScaleLayout, build_scale_layout
from .wire_cast import CAST_DTYPES, CastWire
from .wire_fp8 import FP8Wire
from .wire_nvfp4 import NVFP4Wire
from .wire_sum import REDUCE_OPS, ring_mean, ring_sum
from ..parallel import collectives as C

# tensor-scaled FP8 keeps parameters 16-aligned so that its scales reach the elements one per 16-element block
FP8_TENSOR_GRANULE = 16


class LowPrecisionReducer(Reducer):
    """``comm.dtype`` in fp8_e4m3 | fp8_e5m2 | nvfp4 behind the common reducer interface.

    Per-bucket state (scale layout, error-feedback residual) is registered with :meth:`register_bucket`
    before the first reduction; ``key`` in the collectives selects it.
    """

    wire_dtype = torch.uint8

    def __init__(self, dp_group, dp_size: int, dp_rank: int, fmt: str, scaling: str = "tensor",
                 block_size: int = 128, rounding: str = "nearest", error_feedback: bool = False,
                 transform: str = "none", hadamard_block: int = 128, scale_sync: str = "none", seed: int = 0,
                 device=None, compile: str | bool = "auto", reduce_op: str = "fp32_sum", wire_sum_prediv: bool = True):
        super().__init__(dp_group, dp_size, dp_rank)
        if reduce_op not in REDUCE_OPS or (reduce_op == "wire_sum" and fmt not in FP8_FORMATS):
            raise ValueError(f"comm.reduce_op={reduce_op!r} with comm.dtype={fmt!r}: wire_sum needs fp8_e4m3 or "
                             f"fp8_e5m2; otherwise use fp32_sum")
        if fmt not in FP8_FORMATS and fmt not in CAST_DTYPES and fmt != "nvfp4":
            raise ValueError(f"comm.dtype={fmt!r} is not supported here (fp32, bf16, fp8_e4m3, fp8_e5m2, nvfp4)")
        if fmt == "nvfp4" and scale_sync != "none":
            raise ValueError("comm.scale_sync=max is only supported for fp8 formats (nvfp4 block scales are data)")
        self.name, self.fmt, self.scaling, self.block_size = fmt, fmt, scaling, block_size
        self.rounding, self.error_feedback, self.transform = rounding, error_feedback, transform
        self.hadamard_block, self.scale_sync = hadamard_block, scale_sync
        self.reduce_op, self.wire_sum_prediv = reduce_op, wire_sum_prediv
        # comm.reduce_op=wire_sum on an NCCL with FP8 reductions: its own reduce-scatter; else the exact emulation
        self.native_wire_sum = reduce_op == "wire_sum" and C.supports_fp8_sum(dp_group)
        self.layouts: dict[int, ScaleLayout] = {}
        self._ws: torch.Tensor | None = None  # see _workspace
        self._shard_in_wire_coords: dict[int, torch.Tensor] = {}
        self.geo = None
        self.geo_slots: dict[int, list[tuple[str, int, int, int]]] = {}
        self.residuals: dict[int, torch.Tensor] = {}
        # comm.telemetry_interval: a list while armed; each reduction appends (name, ||Q(g) - g||^2, ||g||^2)
        self.telemetry: list | None = None
        dev = torch.device(device) if device is not None else torch.device("cpu")
        # drawn on the host (identical on every machine), kept where the gradients are
        self.signs = hadamard_signs(hadamard_block, seed).to(dev) if transform == "hadamard" else None
        if self.signs is not None:  # the rotation as one [b, b] matrix: y = x M, x = y M^T (per block row)
            self.rotation = hadamard_matrix(self.signs)
            self.rotation_t = self.rotation.t().contiguous()
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(seed * 1_000_003 + dp_rank)
        self.compile = resolve_compile(compile, dev)
        if fmt in FP8_FORMATS:
            self.wire = FP8Wire(fmt, rounding, self.generator, self.compile)
        elif fmt == "nvfp4":
            self.wire = NVFP4Wire(rounding, self.generator, self.compile)
        else:
            self.wire = CastWire(fmt)

    def alignment(self) -> int:
        """Chunk sizes must be multiples of this (quantisation/rotation blocks never straddle ranks)."""
        a = 1
        if self.fmt == "nvfp4":
            a = NVFP4_BLOCK
        elif self.scaling == "block" and self.fmt in FP8_FORMATS:
            a = self.block_size
        elif self.fmt in FP8_FORMATS:
            a = FP8_TENSOR_GRANULE
        if self.signs is not None:
            a = max(a, self.hadamard_block)  # both powers of two or block | hadamard_block checked by config
        return a

    def register_bucket(self, key: int, offsets: list[int], numels: list[int], bounds, device) -> None:
        super().register_bucket(key, offsets, numels, bounds, device)
        bounds = self.bounds[key]
        scaling = "block" if self.scaling == "block" and self.fmt != "nvfp4" else "tensor"
        # a parameter's scale group covers the alignment padding after it: parameters start aligned, so its
        # last (rotation or scale) block ends there, and that block's rotated values belong to it alone
        a = self.alignment()
        extents = [n if a == 1 or n == 0 else -(-n // a) * a for n in numels]
        # the block tables' granule: NVFP4 reads its buffer as 16-element blocks whatever the alignment (a
        # Hadamard rotation aligns parameters to 128, and the 128-multiples are whole 16-element blocks)
        granule = NVFP4_BLOCK if self.fmt == "nvfp4" else a
        self.layouts[key] = build_scale_layout(offsets, extents, bounds, self.dp_size, scaling, self.block_size,
                                               device, granule=granule)
        if self.error_feedback:
            self.residuals[key] = torch.zeros(bounds[-1], dtype=torch.float32, device=device)

    def reset_error_feedback(self) -> None:
        """Zero every residual (after a skipped step, whose residual may hold non-finite values)."""
        for r in self.residuals.values():
            r.zero_()

    # -- GeoFP8 -------------------------------------------------------------------------------------
    def attach_geo(self, geo, buckets) -> None:
        """Communicate the selected parameters' gradients as G T (see :mod:`megatron_geo.geometry`).

        Each selected parameter's rows must stay whole on their owner (the shard plan cuts it only between
        rows): ``G T`` mixes columns only, so each owner inverts its own rows.
        """
        self.geo = geo
        want = {id(p): n for n, p in geo.params.items()}
        for b in buckets:
            slots = [(want[id(p)], off, p.shape[0], p.shape[1]) for p, off in zip(b.params, b.plan.offsets)
                     if id(p) in want]
            if slots:
                self.geo_slots[b.index] = slots
        geo.rebase_hook = self._rebase_error_feedback
        geo.roundtrip = self.roundtrip

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """One tensor through this reducer's codec and back (round to nearest, its own scale or block
        scales, no reduce): what ``geo.power_search`` scores candidate transforms with."""
        from .roundtrip import quantize_roundtrip

        return quantize_roundtrip(x, {"dtype": self.fmt, "scaling": self.scaling, "block_size": self.block_size})

    def _rebase_error_feedback(self, old: dict, new: dict) -> None:
        """At a refresh: R <- R T_old^-1 T_new (``geo.ef_on_refresh=rebase``) or R <- 0 (``reset``)."""
        for key, slots in self.geo_slots.items():
            if key not in self.residuals:
                continue
            res = self.residuals[key]
            for name, off, rows, cols in slots:
                if name not in new:
                    continue
                view = res[off:off + rows * cols].view(rows, cols)
                if self.geo.ef_on_refresh == "reset":
                    view.zero_()
                else:
                    view.copy_(new[name].apply(old[name].apply_inverse(view)))

    # -- coordinates --------------------------------------------------------------------------------
    def _workspace(self, n: int, device) -> torch.Tensor:
        """FP32 ``[n]`` scratch shared by all buckets (the Hadamard rotation's output, and the decoded mean before
        the inverse rotation), allocated once at the largest size asked for. Each use lies inside one call (rotate
        then encode in :meth:`_reduce_scatter`; decode then rotate back in its epilogue), and calls run one after
        another on the host and in order on the device's stream, so no two buckets hold it live."""
        ws = self._ws
        if ws is None or ws.numel() < n or ws.device != torch.device(device):
            ws = self._ws = torch.empty(n, dtype=torch.float32, device=device)
        return ws[:n]

    def _to_wire(self, x: torch.Tensor, key) -> torch.Tensor:
        """The buffer in the coordinates that are quantised: the Hadamard rotation in the reducer's workspace
        (:meth:`_workspace`, valid until the next call), ``x`` itself transformed in place for GeoFP8 (``x`` is the
        bucket's gradient buffer, consumed by the reduction)."""
        if self.signs is not None:  # into the reducer's workspace: no new bucket-sized buffer per reduction
            ws = self._workspace(x.numel(), x.device)
            with exact_fp32():  # IEEE FP32 (never TF32) whatever the caller's matmul precision
                torch.mm(x.view(-1, self.hadamard_block), self.rotation, out=ws.view(-1, self.hadamard_block))
            return ws
        slots = self.geo_slots.get(key)
        if not slots:
            return x
        if self.geo.profiling:
            for name, off, rows, cols in slots:
                self.geo.record_bound_hits(name, x[off:off + rows * cols])
            return x
        # in place: the caller's bucket buffer is not read again before the reduced result overwrites it
        # (reduce-scatter: this rank's chunk; all-reduce: all of it), so no copy of the bucket is made
        with exact_fp32():  # G T in IEEE FP32: one precision switch for the bucket's layers
            for name, off, rows, cols in slots:
                if name not in self.geo.selected:
                    continue
                self.geo.transforms[name].apply_(x[off:off + rows * cols].view(rows, cols))
        return x

    def _write_back(self, buf: torch.Tensor, start: int, y: torch.Tensor, key) -> None:
        """``buf[start:start + len(y)] = _from_wire(y)``; the inverse Hadamard rotation writes there directly."""
        dest = buf[start:start + y.numel()]
        if self.signs is not None:
            b = self.hadamard_block
            with exact_fp32():
                torch.mm(y.view(-1, b), self.rotation_t, out=dest.view(-1, b))
        else:
            dest.copy_(self._from_wire(y, key, start))

    def _from_wire(self, y: torch.Tensor, key, start: int) -> torch.Tensor:
        """Undo :meth:`_to_wire` on ``y``, the buffer range ``[start, start + len(y))`` (whole parameters)."""
        if self.signs is not None:
            with exact_fp32():
                return torch.mm(y.view(-1, self.hadamard_block), self.rotation_t).view(-1)
        slots = self.geo_slots.get(key)
        if not slots:
            return y
        end = start + y.numel()
        with exact_fp32():  # G^ T^-1 in IEEE FP32: one precision switch for the range's layers
            for name, off, rows, cols in slots:
                lo, hi = max(off, start), min(off + rows * cols, end)
                if name not in self.geo.selected or lo >= hi:
                    continue
                if (lo - off) % cols or (hi - off) % cols:
                    raise RuntimeError(f"GeoFP8 layer {name} is cut inside a row by the shard plan; its rows must "
                                       f"stay whole on their owner (granule {cols})")
                self.geo.transforms[name].apply_inverse_(y[lo - start:hi - start].view(-1, cols))  # rows independent
        return y

    def _sync_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """``comm.scale_sync=max``: the per-group amax MAX-reduced over DP (NaN and inf both become +inf so
        that they survive the MAX, then NaN: nan_to_num would turn +inf into the largest finite float, a
        shared scale that launders an infinite gradient, case c01)."""
        amax = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("inf")))
        C.all_reduce(amax, self.group, op=dist.ReduceOp.MAX)
        self._count_allreduce(amax.numel() * 4)
        return torch.where(torch.isinf(amax), torch.full_like(amax, float("nan")), amax)

    def _count_allreduce(self, nbytes: int) -> None:
        self.bytes_sent += 2 * (self.dp_size - 1) * nbytes // self.dp_size

    # -- collectives --------------------------------------------------------------------------------
    def _measure(self, buf: torch.Tensor, key) -> None:
        """Telemetry: the round trip of this rank's own gradient ``buf`` through the active codec (transform,
        encode, decode, inverse transform; no error feedback, no reduction), squared error and squared norm per
        bucket, and for each selected GeoFP8 layer also through the plain Euclidean codec. Tensors only (no host
        sync here); the trainer reduces them over DP once per telemetry step."""
        layout, out = self.layouts[key], self.telemetry
        # while GeoFP8 profiles bound hits the active codec is the Euclidean one (and _to_wire would count hits)
        profiling = self.geo is not None and self.geo.profiling
        if profiling:
            err = self.wire.roundtrip(buf.clone(), layout).sub_(buf)
        else:
            err = self._from_wire(self.wire.roundtrip(self._to_wire(buf.clone(), key), layout), key, 0).sub_(buf)
        out.append((f"rel_err/bucket{key}", err.square().sum(), buf.square().sum()))
        slots = [s for s in self.geo_slots.get(key, []) if not profiling and s[0] in self.geo.selected]
        if slots:
            e_euclid = self.wire.roundtrip(buf.clone(), layout).sub_(buf)
            for name, off, rows, cols in slots:
                sl = slice(off, off + rows * cols)
                g2 = buf[sl].square().sum()
                out.append((f"rel_err/geo/{name}", err[sl].square().sum(), g2))
                out.append((f"rel_err/euclid/{name}", e_euclid[sl].square().sum(), g2))

    def _reduce_scatter(self, buf: torch.Tensor, key=None, keep_wire: bool = False) -> PendingReduction:
        if self.telemetry is not None:
            self._measure(buf, key)
        layout = self.layouts[key]
        bounds = self.bounds[key]
        dp, r = self.dp_size, self.dp_rank
        lo, own = bounds[r], layout.sizes[r]
        x = self._to_wire(buf, key)
        residual = self.residuals.get(key)
        if residual is not None:  # in place: x is the consumed bucket buffer (or the rotated copy of it)
            x = x.add_(residual)
        if self.reduce_op == "wire_sum":
            return self._wire_sum(buf, x, key, residual, keep_wire)
        sync = self._sync_amax if self.scale_sync == "max" else None
        # the wire format also sets the residual to what this rank's quantiser lost, in place
        codes, scales, shared = self.wire.encode_ranges(x, layout, sync, residual)
        works, recvs = [], []
        for send, splits in codes:
            assert send.dtype == torch.uint8, "the wire carries raw uint8 codes"
            recv = torch.empty(dp * splits[r], dtype=torch.uint8, device=buf.device)
            works.append(C.all_to_all_single(recv, send, self.group, [splits[r]] * dp, splits, async_op=True))
            recvs.append(recv)
            self.bytes_sent += send.numel() - splits[r]
        recv_scales = None
        if scales is not None:
            recv_scales = torch.empty_like(scales)
            works.append(C.all_to_all_single(recv_scales, scales, self.group, async_op=True))
            self.bytes_sent += (dp - 1) * scales.shape[1] * 4
        if shared is not None:  # every rank derived the same scales, so this range's are known locally
            recv_scales = shared[r:r + 1].expand(dp, -1)

        def epilogue():
            for w in works:
                w.wait()
            if keep_wire:  # all-reduce: the gather stage re-encodes the shard in wire coordinates and then
                # overwrites all of buf (even chunks may cut GeoFP8 rows)
                self._shard_in_wire_coords[key] = self.wire.decode_own(
                    recvs, recv_scales, layout, r, torch.empty(own, dtype=torch.float32, device=buf.device))
                return
            if self.signs is not None:  # the mean lands in the workspace and rotates back into the bucket
                avg = self.wire.decode_own(recvs, recv_scales, layout, r, self._workspace(own, buf.device))
                self._write_back(buf, lo, avg, key)
            else:  # straight into the bucket's own range (GeoFP8 then maps it back in place)
                self._from_wire(self.wire.decode_own(recvs, recv_scales, layout, r, buf[lo:lo + own]), key, lo)

        return PendingReduction(None, epilogue)

    def _wire_sum(self, buf: torch.Tensor, x: torch.Tensor, key, residual, keep_wire: bool) -> PendingReduction:
        """``comm.reduce_op=wire_sum`` (:mod:`.wire_sum`): codes with one DP-shared scale per scale group (times N
        with ``comm.wire_sum_prediv``), summed in FP8 in ring order: NCCL's FP8 reduce-scatter (or one reduce
        per owner range) where it has one, else an all-to-all of the codes and :func:`.wire_sum.ring_sum`."""
        layout, bounds = self.layouts[key], self.bounds[key]
        dp, r = self.dp_size, self.dp_rank
        lo, own = bounds[r], layout.sizes[r]
        prediv = self.wire_sum_prediv

        def sync(amax):
            amax = self._sync_amax(amax)
            return amax * dp if prediv else amax

        codes, _, shared = self.wire.encode_ranges(x, layout, sync, residual)
        send, splits = codes[0]
        f8 = FP8_FORMATS[self.fmt]
        # bound hits: this rank's non-zero inputs that its codes flush to zero (counted before the collective,
        # which may reduce into ``send`` in place)
        if self.telemetry is not None:
            self.telemetry.append((f"bound_hits/flushed/bucket{key}",
                                   ((send.view(f8).float() == 0) & (x != 0)).sum().float(),
                                   (x != 0).sum().float()))
        if self.native_wire_sum:
            if self._even(buf, key):
                out = torch.empty(own, dtype=torch.uint8, device=buf.device)
                work = C.reduce_scatter_into(out.view(f8), send.view(f8), self.group, async_op=True)
            else:  # whole-parameter owners: one reduce per range, in place
                out = send[lo:lo + own]
                work = C.reduce_ranges(send.view(f8), bounds, self.group, async_op=True)
            self._count_sent(buf, key, torch.uint8)
        else:
            out = torch.empty(dp * own, dtype=torch.uint8, device=buf.device)
            work = C.all_to_all_single(out, send, self.group, [own] * dp, splits, async_op=True)
            self.bytes_sent += send.numel() - own

        def epilogue():
            work.wait()
            if self.native_wire_sum:
                total = out
                saturated = total.view(f8).float().abs() >= fp8_max(self.fmt)  # final codes at the max
            else:
                total, saturated = ring_sum(out.view(dp, own), r, self.fmt)
            if self.telemetry is not None:
                self.telemetry.append((f"bound_hits/saturated/bucket{key}", saturated.sum().float(),
                                       torch.full((), float(max(own, 1)), device=buf.device)))
            scale = shared[r]                                                                   # [K]
            if keep_wire:  # all-reduce: gather the summed codes as they are, with the shared scale s itself
                # (the gather's decode then divides by N, as below; s / N may be an FP32 subnormal)
                self._shard_in_wire_coords[key] = torch.cat(
                    [total.view(1, -1), scale.view(1, -1).view(torch.uint8)], dim=1)
                return
            g = layout.granule
            avg = ring_mean(self.wire.decode(total.view(-1, g), layout.row_block_values(scale, r)), dp)
            self._write_back(buf, lo, avg, key)

        return PendingReduction(None, epilogue)

    def all_reduce(self, buf: torch.Tensor, key=None, async_op: bool = True) -> PendingReduction:
        self._check(buf, key)
        if self.dp_size == 1:
            return PendingReduction(None)
        if not self._even(buf, key):
            raise ValueError(f"all_reduce needs an even plan; bucket {key} has uneven ranges")
        layout = self.layouts[key]
        dp, r = self.dp_size, self.dp_rank
        rs = self._reduce_scatter(buf, key, keep_wire=True)

        def gather():
            rs.wait()
            shard = self._shard_in_wire_coords.pop(key)
            # wire_sum leaves the summed codes and their scale ready to send; otherwise encode the averaged shard
            payload = shard if shard.dtype == torch.uint8 else self.wire.encode_chunk(shard, layout, r)
            out = torch.empty((dp, payload.shape[1]), dtype=torch.uint8, device=buf.device)
            C.all_gather_into(out.view(-1), payload.reshape(-1), self.group)
            self.bytes_sent += (dp - 1) * payload.shape[1]
            decoded = self.wire.decode_all(out, layout)
            if self.reduce_op == "wire_sum":  # summed codes with the shared scale: p * s, then / N
                decoded = ring_mean(decoded, dp)
            self._write_back(buf, 0, decoded, key)

        pending = PendingReduction(None, gather)
        if not async_op:
            pending.wait()
        return pending
