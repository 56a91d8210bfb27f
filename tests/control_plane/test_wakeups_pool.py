"""A long poll's reads run in a thread pool of their own (``agent_wait_threads``), so a node learns
of a change while every request thread is taken (bench/checkpoint_scale.py: heartbeats waiting on a
failed attempt's row held up to 36 of the 40 request threads, and the last nodes heard of the next
attempt seconds late)."""

from __future__ import annotations

import asyncio
import threading

import anyio.to_thread

from control_plane.app import create_app
from control_plane.scheduler.loops import Loops
from control_plane.settings import Settings
from control_plane.wakeups import Wakeups


async def _answer_with_request_threads_taken(url: str, threads: int | None) -> str | None:
    anyio.to_thread.current_default_thread_limiter().total_tokens = 2
    wakeups = Wakeups(url, max_waiters=10, threads=threads)
    await wakeups.start()
    release = threading.Event()
    taken = [asyncio.create_task(anyio.to_thread.run_sync(release.wait)) for _ in range(2)]
    await asyncio.sleep(0.1)  # both request threads are blocked now
    try:
        return await asyncio.wait_for(wakeups.wait("node-1", lambda: "new attempt", 5.0), 2.0)
    except TimeoutError:
        return None
    finally:
        release.set()
        await asyncio.gather(*taken)
        await wakeups.stop()


def test_a_long_poll_answers_while_every_request_thread_is_taken(fresh_database_url: str) -> None:
    assert asyncio.run(_answer_with_request_threads_taken(fresh_database_url, threads=1)) == "new attempt"
    # The control: in the request threads' pool, the same read waits for one of them.
    assert asyncio.run(_answer_with_request_threads_taken(fresh_database_url, threads=None)) is None


def test_the_app_gives_the_node_long_polls_their_pool_and_the_connections_for_it(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"agent_wait_threads": 3}))
    assert app.state.wakeups._threads == 3 and app.state.slot_wakeups._threads is None
    pool = app.state.engine.pool
    # Every thread that may hold a connection at once is covered: requests, answers, loops, the pass runner.
    assert pool.size() + pool._max_overflow >= settings.api_threads + 3 + Loops.THREADS + 1
    app.state.engine.dispose()
