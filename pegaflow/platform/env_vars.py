"""The ``PEGAFLOW_*`` environment variables the connector reads, by its option's name.

Here, not in the connector, because both sides need them: the connector reads them
(``pegaflow.connector.config``), and the engine tells a set variable that is no setting
(a typo, an old name) from one of the connector's without importing it."""

CONNECTOR_ENV_VARS = {
    "engine_name": "PEGAFLOW_NAME", "load_mode": "PEGAFLOW_LOAD_MODE",
    "enable_save": "PEGAFLOW_ENABLE_SAVE", "enable_load": "PEGAFLOW_ENABLE_LOAD",
    "lookup_timeout_ms": "PEGAFLOW_LOOKUP_TIMEOUT_MS", "command_timeout_ms": "PEGAFLOW_COMMAND_TIMEOUT_MS",
    "reconnect_interval_s": "PEGAFLOW_RECONNECT_INTERVAL_S", "num_load_slots": "PEGAFLOW_NUM_LOAD_SLOTS",
    "disk_load_mode": "PEGAFLOW_DISK_LOAD_MODE", "lookup_wait_ms": "PEGAFLOW_LOOKUP_WAIT_MS",
    "compute_once": "PEGAFLOW_COMPUTE_ONCE", "compute_once_wait_ms": "PEGAFLOW_COMPUTE_ONCE_WAIT_MS",
    "prefill_tokens_per_s": "PEGAFLOW_PREFILL_TOKENS_PER_S",
}
