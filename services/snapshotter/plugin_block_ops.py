"""The vLLM plugin's block-pool log (``BEAR_SNAPSHOT_BLOCK_OPS=1``): wraps one BlockPool's
queue-changing methods and records what each did, for the snapshotter's replica of the pool.
Imported into the engine process by ``bear_vllm_plugin``: stdlib only, no vLLM import."""

from __future__ import annotations

from typing import Any

# BEAR_SNAPSHOT_BLOCK_OPS=1: every record also carries what vLLM's BlockPool did since the last one
# (block_ops; None otherwise), in order, so that a reader can keep the free queue block by block
# (``bear.prefix.pool_replica``): (OP_POP, ids) blocks taken from the front (a cached one loses its
# hash), (OP_TOUCH, ids) free cached blocks a hit took out of the queue, (OP_PREPEND, ids) /
# (OP_APPEND, ids) freed blocks put at the front (uncached) / back (cached), (OP_CACHE, ids, names)
# blocks that got a hash (names: the digest's low 64 bits, as vLLM's int KV events carry them),
# (OP_EVICT, ids) hashes dropped without a pop, (OP_RESET,) the cache cleared, and in the first
# record and resync records (OP_DUMP, free queue ids front to back, cached ids, their names); and
# (OP_NAMES, request id, names: the digests' low 64 bits, 16 hex digits each) for every request
# added, its prompt's full blocks as vLLM hashed them (what its hits and later ones will look for).
OP_POP, OP_TOUCH, OP_PREPEND, OP_APPEND, OP_CACHE, OP_EVICT, OP_RESET, OP_DUMP, OP_NAMES = range(9)


def names_op(request: Any) -> tuple[int, str, str]:
    """``OP_NAMES`` of a request: its full blocks' names (each hash's last 8 bytes), as hex."""
    return (OP_NAMES, request.request_id, b"".join([h[-8:] for h in request.block_hashes]).hex())


def _name(block_hash: Any) -> int:
    """A cached block's hash (vLLM's BlockHashWithGroupId: digest + 4-byte group id) as the int
    vLLM's KV events carry: the digest's low 64 bits."""
    return int.from_bytes(block_hash[-12:-4], "big")


class BlockOps:
    """Wraps one BlockPool's queue-changing methods (instance attributes; the class stays vLLM's)
    and logs their effect. Installed only with BEAR_SNAPSHOT_BLOCK_OPS=1."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.ops: list[tuple[Any, ...]] = []
        ops = self.ops
        get_new, touch, free, cache = pool.get_new_blocks, pool.touch, pool.free_blocks, pool.cache_full_blocks
        evict, reset = pool.evict_blocks, pool.reset_prefix_cache

        def get_new_blocks(num_blocks: int) -> Any:
            ret = get_new(num_blocks)
            ops.append((OP_POP, tuple([b.block_id for b in ret])))
            return ret

        def touch_(blocks: Any) -> None:
            gone = tuple([b.block_id for b in blocks if b.ref_cnt == 0 and not b.is_null])
            touch(blocks)
            if gone:
                ops.append((OP_TOUCH, gone))

        def free_blocks(ordered_blocks: Any) -> None:
            blocks = list(ordered_blocks)
            first: list[int] = []
            last: list[int] = []
            for b in blocks:
                if b.ref_cnt == 1 and not b.is_null and (b.pool is None or b.pool is pool):
                    (first if b.block_hash is None or not pool.enable_caching else last).append(b.block_id)
            free(blocks)
            if first:
                ops.append((OP_PREPEND, tuple(first)))
            if last:
                ops.append((OP_APPEND, tuple(last)))

        def cache_full_blocks(request: Any, blocks: Any, num_cached_blocks: int, num_full_blocks: int,
                              *args: Any, **kwargs: Any) -> None:
            span = blocks[num_cached_blocks:num_full_blocks]
            before = [b.block_hash for b in span]
            cache(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)
            ids: list[int] = []
            names: list[int] = []
            for b, h in zip(span, before, strict=True):
                if b.block_hash is not None and b.block_hash is not h and not b.is_null:
                    ids.append(b.block_id)
                    names.append(_name(b.block_hash))
            if ids:
                ops.append((OP_CACHE, tuple(ids), tuple(names)))

        def evict_blocks(block_ids: Any) -> Any:
            cached = tuple([i for i in block_ids if pool.blocks[i].block_hash is not None])
            ret = evict(block_ids)
            if cached:
                ops.append((OP_EVICT, cached))
            return ret

        def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
            ok = reset(*args, **kwargs)
            if ok:
                ops.append((OP_RESET,))
            return ok

        pool.get_new_blocks, pool.touch, pool.free_blocks = get_new_blocks, touch_, free_blocks
        pool.cache_full_blocks, pool.evict_blocks = cache_full_blocks, evict_blocks
        pool.reset_prefix_cache = reset_prefix_cache

    def dump(self) -> tuple[Any, ...]:
        """The whole pool (O(blocks): first and resync records only)."""
        q = self.pool.free_block_queue
        ids = []
        b = q.fake_free_list_head.next_free_block
        while b is not None and b is not q.fake_free_list_tail:
            ids.append(b.block_id)
            b = b.next_free_block
        cached = [b for b in self.pool.blocks if b.block_hash is not None and not b.is_null]
        return (OP_DUMP, tuple(ids), tuple([b.block_id for b in cached]), tuple([_name(b.block_hash) for b in cached]))

    def take(self, dump: bool = False) -> tuple[Any, ...]:
        """The ops since the last call (then the whole pool, when ``dump``)."""
        out = tuple(self.ops)
        self.ops.clear()
        return (*out, self.dump()) if dump else out
