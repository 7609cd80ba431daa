"""Wait until one chat request through the gateway at BASE_URL is answered by an instance BEAR
chose (``x-bear-instance``), asking every 2 s for at most --timeout s; print the first answer's
route. Standard library only: it runs on the host before anything else is installed there."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def ask(base_url: str, key: str) -> tuple[str, float] | None:
    body = json.dumps({"model": "bear", "messages": [{"role": "user", "content": "are you up?"}],
                       "max_tokens": 4}).encode()
    req = urllib.request.Request(base_url.rstrip("/") + "/chat/completions", body, method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            inst = r.headers.get("x-bear-instance")
            return (inst, float(r.headers.get("x-bear-ttft-ms") or 0)) if r.status == 200 and inst else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base_url")
    ap.add_argument("key_file", type=Path)
    ap.add_argument("--timeout", type=float, default=300.0)
    a = ap.parse_args()
    key = a.key_file.read_text().split()[0]
    start = time.monotonic()
    while time.monotonic() - start < a.timeout:
        got = ask(a.base_url, key)
        if got:
            print(f"routed end to end after {time.monotonic() - start:.0f} s: instance {got[0]}, TTFT {got[1]:.1f} ms")
            return 0
        time.sleep(2.0)
    return 1


if __name__ == "__main__":
    sys.exit(main())
