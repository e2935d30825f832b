"""`LoopThread`: an asyncio event loop in a daemon thread, for the parts of a node that run
on asyncio (data plane, state sync, status) while training runs in the main thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ['LoopThread']

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop (uvloop when installed and wanted) in a daemon thread."""

    def __init__(self, name: str = "dilonode-net", *, use_uvloop: bool = True) -> None:
        self.name = name
        self.use_uvloop = use_uvloop
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("LoopThread.start: already started")
        self.loop = _new_loop(self.use_uvloop)
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        assert self.loop is not None
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop from any other thread."""
        if self.loop is None:
            coro.close()
            raise RuntimeError("LoopThread.submit: not started")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and block the calling thread for its result."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 2.0) -> None:
        """Cancel what still runs on the loop (rounds abandoned at shutdown), let it unwind
        for up to `timeout` s, then stop the loop: a task destroyed while pending would
        otherwise be logged, after the node's last words, at interpreter exit."""
        if self.loop is None or self._thread is None:
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.run(_cancel_all(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()
        self.loop, self._thread = None, None


async def _cancel_all() -> None:
    """Cancel every other task of the running loop and wait for them to finish."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
