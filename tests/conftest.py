"""Shared fixtures: the public vLLM traces and a local NATS server on a random port."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bear.protocol.nats_server import LocalNatsServer

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "data" / "vllm-cpu-traces"


def load_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    if not (TRACES / "cases.jsonl.gz").exists():
        raise FileNotFoundError(f"public vLLM traces not found at {TRACES}")
    return TRACES


@pytest.fixture(scope="session")
def cases(traces_dir: Path) -> list[dict]:
    return load_jsonl(traces_dir / "cases.jsonl.gz")


@pytest.fixture
def nats_server() -> Iterator[LocalNatsServer]:
    with LocalNatsServer() as srv:
        yield srv
