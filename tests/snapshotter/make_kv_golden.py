"""Write ``data/kv_batches_vllm.json``: KV event batches encoded by vLLM's own classes and
encoder (what its ZMQ publisher sends), as hex, for the snapshotter's decoder test. Run with the
vLLM venv's interpreter::

    /root/.cache/bear/vllm-venv/bin/python tests/snapshotter/make_kv_golden.py
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def stored(hashes: list, medium: str = "GPU", group: int = 0) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[1] * (16 * len(hashes)), block_size=16,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def main() -> None:
    enc = msgspec.msgpack.Encoder()
    big = (1 << 64) - 5
    digest = bytes(range(32))
    batches = [
        KVEventBatch(ts=1.0, events=[stored([1, 2, big]), BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0)]),
        KVEventBatch(ts=2.0, events=[stored([digest]), AllBlocksCleared(), stored([7])]),
        KVEventBatch(ts=3.0, events=[stored([8], medium="CPU"), stored([9], group=1), stored([10])]),
    ]
    out = [{"payload": enc.encode(b).hex()} for b in batches]
    path = Path(__file__).resolve().parent / "data" / "kv_batches_vllm.json"
    path.write_text(json.dumps(out))
    print(f"{len(out)} batches -> {path}")


if __name__ == "__main__":
    main()
