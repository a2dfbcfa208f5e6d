"""Fixed-layout numpy records: the one way a shared-memory layout is declared."""

from __future__ import annotations

import numpy as np


def struct_dtype(fields: list[tuple[str, str, int]], itemsize: int) -> np.dtype:
    """A fixed-layout record: (name, format, offset) fields in ``itemsize`` bytes."""
    return np.dtype({
        "names": [f[0] for f in fields],
        "formats": [f[1] for f in fields],
        "offsets": [f[2] for f in fields],
        "itemsize": itemsize,
    })
