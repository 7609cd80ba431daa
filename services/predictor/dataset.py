"""The training data format: one (prompt, model) evaluation per record, JSONL (``.gz`` accepted)
or Parquet (needs ``pyarrow``). Fields (docs/predictor.md):

``prompt`` str, ``task`` str, ``model`` str, ``quality`` float in [0, 1], ``output_tokens`` int ≥ 0,
``prompt_tokens`` int ≥ 0 (that model's tokenizer; optional, then counted at training time),
``query_id`` str (optional: records with one id share a prompt and are never split between train
and test), ``synthetic`` bool (optional; set by ``bear data synth``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bear.protocol.errors import BearError, ErrorCode
from bear.protocol.jsonl import open_text


@dataclass
class Record:
    prompt: str
    task: str
    model: str
    quality: float
    output_tokens: int
    prompt_tokens: int | None = None
    query_id: str | None = None
    synthetic: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "") -> Record:
        try:
            rec = cls(
                prompt=str(d["prompt"]),
                task=str(d["task"]),
                model=str(d["model"]),
                quality=float(d["quality"]),
                output_tokens=int(d["output_tokens"]),
                prompt_tokens=None if d.get("prompt_tokens") is None else int(d["prompt_tokens"]),
                query_id=None if d.get("query_id") is None else str(d["query_id"]),
                synthetic=bool(d.get("synthetic", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BearError(ErrorCode.BAD_REQUEST, f"bad record {where}: {exc!r}") from exc
        if not 0.0 <= rec.quality <= 1.0:
            raise BearError(ErrorCode.BAD_REQUEST, f"bad record {where}: quality {rec.quality} not in [0, 1]")
        if rec.output_tokens < 0 or (rec.prompt_tokens is not None and rec.prompt_tokens < 0):
            raise BearError(ErrorCode.BAD_REQUEST, f"bad record {where}: negative token count")
        return rec

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @property
    def group(self) -> str:
        return self.query_id if self.query_id is not None else self.prompt


def read_records(path: Path) -> list[Record]:
    """All records of a JSONL(.gz) or Parquet file; a bad line raises ``BearError`` naming it."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise BearError(ErrorCode.BAD_REQUEST, "reading Parquet needs pyarrow (pip install pyarrow)") from exc
        rows = pq.read_table(path).to_pylist()
        return [Record.from_dict(r, f"{path}#{i}") for i, r in enumerate(rows)]
    out: list[Record] = []
    with open_text(path, "rt") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise BearError(ErrorCode.BAD_REQUEST, f"{path}:{i}: not JSON: {exc}") from exc
                out.append(Record.from_dict(d, f"{path}:{i}"))
    return out


def write_records(path: Path, records: Iterable[Record]) -> int:
    """Write JSONL(.gz); returns the number of records."""
    n = 0
    with open_text(Path(path), "wt") as f:
        for r in records:
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
            n += 1
    return n


def iter_groups(records: list[Record]) -> Iterator[tuple[str, list[int]]]:
    """Record indices grouped by query (``query_id``, else the prompt text), in first-seen order."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(r.group, []).append(i)
    yield from groups.items()
