"""The load of a real-vLLM test in a process of its own: ``python load_process.py SPEC OUT``.

The test process runs the snapshotter, whose poll loop must keep up with the engine's ring; an
HTTP load generator on the same event loop stalls it on a loaded host (the ring then overwrites
records: issue 23). Here the load has its own interpreter, and the test waits for its exit.
SPEC is JSON ``{"base_url", "kind": "load" | "chat", "params": {...}}`` (``harness.Load`` or
``harness.ChatSessions`` fields); OUT receives the per-request results as JSON (chat requests
carry the ``messages`` sent, which the test tokenises)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the harness's helpers
from harness import ChatSessions, Load, run_chat_sessions, run_load


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    params = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["params"].items()}
    if spec["kind"] == "chat":
        results = asyncio.run(run_chat_sessions(spec["base_url"], ChatSessions(**params), None))
    else:
        results = asyncio.run(run_load(spec["base_url"], Load(**params)))
    tmp = Path(out_path + ".part")
    tmp.write_text(json.dumps(results))
    tmp.replace(out_path)  # whole or absent: the test reads it after the exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
