"""An in-process stand-in for the Mooncake client (``engine/remote/store.py``'s
methods) over a dict, shared by the "engines" of a unit test; ``is_down`` fails every
call, ``stall`` holds every call until released."""

from __future__ import annotations

import ctypes
import threading

from engine.remote.store import NOT_FOUND

UNREACHABLE = -900


class FakeStore:
    def __init__(self, objects: dict[str, bytes] | None = None) -> None:
        self.objects = {} if objects is None else objects
        self.is_down = False
        self.stall = threading.Event()
        self.stall.set()  # (cleared: calls wait)
        self.num_gets = 0
        self.host = "fake"

    def register(self, ptr: int, size: int) -> None:
        pass

    def put(self, names, ptrs, sizes):
        return self.put_parts(names, [[p] for p in ptrs], [[n] for n in sizes])  # one part each

    def get(self, names, ptrs, sizes):
        return self.get_parts(names, [[p] for p in ptrs], [[n] for n in sizes])  # one part each

    def put_parts(self, names, ptrs, sizes):
        self.stall.wait()
        if self.is_down:
            return [UNREACHABLE] * len(names)
        for name, parts, lengths in zip(names, ptrs, sizes):
            self.objects.setdefault(name, b"".join(ctypes.string_at(p, n) for p, n in zip(parts, lengths)))
        return [0] * len(names)

    def get_parts(self, names, ptrs, sizes):
        self.stall.wait()
        self.num_gets += 1
        if self.is_down:
            return [UNREACHABLE] * len(names)
        codes = []
        for name, parts, lengths in zip(names, ptrs, sizes):
            data = self.objects.get(name)
            if data is None or len(data) != sum(lengths):
                codes.append(NOT_FOUND if data is None else -600)
                continue
            at = 0
            for p, n in zip(parts, lengths):
                ctypes.memmove(p, data[at:at + n], n)
                at += n
            codes.append(len(data))
        return codes

    def exists(self, names):
        self.stall.wait()
        self.num_gets += 1
        if self.is_down:
            return [UNREACHABLE] * len(names)
        return [int(name in self.objects) for name in names]

    def remove(self, names):
        return [0 if self.objects.pop(name, None) is not None else NOT_FOUND for name in names]

    def close(self) -> None:
        pass
