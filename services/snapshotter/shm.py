"""Shared-memory ring of per-step records between the vLLM plugin (writer) and the snapshotter
(reader).

Stdlib only: the writer side is imported into the vLLM engine process, which must not pull in
anything heavy. Layout (little endian, one file under /dev/shm):

* header (4096 bytes): magic, layout version, slot count, slot size, generation, writer pid,
  heartbeat (ns, wall clock), records written, closed flag, a resync-request counter (the one
  word a reader writes: any change asks the plugin for a full record at its next step), then a
  marshal'ed metadata blob (engine config, vLLM version) guarded by its own seqlock.
* ``slot_count`` slots of ``slot_size`` bytes: ``[lock u64][index u64][length u32][pad u32]`` then
  the payload. ``lock`` is a seqlock: ``2*index+1`` while record ``index`` is being written,
  ``2*index+2`` once it is complete. A reader copies the payload and accepts it only if the lock
  read before and after the copy is the same even value for the index it wants: a half-written or
  overwritten record is never accepted.

Payloads are ``marshal`` (format 2) of tuples of str/int/float/bool/None: the cheapest copy that
CPython offers on the engine thread, stable across Python 3 versions for those types.
"""

from __future__ import annotations

import marshal
import mmap
import os
import struct
import time
from dataclasses import dataclass
from typing import Any

MAGIC = b"BEARSHM1"
LAYOUT_VERSION = 2
HEADER_BYTES = 4096
SLOT_HEADER_BYTES = 24
MARSHAL_VERSION = 2  # no back-references: faster to write than 4 for our tuples
DEFAULT_SLOT_COUNT = 256  # ≥ 0.5 s of steps: a reader starved for a while loses nothing
DEFAULT_SLOT_BYTES = 128 << 10  # a full 256-resident record is ~50 KiB; a delta ~0.2 KiB

# header field offsets
_OFF_MAGIC = 0
_OFF_VERSION = 8  # u32 layout version, u32 slot count
_OFF_SLOT_BYTES = 16
_OFF_GENERATION = 24
_OFF_PID = 32
_OFF_HEARTBEAT = 40
_OFF_COUNT = 48
_OFF_CLOSED = 56
_OFF_RESYNC = 64  # u64 written by readers (request_full), read by the writer every step
_OFF_META_LOCK = 72
_OFF_META_LEN = 80
_OFF_META = 88
_META_MAX = HEADER_BYTES - _OFF_META

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_SLOT_HEAD = struct.Struct("<QQII")


def shm_path(name: str) -> str:
    """The file that backs shared-memory region ``name`` (a bare name lives in /dev/shm)."""
    return name if "/" in name else os.path.join("/dev/shm", name)


def pid_namespace() -> int | None:
    """Inode of this process's pid namespace: a writer pid means something here only if equal."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


class RecordTooLarge(ValueError):
    """A record does not fit into one slot."""


class ShmWriter:
    """Single writer of the ring. Creating it replaces any previous region of the same name with a
    new file (new inode and generation), which is how readers notice an engine restart."""

    def __init__(
        self,
        name: str,
        *,
        slot_count: int = DEFAULT_SLOT_COUNT,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        meta: Any = None,
    ) -> None:
        if slot_count < 2 or slot_bytes <= SLOT_HEADER_BYTES:
            raise ValueError("need at least 2 slots of more than 24 bytes")
        self.path = shm_path(name)
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        self.capacity = slot_bytes - SLOT_HEADER_BYTES
        size = HEADER_BYTES + slot_count * slot_bytes
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, bytes(size), 0)  # allocate every page now, not on the engine thread later
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # page tables filled now too
            self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        mm = self._mm
        self.generation = time.time_ns()
        _U32.pack_into(mm, _OFF_VERSION, LAYOUT_VERSION)
        _U32.pack_into(mm, _OFF_VERSION + 4, slot_count)
        _U64.pack_into(mm, _OFF_SLOT_BYTES, slot_bytes)
        _U64.pack_into(mm, _OFF_GENERATION, self.generation)
        _U64.pack_into(mm, _OFF_PID, os.getpid())
        _U64.pack_into(mm, _OFF_HEARTBEAT, time.time_ns())
        self._count = 0
        self.set_meta(meta)
        mm[_OFF_MAGIC : _OFF_MAGIC + 8] = MAGIC  # last: the region is valid from here on
        os.replace(tmp, self.path)  # atomic: readers see the old region or the complete new one

    @property
    def count(self) -> int:
        return self._count

    def set_meta(self, meta: Any) -> None:
        """Publish the (rarely changing) metadata blob, seqlock-protected like a slot."""
        data = marshal.dumps(meta, MARSHAL_VERSION)
        if len(data) > _META_MAX:
            raise RecordTooLarge(f"metadata of {len(data)} bytes exceeds {_META_MAX}")
        mm = self._mm
        lock = _U64.unpack_from(mm, _OFF_META_LOCK)[0]
        _U64.pack_into(mm, _OFF_META_LOCK, lock | 1)
        _U32.pack_into(mm, _OFF_META_LEN, len(data))
        mm[_OFF_META : _OFF_META + len(data)] = data
        _U64.pack_into(mm, _OFF_META_LOCK, (lock | 1) + 1)

    def write(self, record: Any) -> int:
        """Append one record (marshal-able value); returns its index. Raises RecordTooLarge."""
        data = marshal.dumps(record, MARSHAL_VERSION)
        return self.write_bytes(data)

    def write_bytes(self, data: bytes) -> int:
        n = len(data)
        if n > self.capacity:
            raise RecordTooLarge(f"record of {n} bytes exceeds slot capacity {self.capacity}")
        idx = self._count
        off = HEADER_BYTES + (idx % self.slot_count) * self.slot_bytes
        mm = self._mm
        _SLOT_HEAD.pack_into(mm, off, 2 * idx + 1, idx, n, 0)  # odd lock: write in progress
        mm[off + SLOT_HEADER_BYTES : off + SLOT_HEADER_BYTES + n] = data
        _U64.pack_into(mm, off, 2 * idx + 2)  # even: complete
        self._count = idx + 1
        _U64.pack_into(mm, _OFF_COUNT, idx + 1)
        return idx

    def heartbeat(self) -> None:
        _U64.pack_into(self._mm, _OFF_HEARTBEAT, time.time_ns())

    def resync_requests(self) -> int:
        """The readers' resync-request counter (compare with the last value seen)."""
        return int(_U64.unpack_from(self._mm, _OFF_RESYNC)[0])

    def close(self, *, unlink: bool = False) -> None:
        """Mark the region closed (a clean engine shutdown) and unmap it."""
        if self._mm.closed:
            return
        _U32.pack_into(self._mm, _OFF_CLOSED, 1)
        self._mm.close()
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


@dataclass
class ReadResult:
    """Records read in one poll; ``skipped`` counts records overwritten before they could be read."""

    records: list[Any]
    skipped: int = 0
    torn_retries: int = 0


class ShmReader:
    """Reader of one generation of the ring. ``poll()`` returns every complete record not yet
    read, oldest first; ``replaced()`` tells when a new engine has created a new region."""

    def __init__(self, name: str, *, max_retries: int = 8) -> None:
        self.path = shm_path(name)
        self.max_retries = max_retries
        fd = os.open(self.path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
            self.inode = st.st_ino
            self._mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        mm = self._mm
        if mm[_OFF_MAGIC : _OFF_MAGIC + 8] != MAGIC:
            self._mm.close()
            raise ValueError(f"{self.path} is not a BEAR snapshot region (bad magic)")
        version = _U32.unpack_from(mm, _OFF_VERSION)[0]
        if version != LAYOUT_VERSION:
            self._mm.close()
            raise ValueError(f"{self.path}: layout version {version}, expected {LAYOUT_VERSION}")
        self.slot_count = _U32.unpack_from(mm, _OFF_VERSION + 4)[0]
        self.slot_bytes = _U64.unpack_from(mm, _OFF_SLOT_BYTES)[0]
        self.generation = _U64.unpack_from(mm, _OFF_GENERATION)[0]
        self.pid = _U64.unpack_from(mm, _OFF_PID)[0]
        self.next_index = 0

    # ---- header ------------------------------------------------------------------------------
    @property
    def count(self) -> int:
        return int(_U64.unpack_from(self._mm, _OFF_COUNT)[0])

    @property
    def heartbeat_s(self) -> float:
        return _U64.unpack_from(self._mm, _OFF_HEARTBEAT)[0] / 1e9

    @property
    def closed(self) -> bool:
        return bool(_U32.unpack_from(self._mm, _OFF_CLOSED)[0])

    def writer_alive(self) -> bool | None:
        """True/False when the writer's pid is visible in this pid namespace, None otherwise."""
        try:
            os.kill(int(self.pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def replaced(self) -> bool:
        """True when the path now names another region (engine restarted) or was removed."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def meta(self) -> Any:
        mm = self._mm
        for _ in range(self.max_retries * 8):
            lock = _U64.unpack_from(mm, _OFF_META_LOCK)[0]
            if lock & 1:
                time.sleep(0)
                continue
            n = _U32.unpack_from(mm, _OFF_META_LEN)[0]
            data = mm[_OFF_META : _OFF_META + min(n, _META_MAX)]
            if _U64.unpack_from(mm, _OFF_META_LOCK)[0] == lock:
                return marshal.loads(data)
        raise TimeoutError("metadata kept changing while being read")

    # ---- records -----------------------------------------------------------------------------
    def read_index(self, idx: int) -> tuple[bytes | None, int]:
        """(payload, torn retries) of record ``idx``; payload None if it is not (or no longer)
        complete in its slot."""
        off = HEADER_BYTES + (idx % self.slot_count) * self.slot_bytes
        mm = self._mm
        want = 2 * idx + 2
        retries = 0
        while True:
            lock, index, n, _ = _SLOT_HEAD.unpack_from(mm, off)
            if lock != want or index != idx or n > self.slot_bytes - SLOT_HEADER_BYTES:
                return None, retries
            data = mm[off + SLOT_HEADER_BYTES : off + SLOT_HEADER_BYTES + n]
            if _U64.unpack_from(mm, off)[0] == want:
                return data, retries
            retries += 1
            if retries > self.max_retries:
                return None, retries

    def poll(self, *, limit: int | None = None) -> ReadResult:
        res = ReadResult(records=[])
        count = self.count
        if count - self.next_index > self.slot_count:
            res.skipped += count - self.slot_count - self.next_index
            self.next_index = count - self.slot_count
        while self.next_index < count and (limit is None or len(res.records) < limit):
            data, retries = self.read_index(self.next_index)
            res.torn_retries += retries
            if data is None:
                if self.count - self.next_index >= self.slot_count or retries > self.max_retries:
                    res.skipped += 1  # overwritten while we were reading it: lost, move on
                    self.next_index += 1
                    continue
                break  # not yet complete (cannot happen for idx < count, but never spin)
            res.records.append(marshal.loads(data))
            self.next_index += 1
        return res

    def request_full(self) -> bool:
        """Ask the writer for a full record at its next step (bumps the header's resync counter).
        False when this process may not write the region (another user): the plugin's periodic
        full record then resynchronises the reader."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_ino != self.inode:
                return False  # replaced meanwhile: the new engine starts with a full record anyway
            cur = _U64.unpack(os.pread(fd, 8, _OFF_RESYNC))[0]
            os.pwrite(fd, _U64.pack((cur + 1) & 0xFFFFFFFFFFFFFFFF), _OFF_RESYNC)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def seek_latest(self) -> None:
        """Skip everything already written (a reader that only wants what comes next)."""
        self.next_index = self.count

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()
