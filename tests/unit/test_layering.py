"""Dependencies point one way, checked on the source so a violation fails here first.

Every package of dilonode has a rule naming the packages of ours it may import (its own and
the root `dilonode` always); the pure core (`algo`, `wire`) and the sans-IO parts import no
I/O; no two modules import each other, directly or through others, counting deferred
imports and the packages a module's import runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).parents[2] / "dilonode"
IO_MODULES = {"asyncio", "socket", "hivemind", "aiohttp", "uvloop", "selectors", "ssl",
              "subprocess", "threading", "multiprocessing"}
NETWORK_MODULES = {"asyncio", "socket", "hivemind", "aiohttp", "uvloop", "selectors", "ssl"}

# package (or top-level module) -> the packages and modules of ours it may import
ALLOWED: dict[str, set[str]] = {
    "algo": set(),
    "wire": set(),
    "fmt": set(),
    "collective": {"algo"},
    "config": {"algo", "net.auth", "net.congestion"},
    "net": {"config", "wire"},
    "allreduce": {"algo", "wire", "net", "collective", "config"},
    "train": {"algo", "collective", "config"},
    "statesync": {"algo", "wire", "net", "config", "train"},
    "swarm": {"algo", "wire", "net", "config", "collective"},
    "status": {"collective", "net", "swarm", "fmt"},
    "sim": {"algo", "allreduce", "collective", "config", "train"},
    "node": {"algo", "allreduce", "collective", "config", "net", "statesync", "status",
             "swarm", "train", "wire"},
    "cli": {"algo", "allreduce", "collective", "config", "fmt", "net", "node", "sim",
            "statesync", "status", "swarm", "train", "wire"},
}
NO_IO = {"algo", "wire"}
NO_NETWORK = {"train", "sim"}
SANS_IO = ["allreduce/round.py", "allreduce/memnet.py", "statesync/plan.py",
           "statesync/bank.py", "statesync/protocol.py"]
MAX_TOP_LEVEL_MODULES = 4  # __init__ included: the rest lives in packages
MAX_MODULE_LINES = 900


def imports_of(path: Path) -> set[str]:
    """Absolute module names `path` imports, at the top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def unit_of(path: Path) -> str:
    """The rule a file of the package falls under: its package, or its top-level module."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def allowed(unit: str, name: str) -> bool:
    if name == "dilonode":
        return True
    inner = name.removeprefix("dilonode.")
    # `from dilonode.net import congestion` names the package on its way to the module.
    return any(inner == a or inner.startswith(a + ".") or a.startswith(inner + ".")
               for a in ALLOWED[unit] | {unit})


def package_files() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if p.name != "__init__.py" or p.parent != PKG)


def test_every_unit_has_a_rule():
    units = {unit_of(p) for p in package_files()}
    assert units == set(ALLOWED), f"units without a rule: {sorted(units - set(ALLOWED))}, " \
                                  f"rules without a unit: {sorted(set(ALLOWED) - units)}"


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_unit_imports_only_what_it_may(unit):
    files = [p for p in package_files() if unit_of(p) == unit]
    assert files, f"no modules found for dilonode/{unit}"
    for path in files:
        where = path.relative_to(PKG.parent)
        for name in imports_of(path):
            top = name.split(".")[0]
            if top == "dilonode":
                assert allowed(unit, name), f"{where} imports {name}"
            if unit in NO_IO:
                assert top not in IO_MODULES, f"{where} imports {name} (the pure core does no I/O)"
            if unit in NO_NETWORK:
                assert top not in NETWORK_MODULES, f"{where} imports {name} (no networking)"


@pytest.mark.parametrize("name", SANS_IO)
def test_sans_io_parts_do_no_io(name):
    """The round state machine, its in-memory network and the joiner's decisions are pure:
    they are unit-tested without sockets or clocks."""
    for imp in imports_of(PKG / name):
        assert imp.split(".")[0] not in IO_MODULES | {"time"}, f"{name} imports {imp}"
        assert imp not in {"dilonode.statesync.server", "dilonode.statesync.client",
                           "dilonode.statesync.link"}, f"{name} imports {imp}"


def test_the_checker_sees_violations(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncio\ndef f():\n    from dilonode.sim.training import simulate\n")
    assert imports_of(bad) == {"asyncio", "dilonode.sim.training"}
    assert not allowed("train", "dilonode.sim.training")
    assert allowed("train", "dilonode.train.model") and allowed("config", "dilonode.net.auth")
    assert not allowed("config", "dilonode.net.admission")


def module_graph() -> dict[str, set[str]]:
    """Every dilonode module -> the dilonode modules it imports, at the top or inside a
    function (a deferred import still closes a circle), parent packages included."""
    mods = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                parts = t.split(".")
                deps.update(p for i in range(1, len(parts) + 1)
                            if (p := ".".join(parts[:i])) in mods and p != name)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_through_others():
    assert circles(module_graph()) == []


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_shared_formatting_helpers_use_the_standard_library_only():
    assert not module_graph()["dilonode.fmt"]
    assert imports_of(PKG / "fmt.py") <= {"__future__", "collections.abc"}


def test_the_package_is_small_modules_in_packages():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"top-level modules: {top}"
    long = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_status_tables_import_no_command_code():
    code = ("import sys\nimport dilonode.status.table\n"
            "assert 'dilonode.cli.commands' not in sys.modules, 'dilonode.cli.commands imported'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
