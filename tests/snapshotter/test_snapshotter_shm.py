"""The shared-memory seqlock ring: complete records only, in order, overwrite and restart aware."""

from __future__ import annotations

import marshal
import os
import threading
import uuid
from collections.abc import Iterator

import pytest

from bear.snapshotter.shm import RecordTooLarge, ShmReader, ShmWriter, shm_path


@pytest.fixture
def name() -> Iterator[str]:
    n = f"bear-test-{uuid.uuid4().hex[:10]}"
    yield n
    for suffix in ("",):
        try:
            os.unlink(shm_path(n) + suffix)
        except FileNotFoundError:
            pass


def test_roundtrip_in_order_with_meta(name: str) -> None:
    w = ShmWriter(name, slot_count=4, slot_bytes=4096, meta={"config": {"block_size": 128}})
    r = ShmReader(name)
    assert r.meta() == {"config": {"block_size": 128}}
    for i in range(3):
        w.write((i, "x" * i))
    res = r.poll()
    assert res.records == [(0, ""), (1, "x"), (2, "xx")] and res.skipped == 0
    assert r.poll().records == []
    assert r.writer_alive() is True and not r.closed and r.pid == os.getpid()
    w.close()
    assert r.closed


def test_overwritten_records_are_counted_not_returned_twice(name: str) -> None:
    w = ShmWriter(name, slot_count=4, slot_bytes=4096)
    r = ShmReader(name)
    for i in range(10):
        w.write(i)
    res = r.poll()
    assert res.records == [6, 7, 8, 9]
    assert res.skipped == 6


def begin_torn_write(w: ShmWriter, data: bytes) -> None:
    """A writer that dies in the middle of a record: the next slot's lock is left odd and only
    half of the bytes are in (the ring layout of bear.snapshotter.shm)."""
    from bear.snapshotter import shm

    idx = w._count
    off = shm.HEADER_BYTES + (idx % w.slot_count) * w.slot_bytes
    shm._SLOT_HEAD.pack_into(w._mm, off, 2 * idx + 1, idx, len(data), 0)
    w._mm[off + shm.SLOT_HEADER_BYTES : off + shm.SLOT_HEADER_BYTES + len(data) // 2] = data[: len(data) // 2]
    w._count = idx + 1
    shm._U64.pack_into(w._mm, shm._OFF_COUNT, idx + 1)


def test_half_written_record_is_never_returned(name: str) -> None:
    w = ShmWriter(name, slot_count=4, slot_bytes=4096)
    r = ShmReader(name)
    w.write("complete")
    begin_torn_write(w, marshal.dumps(("torn", "y" * 100)))
    res = r.poll()
    assert res.records == ["complete"]
    assert r.poll().records == []  # still refused on the next poll


def test_too_large_record_raises(name: str) -> None:
    w = ShmWriter(name, slot_count=2, slot_bytes=128)
    with pytest.raises(RecordTooLarge):
        w.write("z" * 500)


def test_new_region_is_detected(name: str) -> None:
    ShmWriter(name, slot_count=2, slot_bytes=256)
    r = ShmReader(name)
    assert not r.replaced()
    w2 = ShmWriter(name, slot_count=2, slot_bytes=256)
    assert r.replaced()
    assert ShmReader(name).generation == w2.generation


def test_concurrent_writer_never_yields_a_torn_record(name: str) -> None:
    """A writer thread hammers a tiny ring; every record the reader accepts must be intact and
    indices must increase."""
    w = ShmWriter(name, slot_count=2, slot_bytes=64 * 1024)
    r = ShmReader(name)
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            w.write((i, str(i) * (1000 + i % 5000)))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    seen: list[int] = []
    try:
        while len(seen) < 300:
            for idx, body in r.poll().records:
                assert body == str(idx) * (1000 + idx % 5000)
                seen.append(idx)
    finally:
        stop.set()
        t.join()
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_reader_asks_the_writer_for_a_full_record(name: str) -> None:
    w = ShmWriter(name, slot_count=4, slot_bytes=4096, meta={"config": {}})
    r = ShmReader(name)
    n0 = w.resync_requests()
    assert r.request_full() and r.request_full()
    assert w.resync_requests() == n0 + 2
    assert r.meta() == {"config": {}}  # the counter does not touch the metadata
    w.close()
    w2 = ShmWriter(name, slot_count=4, slot_bytes=4096)  # a restarted engine: the old reader's
    assert r.replaced() and not r.request_full()  # request would go to a region it never read
    assert w2.resync_requests() == 0
    w2.close()
