"""Dependencies point one way: the pure core imports no I/O and nothing above it.

algo and wire depend on nothing of ours (wire may read the protocol version); allreduce on
algo and wire; train never imports networking. Checked on the source, so a violation fails
here before it ships.
"""

import ast
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


def test_the_checker_sees_violations(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import asyncio\nfrom dilonode.sim import simulate\n")
    assert imports_of(bad) == {"asyncio", "dilonode.sim"}
