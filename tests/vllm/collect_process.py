"""A NATS subscriber in a process of its own: ``python collect_process.py URL OUT [--any] SUBJECT...``.

The real-vLLM tests check every state a snapshotter publishes. A subscriber on the test's event
loop, beside the snapshotter, reads nothing while the snapshotter catches up in a burst, and the
server closes it as a slow consumer (a run here: ``unexpected EOF`` after seq 1,630 of 12,153).
Here it reads on its own. It prints ``ready`` once subscribed; then it reads one line on stdin,
the last seq the snapshotter published, waits until every subject has delivered it (``--any``:
until one has — a state goes out either in full or as a delta; one publisher's messages arrive in
order, so the others' earlier ones are in by then) (an hour at most: a hang bound), writes each subject's messages to ``OUT/<n>.bin`` (4-byte big-endian
length, then the bytes), what befell its connection (disconnects, reconnects, errors such as a
slow-consumer close: core NATS then drops what was sent meanwhile) to ``OUT/events.json``, and
prints ``done``."""

from __future__ import annotations

import asyncio
import json
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from nats.aio.msg import Msg

from bear.protocol.codec import unpack_map


async def main(url: str, out: Path, subjects: list[str], any_subject: bool = False) -> None:
    events: list[dict[str, object]] = []

    def event(what: str) -> Callable[..., Awaitable[None]]:
        async def cb(*args: object) -> None:
            events.append({"time": time.time(), "event": what, "detail": " ".join(map(repr, args))})
        return cb

    nc = await nats.connect(url, max_reconnect_attempts=-1, disconnected_cb=event("disconnected"),
                            reconnected_cb=event("reconnected"), error_cb=event("error"))
    got: dict[str, list[bytes]] = {s: [] for s in subjects}
    top: dict[str, int] = {s: -1 for s in subjects}
    changed = asyncio.Event()

    def on_msg(subject: str) -> Callable[[Msg], Awaitable[None]]:
        async def cb(msg: Msg) -> None:
            got[subject].append(msg.data)
            top[subject] = max(top[subject], int(unpack_map(msg.data).get("seq", -1)))
            changed.set()
        return cb

    for s in subjects:
        await nc.subscribe(s, cb=on_msg(s), pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.flush()
    print("ready", flush=True)
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    last = int(line)

    async def all_in() -> None:
        while (max if any_subject else min)(top.values()) < last:
            changed.clear()
            await changed.wait()

    await asyncio.wait_for(all_in(), 3600)
    seen = list(events)  # before draining: closing the connection calls disconnected_cb too
    await nc.drain()
    write_frames(out, [got[s] for s in subjects])
    (out / "events.json").write_text(json.dumps(seen))
    print("done", flush=True)


def write_frames(out: Path, streams: list[list[bytes]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for n, msgs in enumerate(streams):
        with (out / f"{n}.bin").open("wb") as f:
            for data in msgs:
                f.write(struct.pack(">I", len(data)))
                f.write(data)


if __name__ == "__main__":
    rest = sys.argv[3:]
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), [s for s in rest if s != "--any"], "--any" in rest))
