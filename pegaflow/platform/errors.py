"""The one error hierarchy of pegaflow.

Every failure a caller can act on has its own type.  A command the engine refuses comes
back as a ``Status`` code on the wire (see ``pegaflow.platform.wire``), which the client raises as
``CommandError`` carrying that status.
"""


class PegaflowError(Exception):
    """Base of every error pegaflow raises on purpose."""


class ConfigError(PegaflowError, ValueError):
    """A flag, environment variable or connector option has an unusable value."""


class ShmError(PegaflowError):
    """A shared-memory segment or semaphore could not be created or attached."""


class EngineNotRunningError(ShmError):
    """No engine of that name runs on this host (its control segment is absent)."""


class EngineStartingError(EngineNotRunningError):
    """The engine has made its segments but not written them yet: it started a moment ago."""


class EngineDeadError(EngineNotRunningError):
    """The engine's segments are there, its process is not (it crashed)."""


class EngineNotRespondingError(ShmError):
    """The engine's process is there but its heartbeat stopped (SIGSTOPped, or stuck)."""


class EngineAlreadyRunningError(ShmError):
    """Another live engine already owns that name."""


class ForeignSegmentError(ShmError):
    """A segment, semaphore or lock file under our name is not this user's private one
    (another owner, or readable or writable by others): never trusted."""


class WireVersionError(PegaflowError):
    """The peer speaks another wire version, magic or descriptor layout."""


class RingError(PegaflowError):
    """Base of the ring's own errors."""


class RingFullError(RingError):
    """The ring or its payload arena stayed full until the deadline."""


class RingEmptyError(RingError):
    """Nothing arrived on the ring before the deadline."""


class PayloadTooLargeError(RingError):
    """A command's payload can never fit in the payload arena."""


class NoFreeSlotError(PegaflowError):
    """Every client slot of the engine is taken."""


class EngineTimeoutError(PegaflowError, TimeoutError):
    """The engine did not answer a command before its deadline."""


class EngineGoneError(PegaflowError):
    """The engine this client attached to has exited or been replaced."""


class CommandError(PegaflowError):
    """The engine answered a command with an error status."""

    def __init__(self, status: int, message: str = "") -> None:
        self.status = status
        super().__init__(message or f"engine answered status {status}")


class LayoutError(PegaflowError, ValueError):
    """A KV cache tensor's layout cannot be described as contiguous pages."""


class CudaError(PegaflowError):
    """A CUDA driver or NVRTC call failed."""


class UnknownGpuError(PegaflowError):
    """A client's memory lives on a GPU the engine does not see (hidden from the engine by its
    CUDA_VISIBLE_DEVICES or NVIDIA_VISIBLE_DEVICES, or on another host): its REGISTER is refused."""


class RemoteTierError(PegaflowError):
    """The remote tier (``--remote``) cannot start: its package is not installed, or its
    store refused the setup (master or metadata server unreachable, memory not registered)."""


class PeerError(PegaflowError):
    """A peer system a benchmark compares against (LMCache, PegaFlow) could not be started:
    its server exited or did not answer its health check in time."""


class StartInterruptedError(PegaflowError):
    """A stop signal (SIGTERM, SIGINT) came while the engine was starting: it stops without
    having served, leaving nothing behind."""
