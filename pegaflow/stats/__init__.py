"""A running engine's counters from outside it: ``pegaflow-stat`` and the Prometheus metrics."""
