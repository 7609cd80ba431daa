"""``cancel_all``: shutdown must not hang on a task that loses a cancellation (Python 3.11's
``wait_for`` race) and must report one that never stops."""

from __future__ import annotations

import asyncio

import nats
import nats.aio.msg

from bear.runtime.nats_server import LocalNatsServer
from bear.runtime.shutdown import cancel_all, close_nats

from waiting import HANG_S, wait_until


async def test_a_task_that_swallows_one_cancellation_is_still_stopped() -> None:
    swallowed = 0
    started, never = asyncio.Event(), asyncio.Event()

    async def loop() -> None:
        nonlocal swallowed
        started.set()
        while True:
            try:
                await never.wait()
            except asyncio.CancelledError:
                if swallowed == 0:  # what wait_for does when its inner future completes at once
                    swallowed += 1
                    continue
                raise

    t = asyncio.create_task(loop())
    await started.wait()  # a task cancelled before its first step never runs
    left = await cancel_all([t], timeout_s=2.0, retry_s=0.05)
    assert left == []
    assert t.cancelled()
    assert swallowed == 1


async def test_a_task_that_never_stops_is_returned_after_the_timeout() -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    t = asyncio.create_task(stubborn(), name="stubborn")
    await started.wait()  # a task cancelled before its first step never runs
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    left = await asyncio.wait_for(cancel_all([t], timeout_s=0.3, retry_s=0.05), HANG_S)
    t1 = loop.time()
    assert left == [t]
    assert t1 >= t0 + 0.3  # it gave the task its whole timeout (on the loop's clock) before giving up
    print(f"cancel_all gave up {t1 - t0:.2f} s after it began (timeout 0.3 s)")  # with -s
    release.set()
    await t


async def test_crashed_and_finished_tasks_are_collected_without_raising() -> None:
    async def boom() -> None:
        raise RuntimeError("x")

    async def ok() -> int:
        return 1

    a, b = asyncio.create_task(boom()), asyncio.create_task(ok())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert await cancel_all([a, b]) == []
    assert isinstance(a.exception(), RuntimeError) and b.result() == 1


async def test_close_nats_delivers_what_was_held_and_is_bounded_when_the_server_is_gone(
    nats_server: LocalNatsServer,
) -> None:
    got: list[bytes] = []
    sub_nc = await nats.connect(nats_server.url)
    first, gate = asyncio.Event(), asyncio.Event()

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        first.set()
        await gate.wait()  # a slow handler: still busy with the first message when the drain begins
        got.append(msg.data)

    await sub_nc.subscribe("t.x", cb=on_msg)
    pub_nc = await nats.connect(nats_server.url)
    for i in range(5):
        await pub_nc.publish("t.x", bytes([i]))
    await pub_nc.flush()
    await close_nats(pub_nc)
    await asyncio.wait_for(first.wait(), HANG_S)

    async def open_gate_once_draining() -> None:
        await wait_until(lambda: sub_nc.is_draining or sub_nc.is_closed, what="the drain of the subscriber")
        gate.set()

    opener = asyncio.create_task(open_gate_once_draining())
    await close_nats(sub_nc)
    await opener
    assert pub_nc.is_closed and sub_nc.is_closed
    assert got == [bytes([i]) for i in range(5)]
    await close_nats(sub_nc)  # already closed: nothing to do

    # the server vanishes under a reconnecting client: closing still ends in bounded time
    nc = await nats.connect(nats_server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1)
    nats_server.stop()
    await wait_until(lambda: not nc.is_connected, what="the client to see the server gone")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.wait_for(close_nats(nc, timeout_s=1.0), HANG_S)  # returns: bounded, not hung
    print(f"close_nats without a server: {loop.time() - t0:.2f} s")  # with -s
    assert nc.is_closed
