"""Start-up checks of the ``comm`` section: its cross-key rules and its keys that the other comm settings give no
effect. The wire format's own rules are :meth:`.formats.WireFormat.check`; ``comm.param_gather`` is checked by
:func:`.param_codec.check_param_gather`; both are run from here."""

from __future__ import annotations

import torch

from ..config.checks import InertRule
from ..config.errors import ConfigError
from ..config.schema import CommConfig
from .formats import FORMATS, WireFormat, get_format
from .param_codec import check_param_gather
from .roundtrip import is_pow2


def wire_format(comm) -> WireFormat:
    """The registered wire format of ``comm.dtype`` (:func:`.formats.get_format`).

    Raises:
        ConfigError: an unknown ``comm.dtype``; the message lists the registered formats.
    """
    try:
        return get_format(comm.dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def fp8_dtypes() -> tuple[str, ...]:
    """The registered ``comm.dtype`` values that are FP8 formats (those with a ``fp8_max``)."""
    return tuple(f.name for f in FORMATS.values() if f.fp8_max is not None)


def check_comm_config(c: CommConfig, param_dtype: torch.dtype) -> None:
    """Check the ``comm`` keys against each other, with ``param_dtype`` the model's parsed parameter dtype.

    Checked: ``comm.dtype`` is registered; ``comm.block_size`` and ``comm.hadamard_block`` are positive powers of
    two; the wire format's rules (:meth:`.formats.WireFormat.check`: error feedback, rounding, scaling, scale sync
    and ``wire_sum`` it cannot honour); ``comm.param_gather`` (:func:`.param_codec.check_param_gather`);
    ``comm.wire_sum_prediv=false`` only with ``comm.reduce_op=wire_sum``; ``comm.telemetry_interval >= 0``.

    Raises:
        ConfigError: naming the key, the bad value and the fix.
    """
    fmt = wire_format(c)
    for name, v in (("comm.block_size", c.block_size), ("comm.hadamard_block", c.hadamard_block)):
        if not is_pow2(v):
            raise ConfigError(f"{name}={v} must be a positive power of two (e.g. 128)")
    fmt.check(c)
    check_param_gather(c, param_dtype)
    if c.reduce_op != "wire_sum" and not c.wire_sum_prediv:
        raise ConfigError(
            "comm.wire_sum_prediv=false only changes comm.reduce_op=wire_sum; set comm.reduce_op="
            "wire_sum as well, or drop comm.wire_sum_prediv"
        )
    if c.telemetry_interval < 0:
        raise ConfigError(f"comm.telemetry_interval={c.telemetry_interval} must be >= 0 (0 disables it)")


def comm_inert_keys(c: CommConfig) -> list[InertRule]:
    """The ``comm`` keys that the other comm settings of ``c`` give no effect: ``comm.scaling`` on an unscaled
    format, ``comm.block_size`` without block scaling, ``comm.hadamard_block`` without the Hadamard transform.

    Raises:
        ConfigError: an unknown ``comm.dtype``.
    """
    fmt = wire_format(c)
    rules: list[InertRule] = []
    if not fmt.scaled:
        rules.append((("comm.scaling",), f"comm.dtype={c.dtype} (sent unscaled)", "use an fp8 comm.dtype"))
    if not (c.scaling == "block" and fmt.block_scaling):
        rules.append(
            (
                ("comm.block_size",),
                f"comm.scaling={c.scaling} and comm.dtype={c.dtype}",
                "set comm.scaling=block with an fp8 comm.dtype",
            )
        )
    if c.transform != "hadamard":
        rules.append((("comm.hadamard_block",), f"comm.transform={c.transform}", "set comm.transform=hadamard"))
    return rules
