"""`Held.run`: a call whose caller was cancelled while its thread ran, and that then fails, is seen
by nobody; its failure must not be logged as never retrieved when the future is collected (the
log of a later test caught one, from a corrupt tar shard under `on_error="skip"`)."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from aioloader.sources.cache.handles import Held


@pytest.mark.asyncio
async def test_a_failure_after_its_caller_left_is_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    held = Held()
    started, go = threading.Event(), threading.Event()

    def fails() -> None:
        started.set()
        go.wait(30)
        raise ValueError("the shard broke after its reader left")

    call = asyncio.ensure_future(held.run(fails))
    assert await asyncio.to_thread(started.wait, 30)  # the thread runs the call
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    go.set()
    busy = held._busy
    assert busy is not None
    await asyncio.wait([busy])  # the thread's call has ended, with its error
    held.release()  # after it ended: nothing waits on it any more
    del call, busy
    held._busy = None
    with caplog.at_level("ERROR"):
        gc.collect()
        await asyncio.sleep(0)
    assert [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()] == []


@pytest.mark.asyncio
async def test_a_caller_still_gets_its_calls_failure() -> None:
    held = Held()

    def fails() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await held.run(fails)
    held.release()
