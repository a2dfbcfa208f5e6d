"""The engine's host memory: the pinned pool and where entries live in it (``pool``), its
record for --keep-pool (``pool_table``), pinned a chunk at a time (``pinning``) after each
range is faulted in (``fault_in``), and whether the host has room for it all at start
(``host_capacity``)."""
