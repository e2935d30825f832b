"""Dependencies point one way: the pure core imports no I/O and nothing above it.

algo and wire depend on nothing of ours (wire may read the protocol version); allreduce on
algo and wire; train never imports networking. Checked on the source, so a violation fails
here before it ships.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).parents[2] / "dilonode"
IO_MODULES = {"asyncio", "socket", "hivemind", "aiohttp", "uvloop", "selectors", "ssl",
              "subprocess", "threading", "multiprocessing"}
ALLOWED_OURS = {
    "algo": {"dilonode.algo"},
    "wire": {"dilonode.wire", "dilonode"},
    "train": {"dilonode.train", "dilonode.algo", "dilonode.config", "dilonode.collective"},
}
NO_IO = {"algo", "wire"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _files(layer: str) -> list[Path]:
    return sorted((PKG / layer).glob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED_OURS))
def test_layer_imports_only_what_it_may(layer):
    assert _files(layer), f"no modules found in dilonode/{layer}"
    for path in _files(layer):
        for name in imports_of(path):
            if name == "dilonode" or name.startswith("dilonode."):
                ok = any(name == a or name.startswith(a + ".") for a in ALLOWED_OURS[layer]
                         if a != "dilonode") or (name == "dilonode" and "dilonode"
                                                 in ALLOWED_OURS[layer])
                assert ok, f"{path.relative_to(PKG.parent)} imports {name}"
            if layer in NO_IO:
                assert name.split(".")[0] not in IO_MODULES, \
                    f"{path.relative_to(PKG.parent)} imports {name} (the pure core does no I/O)"


def test_sans_io_round_does_no_io():
    for name in ("round.py", "memnet.py"):
        for imp in imports_of(PKG / "allreduce" / name):
            assert imp.split(".")[0] not in IO_MODULES | {"time"}, f"{name} imports {imp}"


def test_sans_io_state_sync_parts_do_no_io():
    """Manifests, the fetch plan and the chunk bank are pure: the joiner's decisions are
    unit-tested without sockets."""
    for name in ("plan.py", "bank.py", "protocol.py"):
        for imp in imports_of(PKG / "statesync" / name):
            assert imp.split(".")[0] not in IO_MODULES, f"statesync/{name} imports {imp}"
            assert imp not in {"dilonode.statesync.service", "dilonode.statesync.link"}, \
                f"statesync/{name} imports {imp}"


def test_the_checker_sees_violations(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncio\nfrom dilonode.sim import simulate\n")
    assert imports_of(bad) == {"asyncio", "dilonode.sim"}


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


def reaches(graph: dict[str, set[str]], src: str, dst: str) -> bool:
    seen, todo = {src}, [src]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt == dst:
                return True
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return False


def test_commands_status_table_and_local_swarm_import_no_circle():
    graph = module_graph()
    trio = ["dilonode.commands", "dilonode.status.table", "dilonode.swarm.local"]
    for a in trio:
        for b in trio:
            if a != b and reaches(graph, a, b):
                assert not reaches(graph, b, a), f"{a} and {b} import each other"
    # The shared formatting helpers sit below everything: stdlib only.
    assert not graph["dilonode.fmt"]
    assert imports_of(PKG / "fmt.py") <= {"__future__", "collections.abc"}


def test_the_circle_check_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert reaches(graph, "a", "c") and reaches(graph, "c", "a")
    assert not reaches(graph, "a", "d")


def test_status_tables_import_no_command_code():
    code = ("import sys\nimport dilonode.status.table\n"
            "assert 'dilonode.commands' not in sys.modules, 'dilonode.commands imported'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
