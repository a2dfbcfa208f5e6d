"""The engine process: its options and one frozen config (``options``, ``config``), the start in
order and the stop (``startup``, ``shutdown``), the main loop (``server``), its name and
shared-memory segments (``name_lock``, ``segments``), the stats it publishes (``stats``), the
tiers' threads ended in time (``threads``), and what a dead engine left removed (``cleanup``)."""
