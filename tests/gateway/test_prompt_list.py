"""``prompt_list.merged``: several prompts' answer streams as one, in arrival order; a stream's
failure reaches the reader as that failure (not as a stream that ended without its terminal
message), and leaving the merged iterator cancels and closes the streams still running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bear.gateway.prompt_list import merged
from bear.protocol.replies import Chunk, Reply


class Boom(RuntimeError):
    pass


async def chunks(n: int, gate: asyncio.Event | None = None, fail: bool = False,
                 closed: list[bool] | None = None) -> AsyncIterator[Reply]:
    try:
        for k in range(n):
            yield Chunk(query_id="q", seq=k, text=str(k))
            if gate is not None:
                await gate.wait()
        if fail:
            raise Boom("engine went away")
    finally:
        if closed is not None:
            closed.append(True)


async def test_every_message_of_every_stream_in_order_per_stream() -> None:
    got = [(i, m.seq) async for i, m in merged([chunks(3), chunks(2), chunks(0)])]  # type: ignore[union-attr]
    assert sorted(got) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    for i in (0, 1):
        assert [s for j, s in got if j == i] == sorted(s for j, s in got if j == i)


@pytest.mark.parametrize("ahead", [0, 3])
async def test_a_failing_stream_raises_its_own_exception(ahead: int) -> None:
    """Whatever the other streams still send (``ahead`` messages queued before the failure)."""
    gate = asyncio.Event()
    seen = []
    with pytest.raises(Boom, match="engine went away"):
        async for i, _m in merged([chunks(ahead + 1, gate), chunks(1, fail=True)]):
            seen.append(i)
            gate.set()
    assert 1 in seen


async def test_leaving_early_cancels_and_closes_the_rest() -> None:
    closed: list[bool] = []
    never = asyncio.Event()
    it = merged([chunks(2, never, closed=closed), chunks(2, never, closed=closed)])
    async for _ in it:
        break
    await it.aclose()  # type: ignore[attr-defined]
    assert closed == [True, True]
