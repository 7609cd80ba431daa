"""The block pool rebuilt from the plugin's block-op log (bear.prefix.pool_replica): vLLM's free
queue rules (pops from the front evict, hits leave the queue, uncached blocks go back to the
front and cached ones to the back) and its self-checks. The real-vLLM check is in
tests/vllm/test_vllm_prefix.py (every step's free count, the cache against the KV events)."""

from __future__ import annotations

import pytest

from bear.prefix.pool_replica import (
    OP_APPEND,
    OP_CACHE,
    OP_DUMP,
    OP_EVICT,
    OP_POP,
    OP_PREPEND,
    OP_RESET,
    OP_TOUCH,
    BlockPoolReplica,
    ReplicaMismatch,
)


def test_queue_rules_and_eviction_by_pops() -> None:
    r = BlockPoolReplica(7)  # blocks 1..6 free (0 is vLLM's null block)
    assert list(r.queue) == [1, 2, 3, 4, 5, 6] and r.free_blocks == 6
    r.apply_all([(OP_POP, (1, 2, 3)), (OP_CACHE, (1, 2), (11, 12))])  # a request's two full blocks, one partial
    r.apply_all([(OP_PREPEND, (3,)), (OP_APPEND, (2, 1))])  # freed in reverse: uncached first, cached last
    assert list(r.queue) == [3, 4, 5, 6, 2, 1] and r.positions()[2] == 4
    assert r.chain([11, 12, 13], 5) == [1, 2] and r.chain([12], 5) == [2] and r.chain([11, 12], 1) == [1]
    r.apply((OP_TOUCH, (1,)))  # a hit on the first block takes it out of the queue
    assert list(r.queue) == [3, 4, 5, 6, 2] and r.free_blocks == 5
    r.apply((OP_POP, (3, 4, 5, 6, 2)))  # the fifth allocation evicts block 2's hash
    assert r.cached_names() == {11: 1} and r.chain([11, 12], 5) == [1]
    r.check_free(0)
    with pytest.raises(ReplicaMismatch, match="4 in the engine"):
        r.check_free(4)


def test_disagreements_are_caught() -> None:
    r = BlockPoolReplica(5)
    with pytest.raises(ReplicaMismatch, match="front is 1"):
        r.apply((OP_POP, (2,)))
    r = BlockPoolReplica(5)
    with pytest.raises(ReplicaMismatch, match="not a free cached block"):
        r.apply((OP_TOUCH, (1,)))  # free but never cached
    with pytest.raises(ReplicaMismatch, match="already free"):
        r.apply((OP_APPEND, (3,)))
    with pytest.raises(ReplicaMismatch, match="unknown op"):
        r.apply((99,))
    with pytest.raises(ValueError):
        BlockPoolReplica(0)


def test_dump_evict_and_reset() -> None:
    r = BlockPoolReplica(9)
    r.apply((OP_DUMP, (5, 1, 2), (1, 2, 7), (21, 22, 27)))  # a resync: the queue and every cached block
    assert list(r.queue) == [5, 1, 2] and r.cached_names() == {21: 1, 22: 1, 27: 1}
    assert r.chain([21, 22, 27], 9) == [1, 2, 7]  # block 7 is cached and held: part of the hit
    r.apply((OP_EVICT, (2,)))
    assert r.chain([21, 22, 27], 9) == [1]
    r.apply((OP_CACHE, (8, 6), (22, 22)))  # one name on two blocks: the lowest id serves the chain
    assert r.chain([21, 22], 9) == [1, 6] and r.cached_names()[22] == 2
    with pytest.raises(ReplicaMismatch, match="out of range"):
        r.apply((OP_CACHE, (9,), (1,)))
    r.apply((OP_RESET,))
    assert r.cached_names() == {} and r.chain([21], 9) == []
