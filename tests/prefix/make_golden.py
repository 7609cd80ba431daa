"""Write ``data/block_hashes_golden.json.gz``: vLLM's own block hashes of fixed token sequences,
computed by vLLM's request block hasher (``get_request_block_hasher`` over a ``Request``) and
converted as its KV events convert them (``maybe_convert_block_hash``).

Run with the vLLM venv's interpreter (one process per seed: ``NONE_HASH`` is derived from
PYTHONHASHSEED when the engine starts)::

    /root/.cache/bear/vllm-venv/bin/python tests/prefix/make_golden.py
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "block_hashes_golden.json.gz"
ALGOS = ("sha256", "sha256_cbor")
BLOCK_SIZES = (1, 16, 128)
SEEDS = (None, "0", "12345")  # None: PYTHONHASHSEED unset (vLLM's fixed default seed)


def sequences() -> list[list[int]]:
    rng = random.Random(7)
    return [
        [],
        [5],
        list(range(16)),
        list(range(17)),
        [rng.randrange(0, 151_936) for _ in range(300)],
        [rng.randrange(0, 2**31 - 1) for _ in range(64)],  # ids beyond 2**16: other pickle opcodes
        [0] * 40 + [255] * 40 + [256] * 40 + [65_535] * 40 + [65_536] * 40,
    ]


def child(algo: str) -> list[dict]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as k
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    k.init_none_hash(fn)
    out = []
    for bs in BLOCK_SIZES:
        hasher = k.get_request_block_hasher(bs, fn)
        for i, toks in enumerate(sequences()):
            req = Request(f"r{i}", list(toks), SamplingParams(max_tokens=1), None, block_hasher=hasher)
            out.append({"algo": algo, "block_size": bs, "seed": os.environ.get("PYTHONHASHSEED"), "tokens": toks,
                        "hashes": [k.maybe_convert_block_hash(h) for h in req.block_hashes],
                        "digests": [bytes(h).hex() for h in req.block_hashes] if bs == 16 else None})
    return out


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(child(sys.argv[1])))
        return
    rows = []
    for seed in SEEDS:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        for algo in ALGOS:
            res = subprocess.run([sys.executable, __file__, algo], env=env, check=True, capture_output=True, text=True)
            rows.extend(json.loads(res.stdout.strip().splitlines()[-1]))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    vllm_version = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"],
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with gzip.open(OUT, "wt") as f:
        json.dump({"vllm": vllm_version, "cases": rows}, f)
    print(f"{len(rows)} cases -> {OUT}")


if __name__ == "__main__":
    main()
