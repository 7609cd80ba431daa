"""JSON-lines files (``.gz`` accepted), the file form of every message (design.md §3): replay
cases, batch records, step logs, datasets, outcome logs."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any


def open_text(path: str | Path, mode: str = "rt") -> IO[str]:
    """A text file, gzip-compressed when its name ends in ``.gz``."""
    p = Path(path)
    if p.suffix == ".gz":
        return gzip.open(p, mode, encoding="utf-8")  # type: ignore[return-value]
    return open(p, mode.replace("t", ""), encoding="utf-8")


def read_jsonl(path: str | Path) -> Iterator[Any]:
    """One decoded JSON value per non-empty line."""
    with open_text(path) as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def write_jsonl(path: str | Path, rows: Iterable[Any], mode: str = "wt") -> int:
    """Write one JSON value per line; returns how many."""
    n = 0
    with open_text(path, mode) as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
            n += 1
    return n
