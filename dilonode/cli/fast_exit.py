"""Ending a dilonode process without Python's interpreter finalization.

A node's process holds torch, hivemind and their modules; tearing them down at exit took
1.5-1.6 s per process on the 2-core box (`benchmarks/loopback/exit_time.py`: a lone node's summary
to its exit; 0.1 s without), after everything the node owns was already closed and
written. gloo can
also abort in a C++ destructor during that teardown (see `exit_without_finalizing`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_without_finalizing"]


def exit_without_finalizing(code: int) -> NoReturn:
    """End the process with `code`, doing Python's exit work but not its finalization.

    What a normal exit does first still happens, in its order: non-daemon threads are
    joined (a checkpoint being written finishes), then atexit runs (logging flushes,
    multiprocessing children are reaped, temporary directories go), then the standard
    streams are flushed. Skipped is only the teardown of modules and objects that follows.
    That teardown is also where gloo can abort, after `destroy_process_group` and with no
    Python frame left ("terminate called without an active exception": SIGABRT; 1 in 140
    runs of three processes in tests/integration/gloo_reference.py), turning a rank that
    finished cleanly into a failure.
    """
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
