"""A cuda-python result unwrapped: its values, or ``CudaError`` naming the call that failed."""

from __future__ import annotations

from pegaflow.platform.errors import CudaError


def check(result: tuple, what: str = ""):
    """Unwrap a cuda-python ``(status, *values)`` tuple; raise ``CudaError`` on failure."""
    status, *values = result
    if int(status) != 0:
        name = getattr(status, "name", str(status))
        raise CudaError(f"{what}: {name}" if what else name)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
