"""The GPUs this engine sees, and which of them a client's memory lives on.

A client names the GPU of each region by its UUID (``wire.REGION.gpu_uuid``), never by its own
CUDA ordinal: every process numbers only the GPUs its CUDA_VISIBLE_DEVICES shows it, so a
Kubernetes pod given the node's fourth GPU calls it device 0, while the engine (every GPU of
the node visible) calls it device 3.  REGISTER looks the UUID up here, and the engine's own
ordinal is the one its mappings, events and copy streams use from then on.  A UUID it does not
see refuses the REGISTER (``UnknownGpuError``), naming the UUID and the GPUs it does see.

The host backend has one stand-in "GPU", ``wire.HOST_GPU_UUID``, so a host region is checked
the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from pegaflow.platform.errors import UnknownGpuError
from pegaflow.platform.wire import HOST_GPU_UUID, gpu_uuid_text

EVERY_GPU_VISIBLE = ("run the engine where every GPU of the node is visible: NVIDIA_VISIBLE_DEVICES=all, "
                     "no CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True, slots=True)
class VisibleGpus:
    uuids: tuple[bytes, ...]  # the UUID of each device, by the engine's ordinal

    @classmethod
    def of_driver(cls) -> "VisibleGpus":
        """The GPUs the CUDA driver shows this process."""
        from pegaflow.platform.cuda import driver
        return cls(tuple(driver.device_uuid(i) for i in range(driver.device_count())))

    @classmethod
    def host(cls) -> "VisibleGpus":
        return cls((HOST_GPU_UUID,))

    def ordinal_of(self, uuid: bytes, client_device: int) -> int:
        """The engine's ordinal of the GPU ``uuid`` (the client's device ``client_device``)."""
        if uuid in self.uuids:
            return self.uuids.index(uuid)
        hint = "" if HOST_GPU_UUID in self.uuids else f" ({EVERY_GPU_VISIBLE})"
        raise UnknownGpuError(f"the region is on {gpu_uuid_text(uuid)} (the client's device {client_device}), "
                              f"a GPU this engine does not see; it sees {self.describe()}{hint}")

    def describe(self) -> str:
        return ", ".join(f"{i}: {gpu_uuid_text(u)}" for i, u in enumerate(self.uuids)) or "no GPU"
