"""CUDA helpers on the driver API (cuda-python), usable without torch.

``driver``: thin wrappers that raise ``pegaflow.platform.errors.CudaError``; ``ipc``: what a client
exports to the engine (memory handles with their allocation offset, a pool of IPC events).
"""
