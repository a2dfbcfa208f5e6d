"""The block index: which (namespace, block hash) lives at which pool page, its entries and
leases (``index``, ``entries``), the entries still being written and the votes that make a
shared copy READY (``writes``, ``votes``), a kept pool's entries taken in at start
(``kept_entries``), and which block is given up first (``eviction``)."""
