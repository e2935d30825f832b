"""The command line: help is instant (no torch), errors are one line with exit status 2."""

import subprocess
import sys


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "dilonode.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_does_not_import_torch():
    code = ("import sys\nfrom dilonode.cli import main as cli\ntry:\n    cli.main(['--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'hivemind' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "simulate" in proc.stdout


def test_bad_config_value_is_one_line_exit_2():
    proc = run("simulate", "--set", "diloco.num_fragments=0", "--steps", "1")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "diloco.num_fragments = 0" in lines[0]


def test_simulate_small_run_writes_report_and_plot(tmp_path):
    proc = run("simulate", "--steps", "4", "--workers", "2", "--out", str(tmp_path),
               "--set", "model.preset='nano'", "--set", "data.seq_len=32",
               "--set", "diloco.sync_every=2", "--set", "diloco.num_fragments=2",
               "--set", "eval_every=2", "--no-progress", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "final eval loss" in proc.stdout
    for name in ("report.json", "history.csv", "loss.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prepare_data_cli(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world " * 200)
    proc = run("prepare-data", str(src), str(tmp_path / "out"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "train.bin").exists()
    bad = run("prepare-data", str(tmp_path / "nope"), str(tmp_path / "out2"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_prepare_data_cli_reads_parquet_and_names_a_missing_column(tmp_path):
    import pytest

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"content": ["hello parquet world " * 20] * 50}),
                   tmp_path / "src" / "a.parquet", row_group_size=10)
    proc = run("prepare-data", str(tmp_path / "src"), str(tmp_path / "out"), "--no-progress",
               "--text-column", "content")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "train.bin").stat().st_size > 0
    bad = run("prepare-data", str(tmp_path / "src"), str(tmp_path / "out2"), "--no-progress")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "data.text_column = 'text': no such column" in lines[0]
