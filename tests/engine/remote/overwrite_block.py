"""Overwrite one block's data object in the remote store with other bytes of the same
length, as a damaged store or a wrong write would (run on one of the test's hosts)::

    python -m tests.engine.remote.overwrite_block MASTER METADATA HOST NAMESPACE HASH_HEX
"""

from __future__ import annotations

import sys

import numpy as np


def main(argv: list[str]) -> int:
    from mooncake.store import MooncakeDistributedStore

    from engine.remote.header import data_name
    from pegaflow.platform.wire import encode_hashes, hash_keys
    master, metadata, host, namespace, hash_hex = argv
    key = (int(namespace), hash_keys(encode_hashes([bytes.fromhex(hash_hex)]))[0])
    store = MooncakeDistributedStore()
    # no segment of its own: what it puts lives in the engines' segments after it exits
    if store.setup(host, metadata, 0, 16 << 20, "tcp", "", master) != 0:
        return 2
    buf = np.zeros(16 << 20, np.uint8)
    store.register_buffer(buf.ctypes.data, buf.nbytes)
    size = store.get_size(data_name(key))
    if size <= 0 or store.get_into(data_name(key), buf.ctypes.data, size) != size:
        return 3
    buf[size // 2] ^= 0x40  # one bit of one byte
    if store.remove(data_name(key), True) != 0:
        return 4
    codes = store.batch_put_from([data_name(key)], [buf.ctypes.data], [size])
    store.close()
    return 0 if codes == [0] else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
