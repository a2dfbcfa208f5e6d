"""The platform both processes share: byte layouts, rings, shared memory, locks, CUDA, errors."""
