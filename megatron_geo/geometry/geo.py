"""GeoFP8 state: which parameters are transformed, their current transforms, refreshes, checksums.

Lifecycle per refresh step (``step % geo.refresh_interval == 0``):
``arm()`` before the first micro-batch's forward -> ``disarm()`` after it -> after backward,
``refresh(step)``: sum each layer's input statistics over DP onto the layer's owner (round robin over
the DP group), which eigendecomposes them, builds T and broadcasts it; with ``geo.power_search``, pick
each layer's exponent from the DP-summed round-trip errors (:mod:`.power_search`), or with ``geo.power=auto``
from the slope of the DP-summed gradient energy against A's eigenvalues (:mod:`.refresh_stats`, no trial
quantisation); with ``geo.select=gain`` keep only the ``num_layers`` candidates with the largest positive
predicted gain (the others stay Euclidean); compare a checksum of every T across the DP group (a mismatch is
a hard error naming the layer); notify the refresh listeners (:meth:`GeoState.add_refresh_listener`; the reducer's
:class:`~.coordinates.GeoTransform` re-bases its error feedback, R <- R T_old^-1 T_new, or zeroes it with
``geo.ef_on_refresh=reset``). Every refresh also records per-layer diagnostics (:attr:`GeoState.diagnostics`:
slope, power, IPR of A's outlier eigenvectors, cancellation across ranks, predicted gain, bound hits of the
wire), read from the device once per refresh.
The reducer then communicates G T and maps the reduced shard back with T^-1.

Precision: the statistics, their DP sum, the eigen/sketch decompositions and every moment of a refresh are
FP32 (FP64 where noted) whatever autocast or TF32 setting the caller has active: the hooks, :meth:`GeoState.refresh`
and every application of T / T^-1 run under :func:`~megatron_geo.parallel.precision.exact_fp32`.
Compiled blocks (``train.compile=true``): :meth:`GeoState.arm` runs the blocks that enclose the armed layers
eagerly until :meth:`GeoState.disarm` (the ``run_eagerly`` context given to the constructor,
:class:`~megatron_geo.model.compile.eager_calls` in training), so the statistics hooks fire at every refresh and
the compiled graphs are never rebuilt.

What this package needs from the reducer's side (the codec round trip that ``geo.power_search`` scores, the FP8
limits of the wire) arrives through the :class:`GeoState` constructor; ``megatron_geo.training.geo_setup`` wires
both sides together.
"""

from __future__ import annotations

import contextlib
import fnmatch
import zlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager as ContextManager

import torch
import torch.distributed as dist
from torch import nn

from ..config.schema import GeoConfig, parse_power, parse_power_search
from ..parallel import collectives as C
from ..parallel.precision import exact_fp32
from . import refresh_stats as RS
from .power_search import pick_powers, roundtrip_errors, with_power
from .stats import InputStats
from .transform import LowRankTransform, build_transform, build_transform_from_sketch, identity_transform, sketch_matrix


class TransformMismatchError(RuntimeError):
    """The GeoFP8 transform of a layer differs between DP ranks."""


def _is_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes ``Y = X W^T`` with its ``weight`` (see :func:`select_parameters`)."""
    return isinstance(module, nn.Linear) or bool(getattr(module, "is_linear", False))


def select_parameters(model: nn.Module, patterns: str) -> dict[str, nn.Module]:
    """Linear weights matching any comma-separated glob of ``patterns`` -> their modules.

    A linear weight is the ``weight`` of a module that computes ``Y = X W^T`` (``nn.Linear``, or a module whose class
    sets ``is_linear = True``: the tensor-parallel linear layers): the input-side transform needs the layer's input
    ``X``. An embedding table (its input is token ids) never is one, whatever the pattern.

    Raises:
        ValueError: a pattern matches no linear weight (names the pattern, any non-linear 2-D weight it matched, and
            lists a few valid names).
    """
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    mods = dict(model.named_modules())
    chosen: dict[str, nn.Module] = {}
    matrices = [n for n, p in model.named_parameters() if p.ndim == 2 and n.endswith(".weight")]
    weights = [n for n in matrices if _is_linear(mods[n[: -len(".weight")]])]
    for pat in pats:
        hits = [n for n in weights if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            other = [n for n in matrices if fnmatch.fnmatchcase(n, pat)]
            why = f" ({', '.join(other[:3])} is not a linear layer's weight)" if other else ""
            raise ValueError(f"geo.layers pattern {pat!r} matches no linear weight{why}; e.g. {', '.join(weights[:4])}")
        for n in hits:
            chosen[n] = mods[n[: -len(".weight")]]
    return chosen


def _no_bypass(modules: Iterable[nn.Module]) -> ContextManager:
    return contextlib.nullcontext()


def _powers_line(powers: dict[str, float], per_layer_up_to: int = 16) -> str:
    """``name=p, ...`` for a few layers; above ``per_layer_up_to`` one entry per layer kind (the name without its
    ``layers.<i>.`` prefix): ``kind: median p [min, max], n Euclidean`` (every layer's power is in the metrics,
    ``geo/<layer>/power``)."""
    if len(powers) <= per_layer_up_to:
        return ", ".join(f"{n.removesuffix('.weight')}={p:.3g}" for n, p in powers.items())
    kinds: dict[str, list[float]] = {}
    for n, p in powers.items():
        parts = n.removesuffix(".weight").split(".")
        kind = (
            ".".join(parts[2:]) if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() else ".".join(parts)
        )
        kinds.setdefault(kind, []).append(p)
    out = []
    for kind, ps in sorted(kinds.items()):
        ps.sort()
        zero = sum(1 for p in ps if p == 0)
        out.append(f"{kind} x{len(ps)}: median {ps[len(ps) // 2]:.3g} [{ps[0]:.3g}, {ps[-1]:.3g}], {zero} Euclidean")
    return "; ".join(out)


class GeoState:
    """Transforms of the selected parameters, keyed by parameter name.

    Args:
        geo: the ``geo`` config section (:class:`~megatron_geo.config.schema.GeoConfig`), whole: ``layers``,
            ``select`` / ``num_layers`` / ``profile_steps``, ``rank``, ``damping``, ``power`` and ``power_search``
            (parsed here), ``refresh_interval`` (kept as :attr:`interval`), ``ef_on_refresh``, ``statistics`` and
            ``sketch_size``.
        model: the ``nn.Module`` whose linear weights ``geo.layers`` selects.
        dp_group: the data-parallel process group the statistics are summed over (None: the default group).
        fp8_limits: ``(fp8_max, underflow_below)`` floats: the wire format's largest magnitude and half its
            smallest subnormal (E4M3: 448 and 2**-10), for the bound-hit counts.
        log: ``str -> None`` for the refresh and selection lines.
        roundtrip: ``x -> decode(encode(x))`` of one tensor through the reducer's codec (FP32 out, same shape),
            needed by ``geo.power_search``; None without one.
        run_eagerly: ``modules -> context manager`` that runs modules compiled in place eagerly
            (:class:`megatron_geo.model.compile.eager_calls`) while the statistics are armed; by default nothing
            is bypassed (a compiled block would then not run the statistics hooks).

    Raises:
        ValueError: a ``geo.layers`` pattern matches no linear weight.
        ConfigError: a ``geo.power`` or ``geo.power_search`` that does not parse.
    """

    def __init__(
        self,
        geo: GeoConfig,
        model: nn.Module,
        dp_group,
        fp8_limits: tuple[float, float] = (448.0, 2.0**-10),
        log: Callable[[str], object] = print,
        roundtrip: Callable[[torch.Tensor], torch.Tensor] | None = None,
        run_eagerly: Callable[[Iterable[nn.Module]], ContextManager] = _no_bypass,
    ):
        power, power_search = parse_power(geo.power), parse_power_search(geo.power_search)
        auto = geo.select in ("auto", "gain")
        auto_layers, profile_steps = (geo.num_layers, geo.profile_steps) if auto else (0, 0)
        select_gain = geo.select == "gain"
        fp8_max, underflow_below = fp8_limits
        self.candidates = select_parameters(model, geo.layers)
        # every module on the path from the model to each candidate (the model and the candidate included):
        # the ones compiled in place run eagerly while the statistics are armed
        self._enclosing = {
            n: [model.get_submodule(".".join(n.split(".")[:i])) for i in range(n.count(".") + 1)]
            for n in self.candidates
        }
        self._run_eagerly = run_eagerly
        self._eager: ContextManager | None = None
        params = dict(model.named_parameters())
        self.params = {n: params[n] for n in self.candidates}  # rows of every candidate stay whole on their owner
        self.auto_layers, self.profile_steps, self.fp8_max, self.log = auto_layers, profile_steps, fp8_max, log
        self.underflow_below = underflow_below  # half the format's smallest subnormal: rounds to zero
        self.hits = {n: 0.0 for n in self.candidates}  # summed bound-hit fractions while profiling
        self._hits_dev: dict[str, list[torch.Tensor]] = {}  # ... per step, not yet folded in (device)
        self.profiled = 0
        # geo.select=gain: statistics of every candidate at each refresh, the transform for the best auto_layers
        self.select_gain = select_gain
        self.selected = dict(self.candidates) if not auto_layers or select_gain else {}
        self.rank, self.damping, self.interval, self.ef_on_refresh = (
            geo.rank,
            geo.damping,
            geo.refresh_interval,
            geo.ef_on_refresh,
        )
        self.dp_group = dp_group
        self.statistics, self.sketch_size, self.power = geo.statistics, geo.sketch_size, power
        self.power_search = tuple(power_search)  # non-empty: p chosen per layer at each refresh
        self.powers: dict[str, float] = {}  # power_search / auto: the p chosen per layer at the last refresh
        self.diagnostics: dict[str, dict[str, float]] = {}  # per layer, from the last refresh (host floats)
        self.roundtrip = roundtrip  # the codec's quantize-dequantize (power_search)
        self.grad_of = lambda name: self.params[name].main_grad  # the local gradient at a refresh
        self.stats = self._make_stats()
        self.transforms: dict[str, LowRankTransform] = {
            n: identity_transform(p.shape[1], p.device) for n, p in self.params.items()
        }
        self.last_refresh = -1
        self._listeners: list[Callable[[dict, dict], None]] = []  # see add_refresh_listener

    def add_refresh_listener(self, fn: Callable[[dict, dict], None]) -> None:
        """Call ``fn(old, new)`` after every refresh, with the transforms before and after (dicts parameter name ->
        :class:`~.transform.LowRankTransform`), on every DP rank (the reducer's error-feedback re-base)."""
        self._listeners.append(fn)

    def _use_sketch(self, d_in: int) -> bool:
        if self.statistics == "auto":
            return d_in > 4 * self.sketch_size  # docs/geofp8_fidelity.md: same fidelity, a fraction of the cost
        return self.statistics == "sketch"

    def _make_stats(self) -> InputStats:
        """Statistics collectors for the selected layers: a full factor or a sketch, per geo.statistics."""
        sketches = {}
        for n in self.selected:
            d_in = self.params[n].shape[1]
            if self._use_sketch(d_in):
                seed = zlib.crc32(n.encode())
                sketches[n] = sketch_matrix(d_in, min(self.sketch_size, d_in), seed, self.params[n].device)
        return InputStats(dict(self.selected), sketches)

    @property
    def active(self) -> set[str]:
        """The selected layers whose current transform is not the identity (none before the first refresh; the
        layers ``geo.power=auto``'s gain floor or ``geo.select=gain`` keep Euclidean are not active)."""
        return {n for n in self.selected if self.transforms[n].U.shape[1] > 0}

    @property
    def profiling(self) -> bool:
        return bool(self.auto_layers) and not self.selected and not self.select_gain

    def is_refresh_step(self, step: int) -> bool:
        """Refresh every ``refresh_interval`` steps (counted from the end of profiling with select=auto)."""
        if self.profiling:
            if step < self.profile_steps:
                return False
            self._choose()
        start = self.profile_steps if self.auto_layers and not self.select_gain else 0
        return step >= start and (step - start) % self.interval == 0

    def record_bound_hits(self, name: str, grad: torch.Tensor) -> None:
        """Accumulate the FP8 bound-hit fraction of a candidate's local gradient (tensor scaling):
        elements at the format max after scaling plus non-zero elements that round to zero."""
        g = grad.float()
        amax = g.abs().max()
        ok = torch.isfinite(amax) & (amax > 0)  # an all-zero or non-finite gradient counts no hits
        y = g / torch.where(ok, amax / self.fp8_max, torch.ones_like(amax))
        hits = (y.abs() >= self.fp8_max).sum() + ((y.abs() <= self.underflow_below) & (g != 0)).sum()
        frac = torch.where(ok, hits.double() / g.numel(), torch.zeros((), dtype=torch.float64, device=g.device))
        # kept on the device (no host sync inside the backward hooks); folded into hits at _choose
        self._hits_dev.setdefault(name, []).append(frac)

    def _fold_hits(self) -> None:
        """Add the device-side bound-hit fractions to ``hits`` one by one, in step order (the same float sums
        wherever a checkpoint falls); one host sync, at the selection and at checkpoints."""
        for name, fracs in self._hits_dev.items():
            for t in fracs:
                self.hits[name] += float(t)
        self._hits_dev.clear()

    def end_profiled_step(self) -> None:
        if self.profiling:
            self.profiled += 1

    def _choose(self) -> None:
        """All-reduce the profile over DP (every rank picks the same set) and keep the top layers."""
        self._fold_hits()
        names = sorted(self.hits)
        dev = self.params[names[0]].device if names else torch.device("cpu")
        rates = torch.tensor([self.hits[n] / max(self.profiled, 1) for n in names], dtype=torch.float64, device=dev)
        C.all_reduce(rates, self.dp_group)
        order = sorted(range(len(names)), key=lambda i: (-rates[i].item(), names[i]))
        top = [names[i] for i in order[: self.auto_layers]]
        self.selected = {n: self.candidates[n] for n in top}
        self.stats = self._make_stats()
        per_rank = ", ".join(
            f"{n} ({rates[names.index(n)].item() / dist.get_world_size(self.dp_group):.2e})" for n in top
        )
        self.log(f"geo.select=auto: after {self.profiled} profiled steps the transform goes to {per_rank}")

    def arm(self) -> None:
        """Collect input statistics of the selected layers in the following forward(s) until :meth:`disarm`.

        Modules compiled in place that enclose a selected layer (``train.compile=true``: its block) run eagerly
        meanwhile: a compiled graph would not run the statistics hooks (they are not part of it)."""
        self.disarm()
        self._eager = self._run_eagerly(m for n in self.stats.modules for m in self._enclosing.get(n, ()))
        self._eager.__enter__()
        self.stats.arm()

    def disarm(self) -> None:
        """Stop collecting (the statistics are kept for :meth:`refresh`); compiled blocks run compiled again."""
        self.stats.disarm()
        if self._eager is not None:
            eager, self._eager = self._eager, None
            eager.__exit__(None, None, None)

    def owners(self) -> dict[str, int]:
        """Which DP rank (index in the DP group) decomposes each selected layer's factor: round robin
        over the sorted names, so a refresh costs each rank about ``layers / dp_size`` decompositions."""
        world = dist.get_world_size(self.dp_group)
        return {n: i % world for i, n in enumerate(sorted(self.selected))}

    def refresh(self, step: int) -> None:
        """Build new transforms from the armed statistics (all DP ranks together).

        Each layer's statistics are summed onto its owner (:meth:`owners`), which eigendecomposes them
        and broadcasts ``U`` and ``d`` to the DP group: every rank then holds the owner's exact bytes,
        and the work per rank shrinks with the DP size. Runs in FP32 / FP64 under any autocast or TF32
        setting of the caller (:func:`~megatron_geo.parallel.precision.exact_fp32`); the transforms are float32.
        """
        with exact_fp32():
            self._refresh(step)

    def _refresh(self, step: int) -> None:
        owners = self.owners()
        factors = self.stats.reduce(self.dp_group, owners)
        new = dict(self.transforms)
        # searched or auto: D ** p derived from D at power 1
        power = 1.0 if self.power_search or self.power == "auto" else self.power
        built = {}
        for pname in sorted(self.selected):  # every owner decomposes its layers (in parallel across ranks) ...
            A = factors[pname]
            if isinstance(A, tuple):  # sketch: (Y = A Omega, trace A)
                Y, trace = A
                damping = self.damping * max(trace / Y.shape[0], 1e-30)
                built[pname] = build_transform_from_sketch(
                    Y, self.stats.sketches[pname], trace, self.rank, damping, power
                )
            elif A is not None:
                damping = self.damping * max(float(A.diagonal().mean()), 1e-30)
                built[pname] = build_transform(A, self.rank, damping, power)
        for pname in sorted(self.selected):  # ... then the results are broadcast
            new[pname] = self._broadcast_transform(pname, built.get(pname), owners[pname])
        moments, d1, ipr = self._summed_moments(new, power)
        if self.power == "auto" and not self.power_search:
            self._auto_powers(new, moments, d1, step)
        if self.power_search:
            self._search_powers(new, step)
        self._record_diagnostics(new, moments, d1, ipr, step)
        self.check_consistent(new)
        old, self.transforms = self.transforms, new
        for fn in self._listeners:
            fn(old, new)
        self.last_refresh = step

    def _broadcast_transform(self, name: str, t: LowRankTransform | None, owner: int) -> LowRankTransform:
        """``t`` (built on ``owner``; None elsewhere) on every DP rank: one broadcast of ``[U.flatten(), d]``."""
        if dist.get_world_size(self.dp_group) == 1:
            return t
        p = self.params[name]
        d_in = p.shape[1]
        k = self.stats.sketches[name].shape[1] if name in self.stats.sketches else d_in
        r = min(self.rank, k, d_in)
        if t is not None:
            buf = torch.cat([t.U.reshape(-1), t.d])
        else:  # overwritten by the broadcast; an identity transform (U = 0, d = 1) where none arrives (fake backend)
            buf = torch.zeros(d_in * r + r, dtype=torch.float32, device=p.device)
            buf[d_in * r :] = 1.0
        C.broadcast(buf, self.dp_group, owner)
        if t is not None:
            return t
        return LowRankTransform(buf[: d_in * r].view(d_in, r).clone(), buf[d_in * r :].clone())

    def _summed_moments(self, transforms: dict[str, LowRankTransform], power: float) -> tuple[dict, dict, dict]:
        """Per layer, on the host: ``(e [r], E, sum_r G_r U [d_out, r], ranks)`` summed over DP
        (:mod:`.refresh_stats`) from the local gradients and the refresh's U (one all-reduce on the group's
        device), ``d1`` (D at power 1, from the built D at ``power``) and the IPR of A's outlier eigenvectors;
        two device-to-host copies in all (once per refresh)."""
        names = sorted(self.selected)
        if not names:
            return {}, {}, {}
        parts = [RS.layer_moments(self.grad_of(n), transforms[n].U) for n in names]
        dev = transforms[names[0]].U.device
        buf = torch.cat(parts).to(dev)
        C.all_reduce(buf, self.dp_group)
        d1_dev = [
            transforms[n].d.double() if power == 1.0 else transforms[n].d.double() ** (1.0 / power) for n in names
        ]
        local = torch.cat(d1_dev + [RS.eigvec_ipr(transforms[n].U, d).view(1) for n, d in zip(names, d1_dev)])
        host, local = buf.cpu(), local.cpu()
        world = dist.get_world_size(self.dp_group)
        moments, d1, off, off_d = {}, {}, 0, 0
        for n, p in zip(names, parts):
            r = transforms[n].U.shape[1]
            seg = host[off : off + p.numel()]
            off += p.numel()
            moments[n] = (seg[:r], seg[r], seg[r + 1 :].view(-1, r), world)
            d1[n] = local[off_d : off_d + r]
            off_d += r
        ipr = dict(zip(names, local[off_d:].tolist()))
        return moments, d1, ipr

    def _auto_powers(self, transforms: dict, moments: dict, d1: dict, step: int) -> None:
        """``geo.power=auto``: p = clip(s / 4, 0, 1/2) per layer from the DP-summed energies (p = 0: identity)."""
        for n, (e, total, _, _) in moments.items():
            s = RS.energy_slope(e, total, d1[n], self.params[n].shape[1])
            p = float(RS.auto_power(s))
            transforms[n] = (
                with_power(transforms[n], p)
                if p > 0
                else identity_transform(self.params[n].shape[1], transforms[n].U.device)
            )
            self.powers[n] = p
        chosen = {n: p for n, p in sorted(self.powers.items()) if n in moments}
        self.log(f"step {step + 1}: geo.power=auto " + _powers_line(chosen))

    def _record_diagnostics(self, transforms: dict, moments: dict, d1: dict, ipr: dict, step: int) -> None:
        """:attr:`diagnostics` of every layer (module docstring) from a second small all-reduce (bound hits and
        column energies of the wire under the chosen transform, and bound hits of the Euclidean gradient) and one
        device-to-host copy; with ``geo.select=gain`` the layers outside the ``auto_layers`` best positive
        predicted gains get the identity (they stay Euclidean)."""
        names = sorted(moments)
        if not names:
            self.diagnostics = {}
            return
        parts = []
        for n in names:
            g = self.grad_of(n).float()
            wire = transforms[n].apply(g)
            parts.append(
                torch.cat(
                    [
                        RS.wire_bound_hits(wire, self.fp8_max, self.underflow_below),
                        RS.wire_bound_hits(g, self.fp8_max, self.underflow_below),
                        wire.double().pow(2).sum(0),
                    ]
                )
            )
        buf = torch.cat(parts).to(transforms[names[0]].U.device)
        C.all_reduce(buf, self.dp_group)
        rows, off = [], 0
        for n, part in zip(names, parts):  # per layer: 8 bound-hit counts and sum_k c_k q_k (relative model)
            h = buf[off : off + part.numel()]
            off += part.numel()
            t = transforms[n]  # sum_k c_k q_k: the relative-precision model's error energy
            rows.append(torch.cat([h[:8], (h[8:] * RS.inverse_row_norms2(t.U, t.d)).sum().view(1)]))
        host = torch.stack(rows).cpu().tolist()
        diag, kept_euclidean = {}, []
        auto = self.power == "auto" and not self.power_search
        for n, c in zip(names, host):
            e, total, gu, world = moments[n]
            p = self.powers[n] if self.power_search or self.power == "auto" else self.power
            tot = float(total)
            gain = 1.0 - (c[8] / tot) ** 0.5 if tot > 0 and transforms[n].U.shape[1] else 0.0
            if auto and p > 0 and gain < RS.MIN_AUTO_GAIN:  # predicted to gain nothing: stay Euclidean
                transforms[n] = identity_transform(self.params[n].shape[1], transforms[n].U.device)
                self.powers[n] = p = 0.0
                kept_euclidean.append(n)
            diag[n] = {
                "slope": float(RS.energy_slope(e, total, d1[n], self.params[n].shape[1])),
                "power": float(p),
                "ipr": ipr[n],
                "cancel": float(RS.cancellation(e, gu, world)),
                "pred_gain": gain,
                "sat": c[0] / max(c[3], 1),
                "flush": c[1] / max(c[2], 1),
                "sat_euclid": c[4] / max(c[7], 1),
                "flush_euclid": c[5] / max(c[6], 1),
            }
        if kept_euclidean:
            names = [n.removesuffix(".weight") for n in kept_euclidean]
            shown = ", ".join(names[:16]) + (
                f" and {len(names) - 16} more (geo/<layer>/power = 0)" if len(names) > 16 else ""
            )
            self.log(
                f"step {step + 1}: geo.power=auto keeps {len(names)} layer(s) Euclidean (predicted gain < "
                f"{RS.MIN_AUTO_GAIN:g}): {shown}"
            )
        if self.select_gain and self.auto_layers:
            # among the layers geo.power=auto did not already keep Euclidean
            ranked = sorted((n for n in diag if n not in kept_euclidean), key=lambda n: (-diag[n]["pred_gain"], n))
            keep = {n for n in ranked[: self.auto_layers] if diag[n]["pred_gain"] > 0}
            for n in diag:
                if n not in keep:
                    transforms[n] = identity_transform(self.params[n].shape[1], transforms[n].U.device)
                diag[n]["active"] = float(n in keep)
            self.log(
                f"step {step + 1}: geo.select=gain keeps "
                + (
                    ", ".join(f"{n.removesuffix('.weight')} ({diag[n]['pred_gain']:+.2f})" for n in ranked if n in keep)
                    or "none"
                )
            )
        self.diagnostics = diag

    def _search_powers(self, transforms: dict[str, LowRankTransform], step: int) -> None:
        """Replace each selected layer's power-1 transform by the candidate power with the smallest
        DP-summed round-trip error of the current local gradients (:mod:`.power_search`)."""
        if self.roundtrip is None:
            raise RuntimeError(
                "geo.power_search needs the codec round trip (GeoState(roundtrip=...), given by "
                "megatron_geo.training.geo_setup.build_geo)"
            )
        names = sorted(self.selected)
        errs = torch.stack(
            [roundtrip_errors(self.grad_of(n), transforms[n], list(self.power_search), self.roundtrip) for n in names]
        )
        dev = transforms[names[0]].U.device if names else torch.device("cpu")
        errs = errs.to(dev)
        C.all_reduce(errs, self.dp_group)
        chosen = pick_powers(errs.cpu(), list(self.power_search))
        for n, p in zip(names, chosen):
            transforms[n] = with_power(transforms[n], p)
            self.powers[n] = p
        counts = {p: chosen.count(p) for p in self.power_search if chosen.count(p)}
        self.log(
            f"step {step + 1}: geo.power_search "
            + ", ".join(f"p={p:g} x{c}" for p, c in counts.items())
            + (
                " (" + ", ".join(f"{n.removesuffix('.weight')}={p:g}" for n, p in zip(names, chosen)) + ")"
                if len(names) <= 16
                else ""
            )
        )

    def check_consistent(self, transforms: dict[str, LowRankTransform]) -> None:
        """Compare a 63-bit digest of every transform across the DP group; raise on any difference."""
        if dist.get_world_size(self.dp_group) == 1:
            return
        names = sorted(transforms)
        dev = transforms[names[0]].U.device if names else torch.device("cpu")
        digest = torch.tensor([int(transforms[n].checksum()[:15], 16) for n in names], dtype=torch.int64, device=dev)
        lo, hi = digest.clone(), digest.clone()
        C.all_reduce(lo, self.dp_group, op=dist.ReduceOp.MIN)
        C.all_reduce(hi, self.dp_group, op=dist.ReduceOp.MAX)
        bad = [n for n, a, b in zip(names, lo.tolist(), hi.tolist()) if a != b]
        if bad:
            raise TransformMismatchError(
                f"GeoFP8 transform differs across DP ranks for layer(s) {', '.join(bad)}: the input statistics "
                f"or the eigendecomposition were not identical on every rank (checksum mismatch)"
            )

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this state keeps between steps, for memory accounting: each candidate's ``U`` and ``d``, then
        the statistics' running sums and sketch matrices (FP32, on the parameters' device)."""
        out = [x for t in self.transforms.values() for x in (t.U, t.d)]
        return out + list(self.stats.sums.values()) + list(self.stats.sketches.values())

    def state_dict(self) -> dict:
        """The GeoFP8 training state (one host sync: the device-side bound-hit fractions are folded in first):

        - ``last_refresh`` (int, -1 before the first refresh), ``selected`` (sorted names), ``profiled`` (int);
        - ``hits``: ``{candidate name: float}``, the summed bound-hit fractions of the ``select=auto`` profile (this
          DP rank's own);
        - ``transforms``: ``{candidate name: {"U": FP32 [d_in, r], "d": FP32 [r]}}`` (identical on every DP rank),
          references to the live tensors.
        """
        self._fold_hits()
        return {
            "last_refresh": self.last_refresh,
            "selected": sorted(self.selected),
            "hits": dict(self.hits),
            "profiled": self.profiled,
            "transforms": {n: {"U": t.U, "d": t.d} for n, t in self.transforms.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore what :meth:`state_dict` returned; every key is optional (absent ones keep their value), and so
        is every candidate inside ``hits`` and ``transforms`` (tensors are copied to the parameter's device).

        ``selected``: names that are not candidates here are dropped; with ``select=auto|gain`` or a different set
        the statistics collectors are rebuilt for the restored selection.

        Raises:
            KeyError: ``hits`` or ``transforms`` names a parameter that is not a candidate.
        """
        if "profiled" in sd:
            self.profiled = int(sd["profiled"])
        for n, v in sd.get("hits", {}).items():
            if n not in self.hits:
                raise KeyError(f"GeoFP8 bound-hit profile of {n!r}, which is not a geo.layers candidate")
            self.hits[n] = float(v)
        if "selected" in sd:
            selected = [n for n in sd["selected"] if n in self.candidates]
            if self.auto_layers or set(selected) != set(self.selected):
                self.selected = {n: self.candidates[n] for n in selected}
                self.stats = self._make_stats()
        for n, t in sd.get("transforms", {}).items():
            if n not in self.transforms:
                raise KeyError(f"GeoFP8 transform of {n!r}, which is not a geo.layers candidate")
            dev = self.params[n].device
            self.transforms[n] = LowRankTransform(t["U"].to(dev), t["d"].to(dev))
        if "last_refresh" in sd:
            self.last_refresh = int(sd["last_refresh"])
