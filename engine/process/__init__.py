"""The engine process, top to bottom: its options parsed into the config (``options``), the
start in order and the stop (``startup``, ``shutdown``), the main loop (``server``), its name and
shared-memory segments (``name_lock``, ``segments``), and what a dead engine left removed
(``cleanup``).  Nothing below it imports it: the config, stats and threads every part uses
sit at ``engine/``'s top (``config.py``, ``stats.py``, ``threads.py``)."""
