"""One instance's prefix cache, mirrored from its KV events (``bear.kv.<instance>``): which
block hashes it holds, so that a prompt's hit there can be computed without asking it.

A mirror is a multiset of block names (vLLM may hold two blocks with the same hash; each one's
eviction is its own ``removed`` event). It trusts a stream only from a known point: a whole
state (``bear.kv.state/1``) of the publisher's epoch, then every events message in ``seq``
order. A missing ``seq``, another epoch, or events before any state leave it unsynced until the
next state arrives — the caller asks the publisher for one (``needs_resync``), as Dynamo's
indexer does with its workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from bear.protocol.messages import KvEvents, KvState

MAX_BLOCKS = 4_000_000  # more distinct cached blocks than any engine has: a forged or runaway stream


@dataclass
class MirrorStats:
    events: int = 0
    states: int = 0
    gaps: int = 0  # events messages missed (seq jumped)
    unknown_removals: int = 0  # a removal of a block the mirror did not hold (counted, ignored)
    overflows: int = 0


class PrefixMirror:
    def __init__(self, instance: str = "", max_blocks: int = MAX_BLOCKS) -> None:
        self.instance = instance
        self.max_blocks = max_blocks
        self.counts: dict[int, int] = {}
        self.epoch: str | None = None
        self.seq = -1  # the last events message applied
        self.synced = False
        self.complete = True  # the publisher's own stream had no unrecoverable loss
        self.stats = MirrorStats()
        self.resync_reason: str | None = "no state yet"
        self._parts: list[bytes] = []
        self._parts_of: tuple[str, int, int] | None = None  # (epoch, seq, parts) being assembled

    def __len__(self) -> int:
        return len(self.counts)

    def __contains__(self, h: int) -> bool:
        return h in self.counts

    @property
    def needs_resync(self) -> bool:
        return not self.synced

    # ------------------------------------------------------------------ feeds
    def offer(self, msg: KvEvents | KvState) -> None:
        """Apply one message of the stream (either kind)."""
        if isinstance(msg, KvState):
            self.install(msg)
        else:
            self.apply(msg)

    def apply(self, ev: KvEvents) -> bool:
        """Apply one events message; False when it cannot be (the mirror is then unsynced)."""
        if not self.synced:
            return False
        if ev.epoch != self.epoch:
            return self._lose(f"epoch {ev.epoch} (held {self.epoch})")
        if ev.seq <= self.seq:
            return True  # a duplicate delivery: already applied
        if ev.seq != self.seq + 1:
            self.stats.gaps += ev.seq - self.seq - 1
            return self._lose(f"events {self.seq + 1}..{ev.seq - 1} missed")
        self.seq = ev.seq
        self.stats.events += 1
        counts = self.counts
        for op in ev.ops:
            if op.kind == "stored":
                for h in op.hashes:
                    counts[h] = counts.get(h, 0) + 1
            elif op.kind == "removed":
                for h in op.hashes:
                    n = counts.get(h)
                    if n is None:
                        self.stats.unknown_removals += 1
                    elif n <= 1:
                        del counts[h]
                    else:
                        counts[h] = n - 1
            else:
                counts.clear()
        if len(counts) > self.max_blocks:
            self.stats.overflows += 1
            return self._lose(f"more than {self.max_blocks} cached blocks")
        return True

    def install(self, st: KvState) -> bool:
        """A whole state (or one part of it); True once a state is complete and installed."""
        key = (st.epoch, st.seq, st.parts)
        if st.part == 0:
            self._parts, self._parts_of = [], key
        elif self._parts_of != key or len(self._parts) != st.part:
            self._parts, self._parts_of = [], None  # a part out of order: wait for the next state
            return False
        self._parts.append(st.hashes)
        if st.part < st.parts - 1:
            return False
        data = b"".join(self._parts)
        self._parts, self._parts_of = [], None
        if len(data) // 8 > self.max_blocks:
            self.stats.overflows += 1
            return self._lose(f"a state of more than {self.max_blocks} blocks")
        counts: dict[int, int] = {}
        for k in range(0, len(data), 8):
            h = int.from_bytes(data[k:k + 8], "big")
            counts[h] = counts.get(h, 0) + 1
        self.counts = counts
        self.epoch, self.seq, self.complete = st.epoch, st.seq, st.complete
        self.synced, self.resync_reason = True, None
        self.stats.states += 1
        return True

    def _lose(self, why: str) -> bool:
        self.synced = False
        self.resync_reason = why
        return False

    def reset(self, why: str = "reset") -> None:
        self.counts.clear()
        self.epoch, self.seq = None, -1
        self._lose(why)

    # ------------------------------------------------------------------ queries
    def matched_blocks(self, hashes: Iterable[int]) -> int:
        """How many leading blocks of a prompt (its block names, in order) are cached here."""
        n = 0
        counts = self.counts
        for h in hashes:
            if h not in counts:
                break
            n += 1
        return n

    def dump(self) -> bytes:
        """The held blocks packed as a ``KvState`` carries them."""
        return b"".join(h.to_bytes(8, "big") * n for h, n in self.counts.items())
