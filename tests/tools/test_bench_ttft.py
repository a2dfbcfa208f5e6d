"""bench_ttft's arithmetic, on made-up phase results (the phases themselves need a GPU)."""

import json

from tools.lib.ttft_figures import _stats, summarize


def _phases():
    tokens = [[5], [6]]
    peg = {"cold_ms": [300.0, 310.0], "warm_ms": [40.0, 60.0], "cold_tokens": tokens,
           "warm_tokens": tokens, "warm_batch_ms": 200.0, "tpot_ms": [10.5, 99.0, 10.0],
           "external_hit_tokens": 100.0, "cold_engine_ms": [290.0, 300.0], "warm_engine_ms": [30.0, 32.0],
           "engine_stats": {"blocks_loaded": 12, "blocks_saved": 6}}
    native = {"cold_ms": [300.0, 300.0], "warm_ms": [80.0, 100.0], "gpu_hit_ms": [40.0, 40.0],
              "cold_tokens": tokens, "warm_tokens": tokens, "warm_engine_ms": [70.0, 72.0],
              "gpu_hit_engine_ms": [20.0, 22.0]}
    none = {"cold_ms": [280.0], "tpot_ms": [10.0, 9.0, 12.0], "cold_batch_ms": 900.0, "cold_tokens": tokens,
            "gpu_hit_ms": [30.0, 32.0], "gpu_hit_tokens": tokens, "gpu_hit_step_ms": [9.0, 11.0]}
    return peg, native, none


def test_bench_ttft_summarize_ratios_and_identity():
    # 1. Medians: warm pegaflow 50, native 90: ratio 0.556; TPOT medians 10.5 / 10.0 (one
    #    slow request does not move it).
    result = summarize(*_phases(), "test-gpu")
    assert result["warm_pegaflow_ms_median"] == 50.0 and result["warm_native_ms_median"] == 90.0
    assert abs(result["warm_pegaflow_over_native"] - 50 / 90) < 1e-12
    assert abs(result["tpot_ratio_saving_vs_none"] - 1.05) < 1e-12
    assert result["warm_pegaflow_engine_ms_median"] == 31.0
    # 2. The GPU-hit floor is vLLM's prefix cache alone; the native phase's is kept apart.
    assert result["gpu_hit_ms_median"] == 31.0 and result["gpu_hit_native_phase_ms_median"] == 40.0
    assert result["gpu_hit_step_ms_median"] == 10.0 and result["cold_none_ms_median"] == 280.0
    assert result["engine_blocks_loaded"] == 12 and result["outputs_identical"] is True


def test_bench_ttft_summarize_different_tokens_not_identical():
    # 1. One warm token differs from the cold run: outputs_identical must say so.
    peg, native, none = _phases()
    peg["warm_tokens"] = [[5], [7]]
    assert summarize(peg, native, none, "test-gpu")["outputs_identical"] is False
    # 2. So must a GPU-hit token that differs.
    peg, native, none = _phases()
    none["gpu_hit_tokens"] = [[5], [8]]
    assert summarize(peg, native, none, "test-gpu")["outputs_identical"] is False


def test_bench_ttft_stats_p90_is_the_high_end():
    assert _stats([1.0, 2.0, 3.0, 4.0, 100.0]) == (3.0, 100.0)


def test_bench_ttft_summarize_tpot_separates_saving_from_the_connector_itself():
    from tools.lib.ttft_figures import summarize_tpot
    # 1. Medians 12 (saving), 11 (connector idle), 10 (none): each ratio from them.
    result = summarize_tpot({"pegaflow": [12.0, 13.0, 11.0], "idle": [11.0, 99.0, 10.0],
                             "none": [10.0, 9.0, 11.0]}, "test-gpu")
    assert (result["tpot_saving_ms"], result["tpot_idle_ms"], result["tpot_none_ms"]) == (12.0, 11.0, 10.0)
    assert abs(result["tpot_ratio_saving_vs_none"] - 1.2) < 1e-12
    assert abs(result["tpot_ratio_saving_vs_idle"] - 12 / 11) < 1e-12
    assert abs(result["tpot_ratio_idle_vs_none"] - 1.1) < 1e-12


def test_bench_ttft_summarize_without_native_leaves_its_columns_out():
    # --skip-native: no native figures, the rest (and the identity check) as before.
    peg, _, none = _phases()
    result = summarize(peg, None, none, "test-gpu")
    assert "warm_native_ms_median" not in result and "warm_pegaflow_over_native" not in result
    assert result["warm_pegaflow_ms_median"] == 50.0 and result["outputs_identical"] is True
    peg["cold_tokens"] = [[5], [9]]
    assert summarize(peg, None, none, "test-gpu")["outputs_identical"] is False


def test_bench_ttft_phases_run_with_one_hash_seed(monkeypatch):
    # vLLM 0.26 hashes blocks with a per-process seed unless PYTHONHASHSEED is set: every phase
    # (and so the disk phase's new vLLM) gets the same one.
    import argparse

    import tools.bench_ttft as bench
    seen = []

    def fake_spawn(module, phase, flags, timeout_s, env, cwd, leftovers):
        seen.append(env.get("PYTHONHASHSEED"))
        assert timeout_s == 77.0 and leftovers is None  # (no peer: nothing of its own to sweep)
        return {"ok": True}

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setattr(bench, "spawn_phase", fake_spawn)
    args = argparse.Namespace(tpot_only=False, eager=True, no_async_scheduling=False, model="m", num_prompts=1,
                              prompt_tokens=10, decode_tokens=1, decode_prompts=1, engine_name="e",
                              gpu_memory_utilization=0.5, native_offload_gib=1.0,
                              disk_load_mode="layerwise", phase_timeout=77.0)
    assert bench._spawn(args, "pegaflow") == {"ok": True} and bench._spawn(args, "disk") == {"ok": True}
    assert seen == ["0", "0"]


def test_bench_ttft_summarize_disk_keeps_each_load_mode_apart():
    from tools.lib.ttft_figures import summarize_disk
    peg, _, none = _phases()
    tokens = none["cold_tokens"]

    def disk(ms, blocks):
        return {"disk_ms": ms, "pool_ms": [41.0, 43.0], "disk_tokens": tokens, "pool_tokens": tokens,
                "engine_stats": {"disk_blocks_read": blocks, "lookup_disk_blocks": blocks},
                "beside": {"new_ttft_ms": ms[0] / 10, "new_tpot_ms": 7.0}}
    # 1. Two modes: the first one's figures under the plain keys, each under its own name.
    disks = {"async": disk([900.0, 910.0], 10), "layerwise": disk([700.0, 720.0], 12)}
    result = summarize_disk(peg, disks, none)
    assert result["warm_from_disk_ms"] == result["warm_from_disk_ms_async"] == 905.0
    assert result["warm_from_disk_ms_layerwise"] == 710.0 and result["disk_blocks_read_layerwise"] == 12
    assert result["beside_disk_new_ttft_ms_layerwise"] == 70.0 and result["beside_disk_new_ttft_ms"] == 90.0
    assert (result["warm_from_pool_ms"], result["cold_ms"]) == (50.0, 305.0)
    assert result["warm_from_pool_after_disk_ms_async"] == 42.0 and result["outputs_identical_disk"] is True
    # 2. A token of one mode that differs from no connector's: not identical.
    disks["layerwise"]["pool_tokens"] = [[5], [9]]
    assert summarize_disk(peg, disks, none)["outputs_identical_disk"] is False


def test_bench_ttft_imports_no_pegaflow_of_this_repo_at_import():
    # A pegaflow-rs phase runs this module with PegaFlow's package of the same name first on
    # its path: importing this repo's pegaflow at the top would load it, and break the phase.
    import subprocess
    import sys

    from tools.bench_ttft import ROOT
    code = ("import sys, tools.bench_ttft\n"
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'pegaflow')\n"
            "sys.exit(f'imported {loaded}' if loaded else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_bench_ttft_peer_phases_skip_a_missing_peer_with_one_line(tmp_path, monkeypatch, capsys):
    import argparse

    from tools.bench_ttft import _peer_phases
    monkeypatch.setenv("PEGAFLOW_PEERS_DIR", str(tmp_path))  # no peer carried here
    results = _peer_phases(argparse.Namespace(pool_size="1GiB"), ["pegaflow-rs"])
    assert set(results) == {"pegaflow-rs"} and "peers_bundle.sh" in results["pegaflow-rs"]["skipped"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bench_ttft: skipping pegaflow-rs: {results['pegaflow-rs']['skipped']}"]


def test_bench_ttft_peer_phases_a_peer_failing_at_run_time_is_a_row_not_the_end(tmp_path, monkeypatch, capsys):
    # 1. A peer that imports fine but whose server exits at once.
    import argparse
    import sys

    from tools.bench_ttft import _peer_phases
    from tools.lib import peers
    monkeypatch.setattr(peers, "unavailable", lambda config: None)
    monkeypatch.setattr(peers, "plan", lambda config, pool_bytes, num_vllms=1: peers.Plan(
        config, {}, {}, None, (sys.executable, "-c", "import sys; sys.exit(4)"),
        f"http://127.0.0.1:{peers.free_port()}/health"))
    # 2. Its row says it failed, and why; the bench goes on.
    results = _peer_phases(argparse.Namespace(pool_size="1GiB"), ["lmcache-mp"])
    assert "exited (4)" in results["lmcache-mp"]["failed"]
    assert "bench_ttft: lmcache-mp failed:" in capsys.readouterr().err


class _FakeLLM:
    """vLLM's offline LLM as the warm pass sees it: ``reset_prefix_cache`` refuses while
    ``held`` says blocks are still held; each generate serves ``cached`` prompt tokens, from
    the GPU's prefix cache if ``gpu_hits`` (else from a connector), and vLLM counts them."""

    def __init__(self, held: int, cached: int, gpu_hits: bool = False):
        from types import SimpleNamespace
        self.held, self.cached, self.gpu_hits, self.calls = held, cached, gpu_hits, []
        self.by_source = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self._ns = SimpleNamespace
        import torch
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[torch.ones(4, 8)]))

    def collective_rpc(self, method, args=()):
        self.calls.append("scrub")
        return [method(self.worker, *args)]

    def reset_prefix_cache(self):
        self.calls.append("reset")
        self.held -= 1
        return self.held < 0

    def get_metrics(self):
        return [self._ns(name="vllm:prompt_tokens_by_source", labels={"engine": "0", "source": s}, value=v)
                for s, v in self.by_source.items()]

    def generate(self, prompts, params, use_tqdm):
        self.calls.append("generate")
        prompt = prompts[0]["prompt_token_ids"]
        self.by_source["local_cache_hit" if self.gpu_hits else "external_kv_transfer"] += self.cached
        self.by_source["local_compute"] += len(prompt) - self.cached
        metrics = self._ns(first_token_latency=0.01, queued_ts=1.0, scheduled_ts=1.0, first_token_ts=1.01)
        return [self._ns(outputs=[self._ns(token_ids=[prompt[-1]], logprobs=None)], num_cached_tokens=self.cached,
                         metrics=metrics)]


def test_bench_ttft_warm_pass_waits_for_an_empty_gpu_cache_and_counts_what_was_served():
    # 1. Saves still hold blocks: the first two resets are refused; the warm pass starts only
    #    once vLLM has reset its GPU prefix cache.
    from tools.lib.ttft_configs import row
    from tools.lib.ttft_phase import _timed_warm
    llm, prompts = _FakeLLM(held=2, cached=48), [[1] * 50, [2] * 50]
    result = {"cold_tokens": [[1], [2]], "cacheable_tokens": 96}
    _timed_warm(result, llm, prompts)
    assert llm.calls == ["reset", "reset", "reset", "scrub", "generate", "generate"] and result["reset_wait_s"] > 0
    # ... and vLLM's whole GPU KV cache was overwritten before it (4 x 8 floats).
    assert result["scrubbed_kv_bytes"] == 128 and (llm.worker.model_runner.kv_caches[0] == 0.5).all()
    # 2. Served: each request's num_cached_tokens; vLLM's split says none came from the GPU.
    assert result["warm_cached_tokens"] == [48, 48] and result["warm_tokens"] == [[1], [2]]
    assert result["warm_by_source"] == {"local_compute": 4, "local_cache_hit": 0, "external_kv_transfer": 96}
    assert row(result, [[1], [2]], {})["served_share"] == 1.0


def test_bench_ttft_warm_pass_that_hit_the_gpu_is_reported_invalid():
    from tools.lib.ttft_configs import row
    from tools.lib.ttft_phase import _timed_warm
    llm = _FakeLLM(held=0, cached=48, gpu_hits=True)
    result = {"cold_tokens": [[1]], "cacheable_tokens": 48}
    _timed_warm(result, llm, [[1] * 50])
    invalid = row(result, [[1]], {})
    assert invalid["invalid"] == ("48 prompt tokens of the warm pass were vLLM GPU prefix-cache hits, not loads "
                                  "from the host cache")
    assert "ttft_warm_ms" not in invalid and invalid["requests"][0]["warm_served_tokens"] == 48


def test_bench_ttft_backend_figures_leave_out_a_copy_path_whose_warm_pass_hit_the_gpu(capsys):
    # 1. --copy-backends kernel staged: the kernel's warm pass loaded 96 tokens from the host,
    #    the staged one's was served from vLLM's GPU cache (16 tokens): invalid, no figures.
    from tools.lib.ttft_figures import backend_figures
    def phase(gpu_hits):
        return {"warm_ms": [40.0, 42.0], "cold_ms": [270.0], "cold_tokens": [[1]], "warm_tokens": [[1]],
                "warm_by_source": {"local_compute": 4, "local_cache_hit": gpu_hits,
                                   "external_kv_transfer": 96 - gpu_hits}}
    out = backend_figures({"kernel": phase(0), "staged": phase(16)}, {"cold_tokens": [[1]]})
    assert out["warm_pegaflow_ms_median_kernel"] == 41.0 and out["outputs_identical_kernel"] is True
    assert [key for key in out if key.endswith("_staged")] == ["invalid_staged"]
    assert out["invalid_staged"].startswith("16 prompt tokens of the warm pass were vLLM GPU")
    assert "no warm figures for copy path staged" in capsys.readouterr().err
    # 2. Each one's first tokens' top-5 logprobs against no offload's GPU hit of the same step.
    top5 = [[[7, -0.5], [9, -1.25]]]
    none = {"cold_tokens": [[1]], "gpu_hit_top5": top5, "gpu_hit_cached_tokens": [96], "cudagraph_mode": "FULL"}
    exact, off = phase(0), phase(0)
    for one, first in ((exact, top5[0]), (off, [[7, -0.5], [9, -1.5]])):
        one.update(warm_top5=[first], warm_cached_tokens=[96], cudagraph_mode="FULL")
    out = backend_figures({"default": exact, "load-layer-groups4": off}, none)
    assert (out["logprobs_identical_default"], out["logprobs_compared_default"]) == (True, 1)
    assert (out["logprobs_identical_load-layer-groups4"], out["logprobs_compared_load-layer-groups4"]) == (False, 1)


def test_bench_ttft_phase_whose_reset_never_succeeds_writes_a_failed_row(tmp_path, monkeypatch):
    # The phase process ends normally with the reason in its output: the bench's row for that
    # configuration says why, and the other configurations still run.
    import sys

    import tools.bench_ttft as bench
    from tools.lib.warm_pass import GpuCacheNotEmptyError

    def never_empty(args):
        raise GpuCacheNotEmptyError("vLLM refused to reset its GPU prefix cache 1500 times in 300 s")
    monkeypatch.setattr(bench, "run_phase", never_empty)
    out = tmp_path / "phase.json"
    monkeypatch.setattr(sys, "argv", ["bench_ttft", "--phase", "pegaflow-rs", "--phase-out", str(out)])
    assert bench.main() == 0
    assert json.loads(out.read_text()) == {"failed": "vLLM refused to reset its GPU prefix cache 1500 times in 300 s"}


def test_bench_ttft_figures_leave_out_a_configuration_without_figures(monkeypatch, capsys):
    # 1. native's warm pass hit the GPU: the top-level native figures are left out, its row
    #    says why, one line on stderr.
    from tools.lib.ttft_configs import config_rows
    from tools.lib.ttft_figures import table_figures
    peg, native, none = _phases()
    for phase, served in ((peg, 20), (native, 20)):
        phase.update(warm_cached_tokens=[served, served], cacheable_tokens=40, reset_wait_s=0.0,
                     warm_by_source={"local_compute": 2, "local_cache_hit": 0, "external_kv_transfer": 40})
    native["warm_by_source"] = dict(native["warm_by_source"], local_cache_hit=40, external_kv_transfer=0)
    rows = config_rows(peg, native, none, {})
    result = table_figures(rows, peg, native, none, "test-gpu")
    assert result["gpu"] == "test-gpu" and "warm_native_ms_median" not in result
    assert result["warm_pegaflow_ms_median"] == 50.0
    assert "bench_ttft: no figures for native: 40 prompt tokens" in capsys.readouterr().err
    # 2. pegaflow's own warm pass invalid: no figures at all.
    peg["warm_by_source"] = native["warm_by_source"]
    assert table_figures(config_rows(peg, native, none, {}), peg, native, none, "gpu") is None


def test_bench_ttft_engine_variants_are_flags_and_name_their_figures():
    from tools.bench_ttft import engine_flags, variant_name
    # --copy-backends staged: a copy path; --engine-variants: flags without dashes, '+' between.
    assert engine_flags("staged", is_flags=False) == ["--copy-backend", "staged"]
    assert engine_flags("load-layer-groups=4+hold-saves", is_flags=True) == ["--load-layer-groups=4",
                                                                         "--hold-saves"]
    assert engine_flags("default", is_flags=True) == [] and engine_flags(None, is_flags=False) == []
    assert variant_name(None) == variant_name("default") == "default" and variant_name("staged") == "staged"
    assert variant_name("load-layer-groups=4+hold-saves") == "load-layer-groups4+hold-saves"


def test_bench_ttft_configs_split_over_calls_merge_into_one_table(monkeypatch, tmp_path, capsys):
    # 1. Three calls as the GPU machine's 10-minute limit needs them, each with its phases file:
    #    none and pegaflow; native and lmcache-mp; pegaflow-rs.  The phases are faked.
    import tools.bench_ttft as bench
    peg, native, none = _phases()
    for phase in (peg, native):
        phase.update(warm_cached_tokens=[20, 20], cacheable_tokens=40, reset_wait_s=0.0,
                     warm_by_source={"local_compute": 2, "local_cache_hit": 0, "external_kv_transfer": 40})
    spawned = []

    def spawn(args, phase, run=None):
        spawned.append(phase)
        return {"none": none, "native": native}.get(phase, native)
    monkeypatch.setattr(bench, "_spawn", spawn)
    monkeypatch.setattr(bench, "_pegaflow_phases", lambda args: ({"default": [peg]}, None))
    monkeypatch.setattr(bench, "_peer_phases", lambda args, configs: {c: native for c in configs})
    monkeypatch.setattr(bench, "gpu_name", lambda: "test-gpu")
    parts = [tmp_path / f"part{i}.json" for i in range(3)]
    for part, configs in zip(parts, (["none", "pegaflow"], ["native", "lmcache-mp"], ["pegaflow-rs"])):
        assert bench.main(["--configs", *configs, "--phases-out", str(part), "--json"]) == 0
    assert spawned == ["none", "native"]  # (pegaflow and the peers through their own paths)
    # 2. The first call alone has both none and pegaflow: its table; the others only say what ran.
    outputs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert set(outputs[0]["configs"]) == {"none", "pegaflow"}
    assert outputs[1] == {"gpu": "test-gpu", "configs_run": ["native", "lmcache-mp"], "phases_out": str(parts[1])}
    # 3. Merged: one table of every configuration, as one call with all five would give.
    assert bench.main(["--merge", *map(str, parts), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert list(merged["configs"]) == ["none", "pegaflow", "native", "lmcache-mp", "pegaflow-rs"]
    assert merged["gpu"] == "test-gpu" and merged["warm_native_ms_median"] == 90.0


def test_bench_ttft_engine_variants_repeat_interleaved_each_with_a_fresh_engine(monkeypatch):
    # 1. Two variants, three repeats: phases run A B A B A B, each on a fresh engine with its flags.
    import pegaflow.stats.engine_stats
    import tools.bench_ttft as bench
    import tools.engine_process
    engines, spawned = [], []

    class FakeEngine:
        def __init__(self, name, *flags, **kwargs):
            self.name, self.stopped = name, False
            engines.append(self)
            self.flags = flags

        def stop(self, timeout_s=None):
            self.stopped = True

    def spawn(args, phase, run=None):
        spawned.append((phase, engines[-1].flags))
        return {"warm_ms": [40.0 + len(spawned)], "cold_ms": [270.0], "cold_tokens": [[1]], "warm_tokens": [[1]],
                "warm_by_source": {"local_compute": 4, "local_cache_hit": 0, "external_kv_transfer": 96}}
    monkeypatch.setattr(tools.engine_process, "EngineProcess", FakeEngine)
    monkeypatch.setattr(pegaflow.stats.engine_stats, "read_stats", lambda name: {"blocks_loaded": 1})
    monkeypatch.setattr(bench, "_spawn", spawn)
    args = bench.parse_args(["--configs", "pegaflow", "none", "--engine-variants", "default",
                             "load-layer-groups=4", "--repeat", "3"])
    repeats, disks = bench._pegaflow_phases(args)
    assert spawned == [("pegaflow", ()), ("pegaflow", ("--load-layer-groups=4",))] * 3
    assert len(engines) == 6 and all(e.stopped for e in engines) and disks is None
    # 2. Each variant's figures over its three repeats, with each repeat's median and the spread.
    from tools.lib.ttft_figures import backend_figures
    out = backend_figures({name: runs[0] for name, runs in repeats.items()}, {"cold_tokens": [[1]]}, repeats)
    assert out["warm_pegaflow_ms_repeats_load-layer-groups4"] == [42.0, 44.0, 46.0]
    assert out["warm_pegaflow_ms_spread_load-layer-groups4"] == [42.0, 46.0]
    assert out["warm_pegaflow_ms_median_default"] == 43.0 and out["outputs_identical_default"] is True
    # 3. A repeat whose outputs differ makes its variant's outputs not identical.
    repeats["default"][2]["warm_tokens"] = [[2]]
    assert backend_figures({"default": repeats["default"][0]}, {"cold_tokens": [[1]]},
                           repeats)["outputs_identical_default"] is False


def test_bench_ttft_merge_keeps_every_calls_engine_variants_and_their_repeats(tmp_path):
    # 1. A sweep split over three calls: none alone, then two calls of pegaflow variants, one
    #    variant in both (its repeats of both are kept).
    from tools.lib.ttft_figures import merged_phases

    def phase(ms):
        return {"warm_ms": [ms]}
    files = [{"gpu": "H100", "model": "m", "configs_run": ["none"], "none": {"cold_ms": [1.0]}},
             {"gpu": "H100", "model": "m", "configs_run": ["pegaflow"], "pegaflow": phase(40.0),
              "pegaflow_variants": {"default": phase(40.0), "hold-saves": phase(41.0)},
              "pegaflow_repeats": {"default": [phase(40.0), phase(42.0)], "hold-saves": [phase(41.0)]}},
             {"gpu": "H100", "model": "m", "configs_run": ["pegaflow"], "pegaflow": phase(37.0),
              "pegaflow_variants": {"load-layer-groups4": phase(37.0), "default": phase(43.0)},
              "pegaflow_repeats": {"load-layer-groups4": [phase(37.0)], "default": [phase(43.0)]}}]
    paths = []
    for i, data in enumerate(files):
        paths.append(tmp_path / f"t{i}.json")
        paths[-1].write_text(json.dumps(data))
    merged = merged_phases([str(p) for p in paths])
    # 2. Every variant, in the order first run; the table's pegaflow is the first one's first run.
    assert list(merged["pegaflow_repeats"]) == ["default", "hold-saves", "load-layer-groups4"]
    assert [p["warm_ms"] for p in merged["pegaflow_repeats"]["default"]] == [[40.0], [42.0], [43.0]]
    assert merged["pegaflow"] == phase(40.0) and merged["pegaflow_variants"]["load-layer-groups4"] == phase(37.0)
    assert merged["none"] == {"cold_ms": [1.0]} and merged["configs_run"] == ["none", "pegaflow"]
