"""Low-precision reducer: FP8 (E4M3/E5M2) with tensor or block scaling, NVFP4; optional error
feedback, Hadamard rotation, stochastic rounding and shared (MAX-synchronised) scales.

Reduce-scatter of a bucket buffer (FP32; DP rank r owns ``[bounds[r], bounds[r + 1])``, equal chunks or
uneven whole-parameter ranges, see :mod:`megatron_geo.distributed.shard_plan`):

1. the coordinate transform (:mod:`.transforms`): nothing, the fixed block-Hadamard rotation
   (``comm.transform=hadamard``) or GeoFP8's ``G T`` per selected layer (``megatron_geo.geometry.GeoTransform``);
2. optional error feedback: ``r = x + e`` (residual kept in the coordinates that are quantised);
3. local scales from the amax of each scale group (:mod:`.scale_layout`), or, with
   ``comm.scale_sync=max``, the MAX over the DP group (NaN mapped to +inf so it survives the MAX);
4. encode the buffer; a uint8 all-to-all with split sizes moves range r's codes to rank r, and a small
   FP32 all-to-all its scales (FP8: one per segment, with block scaling exactly one per block of the
   destination's range, so uneven ranges send no padding; NVFP4: the E4M3 block scales travel with the codes,
   the FP32 per-parameter global scales here, one per segment; every segment is a whole number of 16- or
   128-element blocks, so scales reach the elements one per block, see :mod:`.scale_layout`);
5. decode each source's copy of this rank's range with that source's scales, sum in FP32 in rank order, divide by
   ``dp_size`` once; undo the transform. ``e <- r - decode(encode(r))`` (what this rank's quantiser lost).

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

import copy

import torch
import torch.distributed as dist

from ..config.schema import CommConfig
from ..parallel import collectives as C
from ..parallel.trace import NO_RANGE, trace_range
from .codec_tables import bucket_scale_layout
from .codecs import FP8_FORMATS, fp8_max
from .compiled import resolve_compile
from .formats import comm_alignment, get_format
from .reducer import BucketReduction, PendingReduction, Reducer
from .scale_layout import ScaleLayout
from .transforms import CoordinateTransform, build_transform
from .wire_sum import REDUCE_OPS, ring_mean, ring_sum


class LowPrecisionReducer(Reducer):
    """A registered wire format (``comm.dtype``: fp8_e4m3 | fp8_e5m2 | nvfp4, or a plain cast behind a transform)
    behind the common reducer interface (:class:`~.reducer.GradientReducer`).

    ``wire``: the format's encoder (``formats.get_format(comm.dtype).make_wire``); ``transform``: the one
    :class:`~.transforms.CoordinateTransform` the buckets are quantised in (``comm.transform``; GeoFP8's replaces the
    identity through :meth:`set_transform`). Per-bucket state (scale layout, error-feedback residual) is made by
    :meth:`register_bucket` before the first reduction and lives in the :class:`~.reducer.BucketReduction` it returns,
    which the collectives take (or its key) to select it. The residuals and the stochastic-rounding generator are the
    reducer's :meth:`state_dict`.

    Args:
        comm: the ``comm`` config section (:class:`~megatron_geo.config.schema.CommConfig`), whole; its combination
            rules are :meth:`.formats.WireFormat.check`'s (:func:`.factory.build_reducer` applies them). The
            reducer keeps a copy as ``self.comm``.
        dp_group: the data-parallel process group (None: the default group).
        dp_size, dp_rank: data-parallel ranks and this rank's index (ints).
        seed: int; the Hadamard signs and the stochastic-rounding draws (``seed * 1_000_003 + dp_rank``).
        device: where the transform's constants and the generator live (None: CPU).

    Raises:
        ValueError: an unregistered ``comm.dtype``, an unknown ``comm.transform``, ``comm.reduce_op`` or
            ``comm.compile``.
    """

    wire_dtype = torch.uint8

    def __init__(self, comm: CommConfig, dp_group, dp_size: int, dp_rank: int, seed: int = 0, device=None):
        super().__init__(dp_group, dp_size, dp_rank)
        wire_format = get_format(comm.dtype)  # ValueError naming the registered formats
        if comm.reduce_op not in REDUCE_OPS:  # an invariant, not a rule: nothing else to fall back on
            raise ValueError(f"comm.reduce_op={comm.reduce_op!r} is not one of {', '.join(REDUCE_OPS)}")
        self.comm = copy.copy(comm)
        self.name = self.fmt = comm.dtype
        # comm.reduce_op=wire_sum on an NCCL with FP8 reductions: its own reduce-scatter; else the exact emulation
        self.native_wire_sum = comm.reduce_op == "wire_sum" and C.supports_fp8_sum(dp_group)
        self._shard_in_wire_coords: dict[int, torch.Tensor] = {}  # bucket key -> an all-reduce's reduced shard
        # comm.telemetry_interval: a list while armed; each reduction appends (name, ||Q(g) - g||^2, ||g||^2)
        self.telemetry: list | None = None
        dev = torch.device(device) if device is not None else torch.device("cpu")
        # the coordinates that are quantised; GeoFP8's layer transforms replace the identity at set_transform
        self.transform: CoordinateTransform = build_transform(comm.transform, comm.hadamard_block, seed, dev)
        self.generator = torch.Generator(device=dev)
        self.generator.manual_seed(seed * 1_000_003 + dp_rank)
        self.compile = resolve_compile(comm.compile, dev)
        self.wire = wire_format.make_wire(self.comm, self.generator, self.compile)

    @property
    def geo(self):
        """The GeoFP8 state behind the current transform (``geometry.GeoState``), or ``None``."""
        return self.transform.geo

    def alignment(self) -> int:
        """Chunk sizes must be multiples of this (quantisation/rotation blocks never straddle ranks)."""
        return max(comm_alignment(self.comm), self.transform.alignment())

    @property
    def layouts(self) -> dict[int, ScaleLayout]:
        """Bucket key -> the registered bucket's scale layout, a new dict."""
        return {k: b.layout for k, b in self.registered.items() if b.layout is not None}

    @property
    def residuals(self) -> dict[int, torch.Tensor]:
        """Bucket key -> the registered bucket's error-feedback residual (FP32 ``[bucket numel]``, the live tensor), a
        new dict; empty without ``comm.error_feedback``."""
        return {k: b.residual for k, b in self.registered.items() if b.residual is not None}

    def register_bucket(
        self, key: int, offsets: list[int], numels: list[int], bounds: list[int] | int, device
    ) -> BucketReduction:
        """:meth:`.reducer.Reducer.register_bucket`, plus the bucket's scale layout and (``comm.error_feedback``) its
        zero residual in the returned object; the transform registers the bucket too and tracks the residuals."""
        rb = super().register_bucket(key, offsets, numels, bounds, device)
        # every tensor of the layout is made here, never inside a reduction (codec_tables counts the same bytes)
        rb.layout = bucket_scale_layout(
            self.comm, rb.offsets, rb.numels, rb.bounds, self.dp_size, rb.device, alignment=self.alignment()
        )
        self.transform.register_bucket(key, rb.offsets, rb.numels, rb.bounds, rb.device)
        if self.comm.error_feedback:
            rb.residual = torch.zeros(rb.bounds[-1], dtype=torch.float32, device=rb.device)
            self.transform.track_residuals(self.residuals)
        return rb

    def _layout(self, rb: BucketReduction | None) -> ScaleLayout:
        """The scale layout of a registered bucket.

        Raises:
            KeyError: an unregistered buffer (this reducer has no layout for it).
        """
        if rb is None or rb.layout is None:
            raise KeyError(f"the {self.name} reducer reduces registered buckets only (see register_bucket)")
        return rb.layout

    def set_transform(self, transform: CoordinateTransform) -> None:
        """Quantise in ``transform``'s coordinates from now on (GeoFP8: ``megatron_geo.training.geo_setup``). The
        buckets registered so far are registered with it, and it keeps the error-feedback residuals in its
        coordinates (re-based when they change).

        Raises:
            ValueError: the registered buckets' alignment is not a multiple of ``transform.alignment()``.
        """
        a = self.alignment()
        if a % transform.alignment():
            raise ValueError(
                f"transform {transform.name} needs {transform.alignment()}-element alignment; the "
                f"buckets were laid out for {a}"
            )
        for key, rb in self.registered.items():
            transform.register_bucket(key, rb.offsets, rb.numels, rb.bounds, rb.device)
        transform.track_residuals(self.residuals)
        self.transform = transform

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor this reducer keeps from one reduction to the next, by name: ``layout/<key>/<table>`` (the
        scale layouts' segment tables, :meth:`.scale_layout.ScaleLayout.tensors`), ``residual/<key>`` (FP32
        ``[bucket numel]`` error-feedback residuals) and ``transform/<attribute>`` (the fixed transform's
        constants and its shared workspace once allocated; a GeoFP8 transform's state is the GeoFP8 module's).
        Views of one storage are listed once per name."""
        out = {f"layout/{k}/{n}": t for k, lay in self.layouts.items() for n, t in lay.tensors().items()}
        out.update({f"residual/{k}": t for k, t in self.residuals.items()})
        if self.transform.geo is None:
            out.update({f"transform/{n}": t for n, t in vars(self.transform).items() if isinstance(t, torch.Tensor)})
        return out

    def index_table_bytes(self) -> int:
        """Bytes of the registered buckets' scale layouts (the ``layout/...`` entries of
        :meth:`persistent_tensors`); what :func:`.codec_tables.codec_table_bytes` gives for the same buckets."""
        return sum(lay.table_bytes() for lay in self.layouts.values())

    def reset_error_feedback(self) -> None:
        """Zero every residual (after a skipped step, whose residual may hold non-finite values)."""
        for r in self.residuals.values():
            r.zero_()

    def state_dict(self) -> dict:
        """``{"residuals": {bucket key: FP32 [bucket numel]}, "generator": uint8 state}``: the error-feedback residuals
        (in the transform's coordinates; empty without ``comm.error_feedback``) and the stochastic-rounding
        generator. The tensors are the live state (copy before changing them)."""
        return {"residuals": dict(self.residuals), "generator": self.generator.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        """Copy :meth:`state_dict`'s entries in (absent entries are left as they are).

        Raises:
            KeyError: a residual for a bucket without error feedback here.
            ValueError: a residual of another size than the bucket's.
        """
        for key, t in sd.get("residuals", {}).items():
            if key not in self.residuals:
                raise KeyError(
                    f"bucket {key!r} has no error-feedback residual here (comm.error_feedback=false or not registered)"
                )
            res = self.residuals[key]
            if t.numel() != res.numel():
                raise ValueError(f"bucket {key!r}: residual of {t.numel()} elements, the bucket has {res.numel()}")
            res.copy_(t.reshape(-1))
        if "generator" in sd:
            self.generator.set_state(sd["generator"])

    def _sync_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """``comm.scale_sync=max``: the per-group amax MAX-reduced over DP (NaN and inf both become +inf so
        that they survive the MAX, then NaN: nan_to_num would turn +inf into the largest finite float, a
        shared scale that launders an infinite gradient)."""
        amax = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("inf")))
        with trace_range("collective"):
            C.all_reduce(amax, self.group, op=dist.ReduceOp.MAX)
        self._count_allreduce(amax.numel() * 4)
        return torch.where(torch.isinf(amax), torch.full_like(amax, float("nan")), amax)

    def _transform_range(self):
        """The ``transform`` range around the coordinate change and its inverse: none for the identity."""
        return NO_RANGE if self.transform.name == "none" else trace_range("transform")

    def _count_allreduce(self, nbytes: int) -> None:
        self.bytes_sent += 2 * (self.dp_size - 1) * nbytes // self.dp_size

    # -- collectives --------------------------------------------------------------------------------
    def _measure(self, buf: torch.Tensor, rb: BucketReduction) -> None:
        """Telemetry: the round trip of this rank's own gradient ``buf`` through the active codec (transform,
        encode, decode, inverse transform; no error feedback, no reduction), squared error and squared norm per
        bucket, and for each selected GeoFP8 layer also through the plain Euclidean codec. Tensors only (no host
        sync here); the trainer reduces them over DP once per telemetry step."""
        layout, out, t, key = self._layout(rb), self.telemetry, self.transform, rb.key
        assert out is not None  # called only while telemetry is armed
        # record=False: the trial round trip leaves no trace (GeoFP8's bound-hit profile counts reductions only)
        err = t.from_wire(self.wire.roundtrip(t.to_wire(buf.clone(), key, record=False), layout), key, 0).sub_(buf)
        out.append((f"rel_err/bucket{key}", err.square().sum(), buf.square().sum()))
        slots = t.transformed_layers(key)
        if slots:
            e_euclid = self.wire.roundtrip(buf.clone(), layout).sub_(buf)
            for name, off, rows, cols in slots:
                sl = slice(off, off + rows * cols)
                g2 = buf[sl].square().sum()
                out.append((f"rel_err/geo/{name}", err[sl].square().sum(), g2))
                out.append((f"rel_err/euclid/{name}", e_euclid[sl].square().sum(), g2))

    def _reduce_scatter(
        self, buf: torch.Tensor, rb: BucketReduction | None, keep_wire: bool = False
    ) -> PendingReduction:
        layout = self._layout(rb)
        assert rb is not None  # _layout refuses an unregistered buffer
        if self.telemetry is not None:
            self._measure(buf, rb)
        key, bounds = rb.key, rb.bounds
        dp, r = self.dp_size, self.dp_rank
        lo, own = bounds[r], layout.sizes[r]
        with self._transform_range():
            x = self.transform.to_wire(buf, key)
        residual = rb.residual
        if residual is not None:  # in place: x is the consumed bucket buffer (or the rotated copy of it)
            with trace_range("encode"):
                x = x.add_(residual)
        if self.comm.reduce_op == "wire_sum":
            return self._wire_sum(buf, x, rb, keep_wire)
        sync = self._sync_amax if self.comm.scale_sync == "max" else None
        # the wire format also sets the residual to what this rank's quantiser lost, in place
        with trace_range("encode"):
            codes, scales, shared = self.wire.encode_ranges(x, layout, sync, residual)
        works, recvs = [], []
        with trace_range("collective"):
            for send, splits in codes:
                assert send.dtype == torch.uint8, "the wire carries raw uint8 codes"
                recv = torch.empty(dp * splits[r], dtype=torch.uint8, device=buf.device)
                works.append(C.all_to_all_single(recv, send, self.group, [splits[r]] * dp, splits, async_op=True))
                recvs.append(recv)
                self.bytes_sent += send.numel() - splits[r]
            recv_scales = None
            if scales is not None:  # split like the codes: each destination gets what its range needs, unpadded
                send, splits = scales
                recv = torch.empty(dp * splits[r], dtype=send.dtype, device=send.device)
                works.append(C.all_to_all_single(recv, send, self.group, [splits[r]] * dp, splits, async_op=True))
                recv_scales = recv.view(dp, splits[r])
                self.bytes_sent += (send.numel() - splits[r]) * send.element_size()
        if shared is not None:  # every rank derived the same scales, so this range's are known locally
            recv_scales = shared[r : r + 1].expand(dp, -1)

        def epilogue():
            with trace_range("collective"):
                for w in works:
                    w.wait()
            if keep_wire:  # all-reduce: the gather stage re-encodes the shard in wire coordinates and then
                # overwrites all of buf (even chunks may cut GeoFP8 rows)
                with trace_range("decode"):
                    self._shard_in_wire_coords[key] = self.wire.decode_own(
                        recvs, recv_scales, layout, r, torch.empty(own, dtype=torch.float32, device=buf.device)
                    )
                return
            # the mean lands where the transform wants it (the bucket's own range, or a scratch to rotate back from)
            with trace_range("decode"):
                avg = self.wire.decode_own(recvs, recv_scales, layout, r, self.transform.decode_target(buf, lo, own))
            with self._transform_range():
                self.transform.write_back(buf, lo, avg, key)

        return PendingReduction(None, epilogue)

    def _wire_sum(self, buf: torch.Tensor, x: torch.Tensor, rb: BucketReduction, keep_wire: bool) -> PendingReduction:
        """``comm.reduce_op=wire_sum`` (:mod:`.wire_sum`): codes with one DP-shared scale per scale group (times N
        with ``comm.wire_sum_prediv``), summed in FP8 in ring order: NCCL's FP8 reduce-scatter (or one reduce
        per owner range) where it has one, else an all-to-all of the codes and :func:`.wire_sum.ring_sum`."""
        layout, bounds, key, residual = self._layout(rb), rb.bounds, rb.key, rb.residual
        dp, r = self.dp_size, self.dp_rank
        lo, own = bounds[r], layout.sizes[r]
        prediv = self.comm.wire_sum_prediv

        def sync(amax):
            amax = self._sync_amax(amax)
            return amax * dp if prediv else amax

        with trace_range("encode"):
            codes, _, shared = self.wire.encode_ranges(x, layout, sync, residual)
        send, splits = codes[0]
        f8 = FP8_FORMATS[self.fmt]
        # bound hits: this rank's non-zero inputs that its codes flush to zero (counted before the collective,
        # which may reduce into ``send`` in place)
        if self.telemetry is not None:
            self.telemetry.append(
                (
                    f"bound_hits/flushed/bucket{key}",
                    ((send.view(f8).float() == 0) & (x != 0)).sum().float(),
                    (x != 0).sum().float(),
                )
            )
        with trace_range("collective"):
            if self.native_wire_sum:
                if self._even(rb):
                    out = torch.empty(own, dtype=torch.uint8, device=buf.device)
                    work = C.reduce_scatter_into(out.view(f8), send.view(f8), self.group, async_op=True)
                else:  # whole-parameter owners: one reduce per range, in place
                    out = send[lo : lo + own]
                    work = C.reduce_ranges(send.view(f8), bounds, self.group, async_op=True)
                self._count_sent(buf, rb, torch.uint8)
            else:
                out = torch.empty(dp * own, dtype=torch.uint8, device=buf.device)
                work = C.all_to_all_single(out, send, self.group, [own] * dp, splits, async_op=True)
                self.bytes_sent += send.numel() - own

        def epilogue():
            with trace_range("collective"):
                work.wait()
            if self.native_wire_sum:
                total = out
                saturated = total.view(f8).float().abs() >= fp8_max(self.fmt)  # final codes at the max
            else:
                with trace_range("decode"):  # the FP8 sum in ring order
                    total, saturated = ring_sum(out.view(dp, own), r, self.fmt)
            if self.telemetry is not None:
                self.telemetry.append(
                    (
                        f"bound_hits/saturated/bucket{key}",
                        saturated.sum().float(),
                        torch.full((), float(max(own, 1)), device=buf.device),
                    )
                )
            scale = shared[r]  # [K]
            if keep_wire:  # all-reduce: gather the summed codes as they are, with the shared scale s itself
                # (the gather's decode then divides by N, as below; s / N may be an FP32 subnormal)
                self._shard_in_wire_coords[key] = torch.cat(
                    [total.view(1, -1), scale.view(1, -1).view(torch.uint8)], dim=1
                )
                return
            g = layout.granule
            with trace_range("decode"):
                avg = ring_mean(self.wire.decode(total.view(-1, g), layout.row_block_values(scale, r)), dp)
            with self._transform_range():
                self.transform.write_back(buf, lo, avg, key)

        return PendingReduction(None, epilogue)

    def all_reduce(
        self, buf: torch.Tensor, bucket: BucketReduction | int | None = None, async_op: bool = True
    ) -> PendingReduction:
        rb = self._resolve(bucket)
        self._check(buf, rb)
        if self.dp_size == 1:
            return PendingReduction(None)
        if not self._even(rb):
            raise ValueError(f"all_reduce needs an even plan; bucket {rb.key if rb else None} has uneven ranges")
        layout = self._layout(rb)
        assert rb is not None  # _layout refuses an unregistered buffer
        key = rb.key
        dp, r = self.dp_size, self.dp_rank
        rs = self._reduce_scatter(buf, rb, keep_wire=True)

        def gather():
            rs.wait()
            shard = self._shard_in_wire_coords.pop(key)
            # wire_sum leaves the summed codes and their scale ready to send; otherwise encode the averaged shard
            if shard.dtype == torch.uint8:
                payload = shard
            else:
                with trace_range("encode"):
                    payload = self.wire.encode_chunk(shard, layout, r)
            out = torch.empty((dp, payload.shape[1]), dtype=torch.uint8, device=buf.device)
            with trace_range("collective"):
                C.all_gather_into(out.view(-1), payload.reshape(-1), self.group)
            self.bytes_sent += (dp - 1) * payload.shape[1]
            with trace_range("decode"):
                decoded = self.wire.decode_all(out, layout)
                if self.comm.reduce_op == "wire_sum":  # summed codes with the shared scale: p * s, then / N
                    decoded = ring_mean(decoded, dp)
            with self._transform_range():
                self.transform.write_back(buf, 0, decoded, key)

        pending = PendingReduction(None, gather)
        if not async_op:
            pending.wait()
        return pending
