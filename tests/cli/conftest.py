"""The ``bear`` fixture: a sandboxed ``bear`` command (bear_cli.Bear) that must leave nothing behind."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bear_cli import Bear, make_bear


@pytest.fixture
def bear(tmp_path: Path) -> Iterator[Bear]:
    b = make_bear(tmp_path)
    yield b
    b.assert_clean()


