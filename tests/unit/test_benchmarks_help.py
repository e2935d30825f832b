"""Every benchmark module imports and answers `--help` without running anything, and
benchmarks/README.md lists it: all in this process (import and argparse only)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("sim", "loopback", "testbed", "gpu", "micro")


def benchmark_modules() -> list[str]:
    names = []
    for folder in FOLDERS:
        path = ROOT / "benchmarks" / folder
        names += [f"benchmarks.{folder}.{m.name}" for m in pkgutil.iter_modules([str(path)])]
    return sorted(names)


MODULES = benchmark_modules()


def test_every_folder_has_benchmarks():
    assert {name.split(".")[1] for name in MODULES} == set(FOLDERS)
    folders = {p.name for p in (ROOT / "benchmarks").iterdir()
               if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {*FOLDERS, "harness"}


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_answers_help(name, monkeypatch, capsys):
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code in (0, None)
    assert capsys.readouterr().out.startswith("usage:")


@pytest.mark.parametrize("name", MODULES)
def test_the_index_lists_the_benchmark(name):
    index = (ROOT / "benchmarks" / "README.md").read_text()
    assert f"python -m {name}" in index, f"benchmarks/README.md has no line for {name}"
