"""Every schema id is defined once, in bear.protocol.schemas (issue 25): no other module of
services/ spells one as a string literal, and libbea's parsers agree with it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from bear.protocol import schemas

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
SCHEMAS_PY = SERVICES / "protocol" / "schemas.py"
SCHEMA_ID = re.compile(r"^bear\.[a-z_.-]+/\d+$")


def _literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant in ``path`` that is a schema id by itself (prose
    in docstrings and help texts that mentions one is not a literal of it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and SCHEMA_ID.match(n.value)]


def test_no_schema_id_literal_outside_schemas_py() -> None:
    found = [f"{p.relative_to(ROOT)}:{line}: {value!r}"
             for p in sorted(SERVICES.rglob("*.py")) if p != SCHEMAS_PY
             for line, value in _literals(p)]
    assert not found, "schema ids belong in services/protocol/schemas.py; import the constant:\n" + "\n".join(found)


def test_schemas_py_lists_each_id_once() -> None:
    constants = {name: v for name, v in vars(schemas).items() if name.isupper() and isinstance(v, str)}
    assert constants and all(SCHEMA_ID.match(v) for v in constants.values())
    assert len(set(constants.values())) == len(constants), "two constants name the same schema"
    assert sorted(schemas.ALL) == sorted(constants.values())
    assert {v for _, v in _literals(SCHEMAS_PY)} == set(schemas.ALL)
    assert set(schemas.REPLY_STREAM) >= set(schemas.TERMINAL)


def test_libbea_parsers_agree() -> None:
    """libbea holds its own copy of the ids of what it parses: the same strings."""
    snapshot = (ROOT / "libbea" / "core" / "src" / "snapshot.cpp").read_text(encoding="utf-8")
    delta = (ROOT / "libbea" / "core" / "src" / "snapshot_delta.cpp").read_text(encoding="utf-8")
    cpp_ids = set(re.findall(r'"(bear\.[a-z_.-]+/\d+)"', snapshot + delta))
    assert cpp_ids == {schemas.SNAPSHOT, schemas.DELTA}
