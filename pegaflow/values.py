"""Config values as people write them: sizes with units, on/off flags, and the version.

Sizes: a number with an optional unit in any case.  Binary units say so (KiB, MiB, GiB,
TiB, and the short K, M, G, T as in ``docker --shm-size``); decimal ones say so too
(kB, MB, GB, TB: powers of 1000).  A plain number is bytes.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata
from typing import Any

from pegaflow.errors import ConfigError

DISTRIBUTION = "vllm-kv-offload-engine"  # the name pip knows this project by (pyproject.toml)

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'4GiB' -> 4294967296, '4GB' -> 4000000000; plain numbers are bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"size {text!r}: expected a number with an optional unit like 512MiB, "
                          f"4GiB or 4GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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


@functools.cache  # a search of the installed packages: once per process, not per stats read
def package_version() -> str:
    """The installed distribution's version, or the source tree's when not installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def version_line(program: str) -> str:
    """What ``--version`` prints: the release and the wire protocol it speaks."""
    from pegaflow.wire import WIRE_VERSION
    return f"{program} {package_version()} (wire protocol v{WIRE_VERSION})"
