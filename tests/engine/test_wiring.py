"""The engine's parts are wired through their constructors: no code sets an attribute of
another object (a component, a callback, another part's flag) after it was built.

Read with ``ast`` over every module of engine/: an assignment ``x.name = ...`` whose target
is not ``self``'s own attribute passes only where ``name`` is a state field of one of the
plain record types below (a client's ``is_attached``, an entry's ``refs``, a copy's
``num_ops``), or it is one of the few assignments to a foreign library's object listed in
``FOREIGN``.  ``server.backend = ...`` or ``dispatcher.clients = ...`` fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"

# Plain records: their fields are state that the code owning them updates in place.
RECORDS = {
    "clients/client.py": ["ClientState"],
    "blocks/entries.py": ["Entry", "Lease", "IndexCounters"],
    "commands/pending_copy.py": ["PendingCopy"],
    "commands/lookup_waits.py": ["WaitingLookup"],
    "commands/prefill_claims.py": ["Claim"],
    "memory/pool.py": ["_Slab"],
    "disk/store.py": ["DiskCounters", "Block"],
    "remote/workers.py": ["RemoteDone"],
    "copy/base.py": ["CopyOp"],
    "copy/cuda_device.py": ["Device"],
    "copy/cuda_layers.py": ["Inflight"],
    "copy/staged.py": ["_Side"],
    "copy/kernels.py": ["_CopyArgs"],
}
# Objects of other libraries, set the way those libraries are used.
FOREIGN = {
    "_libc.madvise.argtypes", "_libc.madvise.restype",  # ctypes: a C function's signature
    "_local.header",  # a threading.local's own value
    "self._replicas.preferred_segment",  # mooncake's ReplicateConfig, filled before use
}


def _record_fields() -> set[str]:
    fields: set[str] = set()
    for path, names in RECORDS.items():
        tree = ast.parse((ENGINE / path).read_text())
        classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in names]
        assert sorted(c.name for c in classes) == sorted(names), f"{path}: record class missing"
        for cls in classes:
            for node in ast.walk(cls):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    fields.add(node.target.id)
                elif isinstance(node, ast.Assign) and cls.name == "_CopyArgs":  # ctypes _fields_
                    fields.update(elt.elts[0].value for elt in node.value.elts)
                elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    fields.update(t.attr for t in _flat(targets) if _is_own(t))
    return fields


def _flat(targets) -> list:
    out = []
    for target in targets:
        out.extend(_flat(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else [target])
    return out


def _is_own(target) -> bool:
    return (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
            and target.value.id in ("self", "cls"))


def wiring_after_construction(source: str, fields: set[str]) -> list[str]:
    """Each ``x.name = ...`` of ``source`` that sets another object's attribute (not a record field)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in _flat(targets):
            if not isinstance(target, ast.Attribute) or _is_own(target):
                continue
            text = ast.unparse(target)
            if target.attr not in fields and text not in FOREIGN:
                found.append(f"{node.lineno}: {text}")
    return found


def test_wiring_no_engine_module_sets_another_parts_attributes():
    fields = _record_fields()
    offenders = [f"{path.relative_to(ENGINE)}:{line}" for path in sorted(ENGINE.rglob("*.py"))
                 for line in wiring_after_construction(path.read_text(), fields)]
    assert offenders == []


def test_wiring_check_catches_a_part_set_from_outside():
    # The wirings this test was written against: each would have to come in through a constructor.
    fields = _record_fields()
    source = ("def open_pool(server, backend):\n    server.backend = backend\n"
              "def wire(self):\n    self.dispatcher.clients = lambda: self.table.attached\n"
              "def tier(index, tier):\n    index.on_ready = tier.on_ready\n")
    assert wiring_after_construction(source, fields) == [
        "2: server.backend", "4: self.dispatcher.clients", "6: index.on_ready"]


def test_wiring_check_lets_a_record_update_its_state():
    fields = _record_fields()
    source = "def detach(client, entry):\n    client.is_attached = False\n    entry.refs -= 1\n"
    assert wiring_after_construction(source, fields) == []
