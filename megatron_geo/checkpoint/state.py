"""The training state as a torch.distributed.checkpoint (DCP) state dict, for saving and for loading.

Layout-independent entries (reshardable to any DP x TP):

- ``model/<name>``: the FP32 main params (the master weights; a BF16 model is their cast), one tensor
  of the parameter's global logical shape (TP = 1, vocabulary padding dropped; see :mod:`.layout`).
  Each element is written once, by the DP rank that owns it in the distributed optimizer (and by TP
  rank 0 for TP-replicated parameters): a ``ShardedTensor`` whose local shards are the rank's pieces.
- ``optim/<name>/<state>``: the per-element optimizer state in the same layout (AdamW ``exp_avg``,
  ``exp_avg_sq``; Muon ``momentum_buffer``), without any padding of the shard plan.
- ``optim/<name>/step``: AdamW's step count (a replicated scalar).
- ``held/<name>``: with the quantised parameter gather (``comm.param_gather=fp8`` / ``nvfp4``), the parameters every
  replica holds (in FP32; they differ from the main params rounded to the model's dtype by the gather's last
  quantisation error, :mod:`megatron_geo.distributed.param_gather`), in the same layout as ``model/<name>``. A load
  restores them exactly (a plain gather), so a resume continues bitwise at any DP x TP layout.

Layout-specific entries (restored only when DP and TP sizes are unchanged, otherwise reset and logged):

- ``dp<d>.tp<t>/ef/<name>``: the error-feedback residual of a parameter (DP rank d's own, in the
  coordinates it is quantized in: transformed coordinates for GeoFP8 layers).
- ``dp<d>.tp<t>/rng/*``: torch CPU (and CUDA) RNG state and the reducer's stochastic-rounding generator.
- ``dp<d>.tp<t>/geo/hits``: GeoFP8 bound-hit profile (select=auto) of this rank.
- ``dp<d>.tp<t>/param_gather/max_ulps``: the quantised parameter gather's largest deviation so far (float64 ``[1]``,
  this rank's); a load at any layout starts every rank from the maximum over all saved ranks, so the logged
  ``param_gather/max_ulps`` of a resumed run is the straight run's.
- ``tp<t>/geo/<name>/U`` and ``/d``: GeoFP8 transforms (identical on every DP rank; needs the same TP).

The reducer's entries come from its ``state_dict()`` / go back through ``load_state_dict()`` (error-feedback
residuals per bucket, cut here into per-parameter views; the generator state), the GeoFP8 entries likewise from
the GeoFP8 state's (``megatron_geo.geometry.GeoState``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm.reducer import GradientReducer
from ..distributed.optimizer import DistributedOptimizer, MainParam
from ..geometry import GeoState
from ..parallel import ParallelContext
from ..parallel import collectives as C
from .agreement import agree, all_gather_ints
from .layout import global_shape, piece_rects

ADAMW_STATES = ("exp_avg", "exp_avg_sq")
MAX_ULPS = "param_gather/max_ulps"  # per-rank entry of the quantised parameter gather's running deviation
MUON_STATES = ("momentum_buffer",)


def rank_devices(pctx: ParallelContext) -> list[torch.device]:
    """The device of every global rank (``cuda:<index>`` or ``cpu``), in rank order, for the shard placements.

    Collective over the world group: one all-gather of the device indices (on ``pctx.device``); every rank
    computes on the same device type.
    """
    idx = pctx.device.index if pctx.device.index is not None else -1
    return [
        torch.device(pctx.device.type, i) if i >= 0 else torch.device(pctx.device.type)
        for (i,) in all_gather_ints([idx], pctx.world_group, pctx.device)
    ]


def _sharded_tensor(
    shards: list[tuple[tuple[int, ...], torch.Tensor]],
    size: tuple[int, ...],
    everyone: list[tuple[int, tuple[int, ...], tuple[int, ...]]],
    devices: list[torch.device],
    rank: int,
    group,
):
    """A ShardedTensor of global ``size`` (FP32) from this rank's ``(offsets, tensor)`` shards (not collective).

    ``everyone`` lists the ``(global rank, offsets, sizes)`` of every rank's shards (the global metadata,
    computed by :meth:`StateLayout.global_rects` on each rank alike); ``devices[r]`` is rank r's device,
    which its placement names with the index (``rank:0/cuda:0``), as torch's ``Shard`` requires.

    Raises:
        RuntimeError: this rank's shards are not its entries of ``everyone`` (the layouts of the ranks differ).
        ValueError: torch rejects a shard (a shard tensor's device, dtype or shape differs from its metadata).
    """
    with warnings.catch_warnings():
        # ShardedTensor carries a deprecation warning, but it is the DCP type that describes arbitrary
        # (uneven, multi-rectangle) shards, which the distributed optimizer's pieces are; DTensor cannot.
        warnings.simplefilter("ignore")
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
        from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

        metas = [ShardMetadata(list(off), list(sz), f"rank:{r}/{devices[r]}") for r, off, sz in everyone]
        mine = [md for (r, _, _), md in zip(everyone, metas) if r == rank]
        if [tuple(md.shard_offsets) for md in mine] != [tuple(off) for off, _ in shards]:
            raise RuntimeError(
                f"rank {rank}'s checkpoint shards start at {[tuple(off) for off, _ in shards]} but the "
                f"shard plan puts them at {[tuple(md.shard_offsets) for md in mine]}"
            )
        local = [Shard(t, md) for (_, t), md in zip(shards, mine)]
        props = TensorProperties(
            dtype=torch.float32,
            layout=torch.strided,
            requires_grad=False,
            memory_format=torch.contiguous_format,
            pin_memory=False,
        )
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, ShardedTensorMetadata(metas, torch.Size(size), props), process_group=group
        )


class StateLayout:
    """Which elements of which parameter this rank writes (and reads back), in global coordinates."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: DistributedOptimizer,
        pctx: ParallelContext,
        vocab_size: int,
        optimizer_name: str,
    ):
        self.pctx, self.optimizer = pctx, optimizer
        self.params = dict(model.named_parameters())
        self.padded_vocab = getattr(model, "padded_vocab", None)
        self.vocab_size = vocab_size
        self.muon = optimizer_name == "muon"
        self.by_name: dict[str, list[MainParam]] = {}
        for m in optimizer.mains:
            self.by_name.setdefault(m.name, []).append(m)
        self.place = {n: (b, i) for b in optimizer.buckets for i, n in enumerate(b.names)}  # name -> (bucket, index)

    def partition_dim(self, p: torch.nn.Parameter) -> int | None:
        return p.partition_dim if getattr(p, "tensor_model_parallel", False) else None  # type: ignore[attr-defined]

    def logical_rows(self, name: str, p: torch.nn.Parameter) -> int | None:
        if self.padded_vocab is not None and name in ("embed.weight", "output.weight"):
            return self.vocab_size
        return None

    def global_shape(self, name: str) -> tuple[int, ...]:
        p = self.params[name]
        return global_shape(tuple(p.shape), self.partition_dim(p), self.pctx.tp_size, self.logical_rows(name, p))

    def writes(self, m: MainParam) -> bool:
        """True when this rank is the one that writes (and reads) ``m``'s elements."""
        tp_ok = self.pctx.tp_rank == 0 or self.partition_dim(m.param) is not None
        dp_ok = self.optimizer.sharded or self.pctx.dp_rank == 0
        return tp_ok and dp_ok

    def global_rects(self, name: str) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """``(global rank, offsets, sizes)`` of every rectangle of ``name`` that any rank writes, in rank order
        (the same list on every rank: computed from the bucket's shard plan, which every rank holds whole).
        The rectangles tile the global tensor exactly once."""
        p = self.params[name]
        b, i = self.place[name]
        pdim, rows = self.partition_dim(p), self.logical_rows(name, p)
        out = []
        for d in range(self.pctx.dp_size):
            if not (self.optimizer.sharded or d == 0):
                continue
            spans = (
                [(pc.param_start, pc.param_end) for pc in b.plan.pieces[d] if pc.index == i]
                if self.optimizer.sharded
                else [(0, p.numel())]
            )
            for t in range(self.pctx.tp_size):
                if t != 0 and pdim is None:
                    continue
                for lo, hi in spans:
                    for r in piece_rects(tuple(p.shape), pdim, t, lo, hi, rows):
                        out.append((d * self.pctx.tp_size + t, r.offsets, r.sizes))
        return sorted(out, key=lambda e: e[0])

    def state_names(self, name: str) -> tuple[str, ...]:
        return MUON_STATES if self.muon and getattr(self.params[name], "use_muon", False) else ADAMW_STATES

    def shards(self, name: str, tensor_of) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(global offsets, view)`` of every rectangle this rank writes of ``name``; ``tensor_of(m)``
        gives the flat FP32 tensor (main param or a state) of each main param ``m``."""
        p = self.params[name]
        out = []
        for m in self.by_name.get(name, []):
            if not self.writes(m):
                continue
            flat = tensor_of(m).reshape(-1)
            lo = m.param_start
            for r in piece_rects(
                tuple(p.shape),
                self.partition_dim(p),
                self.pctx.tp_rank,
                lo,
                lo + m.main.numel(),
                self.logical_rows(name, p),
            ):
                out.append((r.offsets, flat[r.flat_lo - lo : r.flat_hi - lo].view(r.sizes)))
        return out

    @property
    def tag(self) -> str:
        return f"dp{self.pctx.dp_rank}.tp{self.pctx.tp_rank}"


def optimizer_state_ready(optimizer: DistributedOptimizer, group) -> bool:
    """True when every main param on every rank of ``group`` has optimizer state (False before the first
    update). Collective over ``group`` (an all-gather of one flag per rank, on ``pctx.device``)."""
    ok = all(len(opt.state.get(m.main, {})) > 0 for m in optimizer.mains for opt in [optimizer.optimizer_of(m)])
    return all(f for (f,) in all_gather_ints([1 if ok else 0], group, optimizer.pctx.device))


def build_save_state(
    layout: StateLayout, reducer: GradientReducer, geo: GeoState | None, with_optimizer_state: bool
) -> dict:
    """The DCP state dict to save: this rank's part of every entry of the module docstring.

    Collective over the world group (every rank calls it, with the same model). Model and optimizer
    entries are FP32 ``ShardedTensor``s of the parameter's global shape whose shards stay on this rank's
    device (their placements name it with its index, e.g. ``rank:3/cuda:3``); the global metadata (every
    rank's offsets and sizes) comes from the shard plan, so building the dict moves no data.

    Raises:
        CheckpointRankError: on every rank when building the state failed on any rank (nothing is written;
            the rank's own exception is chained on the rank that failed).
    """
    pctx = layout.pctx
    devices = rank_devices(pctx)
    sd, err = {}, None
    try:
        sd = _save_entries(layout, reducer, geo, with_optimizer_state, devices)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before DCP's collectives
        err = e
    agree(err, pctx.world_group, pctx.device, "building the checkpoint state")
    return sd


def _save_entries(layout: StateLayout, reducer, geo, with_optimizer_state: bool, devices: list[torch.device]) -> dict:
    """The body of :func:`build_save_state` (local: no collectives)."""
    pctx, opt = layout.pctx, layout.optimizer
    world = pctx.world_group
    sd: dict = {}
    for name in layout.params:
        if not layout.params[name].requires_grad:
            continue
        size, everyone = layout.global_shape(name), layout.global_rects(name)
        sd[f"model/{name}"] = _sharded_tensor(
            layout.shards(name, lambda m: m.main.detach()), size, everyone, devices, pctx.rank, world
        )
        if opt.quantized_gather is not None:  # what the replicas hold: not the main params rounded
            sd[f"held/{name}"] = _sharded_tensor(
                layout.shards(name, lambda m: held_view(m).float()), size, everyone, devices, pctx.rank, world
            )
        if not with_optimizer_state:
            continue
        for s in layout.state_names(name):
            sd[f"optim/{name}/{s}"] = _sharded_tensor(
                layout.shards(name, lambda m, s=s: opt.optimizer_of(m).state[m.main][s]),
                size,
                everyone,
                devices,
                pctx.rank,
                world,
            )
        for m in layout.by_name.get(name, []):
            st = opt.optimizer_of(m).state[m.main]
            if "step" in st:
                sd[f"optim/{name}/step"] = torch.as_tensor(st["step"]).detach().to("cpu", torch.float64).clone()
    tag = layout.tag
    if opt.quantized_gather is not None:
        sd[f"{tag}/{MAX_ULPS}"] = opt.quantized_gather.max_ulps.detach().to("cpu").clone().view(1)
    sd[f"{tag}/rng/torch"] = torch.get_rng_state()
    if pctx.device.type == "cuda":
        sd[f"{tag}/rng/cuda"] = torch.cuda.get_rng_state(pctx.device)
    red = reducer.state_dict()
    if "generator" in red:
        sd[f"{tag}/rng/reducer"] = red["generator"]
    for name, res in residual_views(layout, red.get("residuals", {})).items():
        sd[f"{tag}/ef/{name}"] = res.detach().clone()
    if geo is not None:
        g = geo.state_dict()
        sd[f"{tag}/geo/hits"] = torch.tensor(
            [g["hits"][n] for n in sorted(g["hits"])], dtype=torch.float64, device="cpu"
        )
        for name, t in g["transforms"].items():
            sd[f"tp{pctx.tp_rank}/geo/{name}/U"] = t["U"].detach().cpu().clone()
            sd[f"tp{pctx.tp_rank}/geo/{name}/d"] = t["d"].detach().cpu().clone()
    return sd


def held_view(m: MainParam) -> torch.Tensor:
    """The parameters every replica holds of ``m``'s piece: a view ``[m.main.numel()]`` of the bucket's parameter
    buffer (the model's dtype)."""
    return m.bucket.param_data[m.buffer_start : m.buffer_start + m.main.numel()]


def residual_views(layout: StateLayout, residuals: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-parameter views (FP32 ``[numel]``) of the error-feedback residuals ``residuals`` (bucket key -> FP32
    ``[bucket numel]``, the reducer's ``state_dict()["residuals"]``); empty without error feedback."""
    out = {}
    for b in layout.optimizer.buckets:
        res = residuals.get(b.index)
        if res is None:
            continue
        for name, p, off in zip(b.names, b.params, b.plan.offsets):
            out[name] = res[off : off + p.numel()]
    return out


def _ensure_optimizer_state(layout: StateLayout) -> None:
    """Create zero optimizer state for every main param (torch creates it lazily at the first step)."""
    opt = layout.optimizer
    for m in opt.mains:
        o = opt.optimizer_of(m)
        st = o.state[m.main]
        for s in layout.state_names(m.name):
            if s not in st:
                st[s] = torch.zeros_like(m.main, memory_format=torch.preserve_format)
        if layout.state_names(m.name) == ADAMW_STATES and "step" not in st:
            g = o.param_groups[0]
            on_dev = bool(g.get("fused") or g.get("capturable"))
            st["step"] = torch.zeros((), dtype=torch.float32, device=m.main.device if on_dev else "cpu")


def load_state(
    path: str,
    layout: StateLayout,
    reducer: GradientReducer,
    geo: GeoState | None,
    same_layout: bool,
    geo_meta: dict | None,
    log,
    same_tp: bool | None = None,
) -> None:
    """Load a checkpoint written by :func:`build_save_state` into the live training state (collective over
    the world group).

    Model and optimizer state are resharded to this run's DP x TP layout; error feedback, RNG and the
    GeoFP8 profile are restored only when ``same_layout`` (else they start fresh, which is logged); the
    GeoFP8 transforms (identical on every DP rank) whenever the TP size is unchanged (``same_tp``).
    Finally the model parameters are set on every rank (a plain all-gather over DP): to the replicas' parameters
    the checkpoint holds (``held/<name>``, when it and this run gather the quantised difference), else to the main
    params rounded to the model's dtype (both cases are logged when only one side has them).

    Raises:
        CheckpointRankError: on every rank when a rank failed before or after DCP's read, e.g. with
            ``kind="value"`` when a parameter of this model is missing from the checkpoint or its optimizer
            state is of another kind, ``kind="io"`` when the metadata could not be read.
        torch.distributed.checkpoint.api.CheckpointException: DCP's read failed (on every rank alike).
    """
    import torch.distributed.checkpoint as dcp

    from .safe_reader import SafeFileSystemReader

    pctx = layout.pctx
    world, dev = pctx.world_group, pctx.device
    devices = rank_devices(pctx)
    target = _LoadTarget(layout, reducer, geo, geo_meta, same_layout, same_layout if same_tp is None else same_tp, log)
    req, err = None, None
    try:
        req = _load_request(path, target, devices)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before DCP's collectives
        err = e
    agree(err, world, dev, "preparing the checkpoint load")
    assert req is not None  # agree raised on every rank when _load_request failed on any
    sd = req["sd"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ShardedTensor deprecation, see _sharded_tensor
        dcp.load(sd, storage_reader=SafeFileSystemReader(path))

    err = None
    try:
        _apply_loaded(target, req)
    except Exception as e:  # noqa: BLE001 - the broadcasts and the parameter gather below are collectives
        err = e
    agree(err, world, dev, "restoring the loaded state")
    held = req["held"]
    with torch.no_grad():
        _broadcast_non_writers(layout, req["with_state"], list(held.values()))
    # the replicas' parameters: what the checkpoint says they held (quantised gather), else the main params rounded;
    # restored, not updated, so every launch continues from the same bits
    layout.optimizer.load_params(held or None)  # waited: the loaded parameters are complete on return


def _tensor_size(keys, key: str) -> torch.Size:
    """The size of the tensor entry ``key`` of a DCP checkpoint's ``state_dict_metadata`` ``keys``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = keys[key]
    assert isinstance(meta, TensorStorageMetadata), key  # these entries are saved as tensors
    return meta.size


@dataclass(frozen=True)
class _LoadTarget:
    """The live state a load fills and what it may restore (the arguments of :func:`load_state`, with ``same_tp``
    resolved)."""

    layout: StateLayout
    reducer: GradientReducer
    geo: GeoState | None
    geo_meta: dict | None
    same_layout: bool
    same_tp: bool
    log: Callable[[str], None]


def _load_request(path: str, target: _LoadTarget, devices: list[torch.device]) -> dict:
    """The state dict for DCP's read of ``path`` and where each loaded value goes (local: no collectives).

    Raises:
        ValueError: a parameter of this model is missing from the checkpoint, or its optimizer state is of
            another kind.
    """
    from .safe_reader import SafeFileSystemReader

    layout, reducer, geo, log = target.layout, target.reducer, target.geo, target.log
    pctx, opt = layout.pctx, layout.optimizer
    keys = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    names = [n for n, p in layout.params.items() if p.requires_grad]
    missing = [n for n in names if f"model/{n}" not in keys]
    if missing:
        raise ValueError(
            f"checkpoint {path} has no entry for parameter(s) {', '.join(missing[:5])}: it was saved "
            f"from a different model"
        )
    with_state = all(f"optim/{n}/{s}" in keys for n in names for s in layout.state_names(n))
    if with_state:
        _ensure_optimizer_state(layout)
    elif any(k.startswith("optim/") for k in keys):
        raise ValueError(
            f"checkpoint {path} holds optimizer state of another kind (e.g. AdamW vs Muon) than "
            f"optimizer.name selects; use the optimizer it was saved with"
        )
    else:
        log("checkpoint: no optimizer state saved (before the first update); the optimizer starts fresh")

    sd: dict = {}
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (loaded rectangle, destination view)
    world = pctx.world_group
    has_held = all(f"held/{n}" in keys for n in names)
    held: dict[int, torch.Tensor] = {}  # id(main param) -> FP32 replicas' parameters of its piece
    if opt.quantized_gather is not None and has_held:
        # from the live values: what no rectangle covers (vocabulary padding rows) keeps its value, as the main params
        held = {id(m.main): held_view(m).float().clone().view_as(m.main) for m in opt.mains}
    elif opt.quantized_gather is not None:
        log(
            "checkpoint: it holds no replica parameters (saved without a quantised comm.param_gather); they start "
            "from the main params rounded to train.param_dtype"
        )
    elif has_held and opt.sharded and pctx.dp_size > 1:
        log(
            "checkpoint: its replica parameters (saved with a quantised comm.param_gather) are not used: this run "
            "gathers the main params rounded to train.param_dtype"
        )
    for name in names:
        size, everyone = layout.global_shape(name), layout.global_rects(name)
        kinds: list[tuple[str, Callable[..., torch.Tensor]]] = [(f"model/{name}", lambda m: m.main.data)]
        if held:
            kinds.append((f"held/{name}", lambda m: held[id(m.main)]))
        if with_state:
            kinds += [
                (f"optim/{name}/{s}", lambda m, s=s: opt.optimizer_of(m).state[m.main][s])
                for s in layout.state_names(name)
            ]
        for key, tensor_of in kinds:
            shards = []
            for off, view in layout.shards(name, tensor_of):
                buf = torch.empty(view.shape, dtype=torch.float32, device=view.device)
                shards.append((off, buf))
                copies.append((buf, view))
            sd[key] = _sharded_tensor(shards, size, everyone, devices, pctx.rank, world)
        if with_state and f"optim/{name}/step" in keys and name in layout.by_name:
            sd[f"optim/{name}/step"] = torch.zeros((), dtype=torch.float64, device="cpu")
    tag = layout.tag
    if opt.quantized_gather is not None:  # every saved rank's (any layout): the load takes their maximum
        for k in keys:
            if k.endswith("/" + MAX_ULPS):
                sd[k] = torch.zeros(1, dtype=torch.float64, device="cpu")
    red = reducer.state_dict()
    ef = residual_views(layout, red.get("residuals", {}))
    live_geo = geo.state_dict() if geo is not None else None
    if target.same_layout:
        for k in ("rng/torch", "rng/cuda", "rng/reducer"):
            if (
                f"{tag}/{k}" in keys
                and (k != "rng/cuda" or pctx.device.type == "cuda")
                and (k != "rng/reducer" or "generator" in red)
            ):
                sd[f"{tag}/{k}"] = torch.empty(_tensor_size(keys, f"{tag}/{k}"), dtype=torch.uint8, device="cpu")
        for name in ef:
            if f"{tag}/ef/{name}" in keys:
                sd[f"{tag}/ef/{name}"] = torch.empty_like(ef[name])
        n_hits = len(live_geo["hits"]) if live_geo is not None else 0
        if (
            geo is not None
            and f"{tag}/geo/hits" in keys
            and len(_tensor_size(keys, f"{tag}/geo/hits")) == 1
            and _tensor_size(keys, f"{tag}/geo/hits")[0] == n_hits
        ):
            sd[f"{tag}/geo/hits"] = torch.zeros(n_hits, dtype=torch.float64, device="cpu")
    geo_tp = f"tp{pctx.tp_rank}/geo/"
    if geo is not None and target.geo_meta is not None and target.same_tp:
        assert live_geo is not None  # geo.state_dict() above
        for name in live_geo["transforms"]:
            if f"{geo_tp}{name}/U" in keys:
                for part in ("U", "d"):
                    part_key = f"{geo_tp}{name}/{part}"
                    sd[part_key] = torch.empty(_tensor_size(keys, part_key), dtype=torch.float32, device="cpu")
    return {
        "sd": sd,
        "copies": copies,
        "held": held,
        "with_state": with_state,
        "ef": ef,
        "tag": tag,
        "geo_tp": geo_tp,
        "residuals": red.get("residuals", {}),
        "live_geo": live_geo,
    }


def _apply_loaded(target: _LoadTarget, req: dict) -> None:
    """Copy what DCP read (``req``: :func:`_load_request`'s, filled) into the live state: main params, optimizer
    state, RNG, error feedback, GeoFP8 (local: no collectives)."""
    layout, log = target.layout, target.log
    pctx, opt = layout.pctx, layout.optimizer
    sd, ef, tag, with_state = req["sd"], req["ef"], req["tag"], req["with_state"]
    with torch.no_grad():
        for buf, view in req["copies"]:
            view.copy_(buf)
        for m in opt.mains:
            if with_state and f"optim/{m.name}/step" in sd:
                st = opt.optimizer_of(m).state[m.main]
                st["step"].fill_(float(sd[f"optim/{m.name}/step"]))
        ulps = [float(v) for k, v in sd.items() if k.endswith("/" + MAX_ULPS)]
        if ulps and opt.quantized_gather is not None:
            opt.quantized_gather.max_ulps.fill_(max(ulps))
        if f"{tag}/rng/torch" in sd:
            torch.set_rng_state(sd[f"{tag}/rng/torch"])
        if f"{tag}/rng/cuda" in sd:
            torch.cuda.set_rng_state(sd[f"{tag}/rng/cuda"], pctx.device)
        red: dict = {}
        if f"{tag}/rng/reducer" in sd:
            red["generator"] = sd[f"{tag}/rng/reducer"]
        # the residuals as they are (alignment padding kept), each parameter's range loaded or zeroed
        residuals = {k: r.clone() for k, r in req["residuals"].items()} if ef else {}
        views = residual_views(layout, residuals)
        restored_ef = {n for n in ef if f"{tag}/ef/{n}" in sd}
        for n, view in views.items():
            if n in restored_ef:
                view.copy_(sd[f"{tag}/ef/{n}"])
            else:
                view.zero_()
        if residuals:
            red["residuals"] = residuals
        target.reducer.load_state_dict(red)
        if ef and len(restored_ef) < len(ef):
            log(
                f"checkpoint: error-feedback residuals of {len(ef) - len(restored_ef)} parameter(s) start at zero "
                f"({'the DP x TP layout changed' if not target.same_layout else 'not in the checkpoint'})"
            )
    if target.geo is not None:
        _restore_geo(target.geo, req["live_geo"], target.geo_meta, sd, req["geo_tp"], f"{tag}/geo/hits", log)


def _broadcast_non_writers(layout: StateLayout, with_state: bool, held: list[torch.Tensor]) -> None:
    """Copy loaded values to the ranks that did not read them: TP-replicated parameters from TP rank 0,
    and (without the distributed optimizer) everything from DP rank 0. ``held``: the loaded replica parameters of
    this rank's main params, in the order of ``layout.optimizer.mains`` (or empty)."""
    pctx, opt = layout.pctx, layout.optimizer
    held_of = {id(m.main): h for m, h in zip(opt.mains, held)}

    def tensors(m):
        yield m.main.data
        if id(m.main) in held_of:
            yield held_of[id(m.main)]
        if with_state:
            st = opt.optimizer_of(m).state[m.main]
            for s in layout.state_names(m.name):
                yield st[s]

    if pctx.tp_size > 1:
        for m in opt.mains:
            if layout.partition_dim(m.param) is None:
                for t in tensors(m):
                    C.broadcast(t, pctx.tp_group, 0)
    if not opt.sharded and pctx.dp_size > 1:
        for m in opt.mains:
            for t in tensors(m):
                C.broadcast(t, pctx.dp_group, 0)


def _restore_geo(geo, live: dict, geo_meta: dict | None, sd: dict, geo_tp: str, hits_key: str, log) -> None:
    """GeoFP8 selection, profile, refresh step and transforms from the checkpoint, through ``geo.load_state_dict``
    (``live``: ``geo.state_dict()`` before the load, for the candidate names)."""
    if geo_meta is None:
        log("checkpoint: it was saved without comm.transform=geo; GeoFP8 starts fresh")
        return
    state: dict = {"profiled": int(geo_meta["profiled"])}
    if hits_key in sd:
        state["hits"] = dict(zip(sorted(live["hits"]), sd[hits_key].tolist()))
    state["selected"] = list(geo_meta["selected"])
    loaded = [n for n in live["transforms"] if f"{geo_tp}{n}/U" in sd]
    state["transforms"] = {n: {"U": sd[f"{geo_tp}{n}/U"], "d": sd[f"{geo_tp}{n}/d"]} for n in loaded}
    if loaded:
        state["last_refresh"] = int(geo_meta["last_refresh"])
    geo.load_state_dict(state)
    if not loaded and geo_meta["last_refresh"] >= 0:
        log(
            "checkpoint: the TP size changed, so the GeoFP8 transforms restart from the identity until the next "
            "scheduled refresh"
        )
