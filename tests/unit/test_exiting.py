"""`exit_without_finalizing` keeps what a normal exit does before finalization: non-daemon
threads finish, atexit runs, the streams are flushed, and the code is the exit status."""

from __future__ import annotations

import subprocess
import sys

# The thread is still blocked (on stdin) when the exit starts; the parent releases it only
# after reading "exiting", so its file exists only if the exit waited for it.
CHILD = """
import atexit, sys, threading
from pathlib import Path
from dilonode.cli.fast_exit import exit_without_finalizing

out = Path(sys.argv[1])

def writer():
    sys.stdin.read()
    out.with_suffix(".thread").write_text("finished")

threading.Thread(target=writer).start()  # not a daemon
atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
print("exiting", flush=True)
sys.stdout.write("buffered, no newline")
exit_without_finalizing(7)
"""


def test_exit_waits_for_threads_runs_atexit_and_flushes(tmp_path):
    base = tmp_path / "child"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(base)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "exiting\n"
        proc.stdin.close()
        assert proc.wait(timeout=60) == 7, proc.stderr.read()
        assert proc.stdout.read() == "buffered, no newline"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert base.with_suffix(".thread").read_text() == "finished"
    assert base.with_suffix(".atexit").read_text() == "ran"


def test_the_program_exits_with_the_commands_status(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "dilonode.cli", "status", "--help"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "usage" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "dilonode.cli", "identity",
                          str(tmp_path / "missing.key")], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("dilonode: "), bad.stderr
