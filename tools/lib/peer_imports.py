"""Whether a peer's processes can import everything they will, before a bench starts them: the
modules they import at start, then every import written inside a function of the modules that
pulled in (the imports a server makes only once it runs, such as LMCache's metrics exporter at
its application's startup), each tried in this interpreter.

    python -P peer_imports.py lmcache     # with the peer's folder and vLLM's on PYTHONPATH

``tools/peers_bundle.sh`` carries this file into the bundle and its ``unpack.sh`` runs it on the
GPU machine right after unpacking: one line per module that cannot be imported (on stderr),
exit 1 if any; ``tools/lib/peers.py`` runs it in ``lmcache-mp``'s import check too.
It imports nothing of this repository (it runs from the bundle, outside it) and only the
standard library at import time.

An import inside a function is left out when it sits under ``try`` with a handler for
``ImportError`` (or a broader one), and so are that handler's own imports (its fallbacks): the
module is optional there.  ``UNREACHED`` names the imports of branches the benches never take,
each with the reason; they are printed, not failed.  An import of the package's
own modules is followed only as far as the first check: each of the package's modules that the
roots loaded is read, not the whole package (backends a run never loads stay out).
"""

from __future__ import annotations

import ast
import importlib
import sys
import traceback
from dataclasses import dataclass

# What each peer's processes import first: its server's entry module and the connector vLLM loads.
ROOTS = {
    "lmcache": (
        "lmcache.cli.main", "lmcache.cli.commands.server", "lmcache.v1.multiprocess.http_server",
        "lmcache.v1.multiprocess.server", "lmcache.v1.mp_observability.otel_init",
        "lmcache.integration.vllm.lmcache_mp_connector", "lmcache.integration.vllm.vllm_multi_process_adapter",
        "lmcache.integration.vllm.vllm_v1_adapter",
        "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"),
    "pegaflow-rs": ("pegaflow._server", "pegaflow.connector"),
}
# Function-level imports of branches the benches never take (tools/lib/peers.py's flags): printed
# as such, never a failure. A key names a module and everything under it.
UNREACHED = {
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter.OTLPMetricExporter":
        "LMCache's OTLP push mode, only with --otlp-endpoint, which the benches do not pass",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter.OTLPSpanExporter":
        "LMCache's tracing, only with --enable-tracing and --otlp-endpoint, which the benches do not pass",
    "vllm.distributed.parallel_state.get_decode_context_model_parallel_rank":
        "PegaFlow's connector, only with decode context parallelism > 1 (vLLM 0.26 lacks it; docs/peers.md)",
    # LMCache's storage backends and integrations that the benches never configure; some of their
    # modules load with its cache engine (cache_engine.py imports the GDS allocator)
    "cufile": "LMCache's GPUDirect Storage backend and allocator (GDS), never configured here",
    "hipfile": "LMCache's ROCm file allocator, AMD GPUs only",
    "azure": "LMCache's Azure blob connector, never configured here",
    "glide_shared": "LMCache's Valkey backend, never configured here",
    "glide_sync": "LMCache's Valkey backend, never configured here",
    "infinistore": "LMCache's InfiniStore connector, never configured here",
    "mooncake": "LMCache's Mooncake lookup client, never configured here",
    "tensorrt_llm": "LMCache's TensorRT-LLM integration, not vLLM's",
}
PACKAGE = {"lmcache": "lmcache", "pegaflow-rs": "pegaflow"}
_OPTIONAL = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


@dataclass(frozen=True, slots=True)
class Failure:
    module: str
    where: str   # the root, or the file and line of the function-level import
    error: str   # the exception's last line

    def line(self) -> str:
        return f"cannot import {self.module} ({self.where}): {self.error}"


def deferred_imports(source: str, package: str) -> list[tuple[str, int]]:
    """The absolute imports written inside a function of ``source`` (its module-level ones ran
    already), each as (module, line), except the package's own and those an ImportError handler
    guards.  ``from X import Y`` gives ``X.Y`` where Y may be a submodule, tried as such later."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, in_function: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and not guarded and isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno) for alias in child.names)
            elif in_function and not guarded and isinstance(child, ast.ImportFrom) and child.level == 0:
                found.extend((f"{child.module}.{alias.name}", child.lineno) for alias in child.names)
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Try) and _catches_import_error(child):
                for part in (*child.body, *child.handlers):  # an import and its fallbacks
                    visit(ast.Module(body=[part], type_ignores=[]), inner, True)
                for part in (*child.orelse, *child.finalbody):
                    visit(ast.Module(body=[part], type_ignores=[]), inner, guarded)
            else:
                visit(child, inner, guarded)

    visit(ast.parse(source), False, False)
    return [(name, line) for name, line in found if name.split(".")[0] != package]


def _catches_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(n, ast.Name) and n.id in _OPTIONAL for n in names):
            return True
    return False


def unreached(module: str) -> bool:
    """Whether ``module`` is, or lies under, a key of ``UNREACHED``."""
    parts = module.split(".")
    return any(".".join(parts[:i]) in UNREACHED for i in range(1, len(parts) + 1))


def try_import(module: str) -> str | None:
    """None when ``module`` imports (``a.b.name`` also when ``name`` is an attribute of ``a.b``)."""
    try:
        importlib.import_module(module)
        return None
    except ModuleNotFoundError as exc:
        parent, _, attr = module.rpartition(".")
        if parent and exc.name == module:
            try:
                return None if hasattr(importlib.import_module(parent), attr) else f"no {attr} in {parent}"
            except Exception as inner:  # noqa: BLE001 - any failure is the answer, reported
                return _last_line(inner)
        return _last_line(exc)
    except Exception as exc:  # noqa: BLE001 - any failure is the answer, reported
        return _last_line(exc)


def _last_line(exc: BaseException) -> str:
    return traceback.format_exception_only(type(exc), exc)[-1].strip()


def check(roots: tuple[str, ...], package: str) -> list[Failure]:
    """The roots imported in order, then every deferred import of the package's loaded modules."""
    failures = [Failure(root, "entry module", err) for root in roots if (err := try_import(root))]
    seen: set[str] = set()
    for name, module in sorted(sys.modules.items()):
        path = getattr(module, "__file__", None) or ""
        if name.split(".")[0] != package or not path.endswith(".py"):
            continue
        with open(path, encoding="utf-8") as f:
            imports = deferred_imports(f.read(), package)
        for target, line in imports:
            if target not in seen and not unreached(target) and (err := try_import(target)):
                failures.append(Failure(target, f"{path}:{line}", err))
            seen.add(target)
    return failures


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    peers = args or sorted(ROOTS)
    status = 0
    for module, reason in UNREACHED.items():
        print(f"not checked: {module}: {reason}")
    for peer in peers:
        failures = check(ROOTS[peer], PACKAGE[peer])
        if not failures:
            print(f"{peer}: every import found ({len(ROOTS[peer])} entry modules and their deferred imports)")
            continue
        # on stderr, the summary first: the last line is a failure (tools/lib/peers.py shows it)
        print(f"{peer}: {len(failures)} imports missing:", file=sys.stderr)
        for failure in failures:
            print(f"{peer}: {failure.line()}", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
