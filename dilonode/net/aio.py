"""Small asyncio helpers the node's connections share."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

__all__ = ["bounded"]


async def bounded(aw: Awaitable[object], timeout: float) -> bool:
    """Await `aw` for at most `timeout` s (cancelling it after); True if it finished.

    Never raises what `aw` raised and never waits longer, so closing cannot hang.
    """
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout))
    if not done:
        task.cancel()
        return False
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
    return True
