"""tools.bench_pd's streamed client and its figures, against bench_serving's fake server (no GPU)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.tools.test_bench_serving import port  # noqa: F401  (the fake server's fixture)
from tools.bench_pd import figures, stream


def test_stream_times_every_chunk_and_is_done_at_the_last(port):  # noqa: F811
    result, times = stream(port, [5, 6, 7, 8], 3, "k")
    assert result.error == "" and result.tokens == [5, 6, 7]
    assert len(times) == 3 and times == sorted(times)
    assert result.first_token_s == times[0] and result.done_s == times[-1]
    row = figures([(result, times)])
    assert row["requests"] == 1 and row["errors"] == 0 and row["itl_p50_ms"] >= 0


def test_stream_error_has_no_chunk_times(port):  # noqa: F811
    result, times = stream(port, [0, 1], 3, "bad")  # the fake answers a prompt starting with 0 with HTTP 400
    assert result.error.startswith("HTTP 400") and times == []
    assert figures([(result, times)])["errors"] == 1


def test_pd_command_is_a_plain_servers_with_pegaflows_connector_in_its_role():
    from tools.bench_pd import pd_command
    args = SimpleNamespace(model="m", max_model_len=8192, gpu_share=0.4, gpu_blocks=4000, eager=False)
    cmd = pd_command("kv_consumer", args, 8100, "benchpd1")
    transfer = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "PegaKVConnector", "kv_connector_module_path": "pegaflow.connector",
                        "kv_role": "kv_consumer", "kv_connector_extra_config": {"engine_name": "benchpd1"}}
    assert cmd[cmd.index("--port") + 1] == "8100" and cmd.count("--kv-transfer-config") == 1
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == str(args.gpu_share)
