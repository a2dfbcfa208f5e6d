"""tools/lib/peer_imports.py without a GPU: the imports a module makes only inside its functions
are found (those an ImportError handler guards left out), and a missing one fails the check with
its file and line, as LMCache's server lacked its Prometheus exporter at its application's start;
tools/lib/peers.py's lmcache-mp check runs it."""

import textwrap
from pathlib import Path

import pytest

from tools.lib import peer_imports, peers

_OTEL_INIT = """
    import json

    def init_otel_metrics(endpoint):
        from json import decoder
        if endpoint is None:
            from no_such_exporter_pkg.prometheus import PrometheusMetricReader
        try:
            import no_such_optional_pkg
        except ImportError:
            import no_such_fallback_pkg
        from standinpeer import own
    """


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


def test_deferred_imports_function_level_found_guarded_and_own_left_out():
    found = peer_imports.deferred_imports(textwrap.dedent(_OTEL_INIT), "standinpeer")
    assert found == [("json.decoder", 5), ("no_such_exporter_pkg.prometheus.PrometheusMetricReader", 7)]


def test_check_missing_deferred_import_fails_with_its_file_and_line(tmp_path, monkeypatch, capsys):
    # 1. A stand-in server package: its entry module imports fine, its startup would not.
    _write(tmp_path, {"standinpeer/__init__.py": "", "standinpeer/own.py": "",
                      "standinpeer/otel_init.py": _OTEL_INIT})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(peer_imports.ROOTS, "standin", ("standinpeer.otel_init",))
    monkeypatch.setitem(peer_imports.PACKAGE, "standin", "standinpeer")
    # 2. The check names the missing module, where it is imported, and exits 1.
    failures = peer_imports.check(("standinpeer.otel_init",), "standinpeer")
    assert [(f.module, f.where.endswith("otel_init.py:7")) for f in failures] == [
        ("no_such_exporter_pkg.prometheus.PrometheusMetricReader", True)]
    assert "No module named 'no_such_exporter_pkg'" in failures[0].error
    assert peer_imports.main(["standin"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "standin: cannot import no_such_exporter_pkg.prometheus.PrometheusMetricReader")
    # 3. The exporter carried: every import found.
    _write(tmp_path, {"no_such_exporter_pkg/__init__.py": "",
                      "no_such_exporter_pkg/prometheus.py": "PrometheusMetricReader = object\n"})
    assert peer_imports.check(("standinpeer.otel_init",), "standinpeer") == []
    assert peer_imports.main(["standin"]) == 0


def test_check_missing_entry_module_is_a_failure(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    failures = peer_imports.check(("standinpeer_absent.server",), "standinpeer_absent")
    assert [(f.module, f.where) for f in failures] == [("standinpeer_absent.server", "entry module")]


@pytest.fixture
def peers_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PEGAFLOW_PEERS_DIR", str(tmp_path))
    return tmp_path


def test_peers_unavailable_lmcache_mp_names_a_missing_startup_import(peers_dir):
    # 1. A stand-in LMCache whose every entry module imports, but whose metrics setup, run only
    #    at its server's startup, imports a package the bundle lacks.
    site = peers_dir / "lmcache" / "site"
    files = {root.replace(".", "/") + ".py": "" for root in peer_imports.ROOTS["lmcache"]}
    files |= {"lmcache/__init__.py": "", "lmcache/v1/mp_observability/otel_init.py": _OTEL_INIT.replace(
        "standinpeer", "lmcache"), "vllm/__init__.py": ""}
    _write(site, files)
    # 2. lmcache-mp's check says which, where the old check (module-level imports only) said nothing.
    reason = peers.unavailable("lmcache-mp")
    assert reason is not None and reason.startswith(
        "lmcache: cannot import no_such_exporter_pkg.prometheus.PrometheusMetricReader")
    assert "otel_init.py:7" in reason


def test_check_unreached_backend_import_is_not_a_failure(tmp_path, monkeypatch):
    # LMCache's cache engine loads its GDS allocator, whose function imports cufile (never used here).
    _write(tmp_path, {"standingds/__init__.py": "", "standingds/gds.py": """
        def allocate():
            from no_such_cufile_pkg.bindings import cuFileBufRegister
        """})
    monkeypatch.syspath_prepend(str(tmp_path))
    assert [f.module for f in peer_imports.check(("standingds.gds",), "standingds")] == [
        "no_such_cufile_pkg.bindings.cuFileBufRegister"]
    monkeypatch.setitem(peer_imports.UNREACHED, "no_such_cufile_pkg", "a backend the benches never configure")
    assert peer_imports.check(("standingds.gds",), "standingds") == []
    assert peer_imports.unreached("no_such_cufile_pkg.bindings") and not peer_imports.unreached("no_such_cufile")
