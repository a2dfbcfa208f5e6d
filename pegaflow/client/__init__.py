"""A process's side of the engine: its slot, its connection, its answers, its KV memory in shared memory."""
