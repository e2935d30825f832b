"""Waiting for a condition with a deadline, the only way tests synchronise with other
threads and processes: poll `predicate` every `interval` seconds until it returns something
truthy, and fail naming `what` was waited for once `timeout` seconds have passed.

    wait_until(lambda: path.exists(), 30, what=f"{path} written")
    await wait_until_async(lambda: plane.stats["frames_in"] == 2, 10, what="two frames in")
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["WaitTimeout", "wait_until", "wait_until_async"]

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A condition a test waited for did not hold within its deadline."""


def _timed_out(what: str, timeout: float, last: object) -> WaitTimeout:
    return WaitTimeout(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


def wait_until(predicate: Callable[[], T], timeout: float, *, interval: float = 0.1,
               what: str) -> T:
    """`predicate()`'s first truthy value, polled every `interval` s; `WaitTimeout` after
    `timeout` s. The predicate is asked once more at the deadline, so a slow one still
    counts what it saw last."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise _timed_out(what, timeout, got)
        time.sleep(min(interval, left))


async def wait_until_async(predicate: Callable[[], T], timeout: float, *,
                           interval: float = 0.01, what: str) -> T:
    """`wait_until` inside an event loop: the loop runs between polls (on its own clock)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = predicate()
        if got:
            return got
        left = deadline - loop.time()
        if left <= 0:
            raise _timed_out(what, timeout, got)
        await asyncio.sleep(min(interval, left))
