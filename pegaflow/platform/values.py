"""Config values as people write them: sizes with units, on/off flags, numbers, and the version.

Sizes: a number and its unit, in any case.  Binary units say so (KiB, MiB, GiB,
TiB, and the short K, M, G, T as in ``docker --shm-size``); decimal ones say so too
(kB, MB, GB, TB: powers of 1000), and B is bytes.  A number without a unit is refused
(but 0): ``--pool-size 512`` means 512 of something, and 512 bytes is never what was meant.
"""

from __future__ import annotations

import functools
import math
import re
from importlib import metadata
from typing import Any

from pegaflow.platform.errors import ConfigError

DISTRIBUTION = "vllm-kv-offload-engine"  # the name pip knows this project by (pyproject.toml)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296, '4GB' -> 4000000000, '10B' -> 10, '0' -> 0; '512' is refused
    (no unit), so is '-5GiB' (negative)."""
    match = re.fullmatch(r"\s*(-?)(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(3).lower() not in _UNITS:
        raise ConfigError(f"size {text!r}: expected a number with a unit like 512MiB, 4GiB or 4GB")
    sign, number, unit = match.groups()
    if sign and float(number):
        raise ConfigError(f"size {text!r} is negative")
    if not unit and float(number):
        raise ConfigError(f"size {text!r} has no unit: write {number}MiB or {number}GiB (or "
                          f"{number}B if bytes are meant)")
    return int(float(number) * _UNITS[unit.lower()])


def format_size(num_bytes: int) -> str:
    """A size for people: 3 MiB -> '3.0 MiB', 1 KiB -> '1.0 KiB', 64 GiB -> '64.0 GiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def as_bool(key: str, value: Any) -> bool:
    """``value`` as a flag: a bool, or 1/0, true/false, yes/no, on/off in any case."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={value!r}: expected true or false")


def as_int(key: str, value: Any) -> int:
    """``value`` as a whole number: an int, or its digits as text.  2.7, '2.7', True and 'true'
    are refused (never turned into 2 or 1)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"\s*[-+]?\d+\s*", value):
        return int(value)
    raise ConfigError(f"{key}={value!r}: expected a whole number")


def as_float(key: str, value: Any) -> float:
    """``value`` as a finite number: an int, a float, or one as text.  nan, inf and True are
    refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{key}={value!r}: expected a number")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected a number") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    return number


@functools.cache  # a search of the installed packages: once per process, not per stats read
def package_version() -> str:
    """The installed distribution's version, or the source tree's when not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def version_line(program: str) -> str:
    """What ``--version`` prints: the release and the wire protocol it speaks."""
    from pegaflow.platform.wire import WIRE_VERSION
    return f"{program} {package_version()} (wire protocol v{WIRE_VERSION})"
