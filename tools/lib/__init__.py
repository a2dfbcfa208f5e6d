"""What the benches share: their workloads, their phases, the peers they measure, the
processes they start and the tables they write.  A bench (``tools/bench_*.py``) only wires
these; no bench imports another."""
