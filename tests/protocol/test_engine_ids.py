"""The join of the router's request ids with the engine's (``bear.protocol.engine_ids``): on the
ids a real vLLM 0.32 gave the requests of a recorded run, and on ids built the engine's way."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bear.protocol.engine_ids import dispatch_id, engine_id

RECORDED = Path(__file__).parents[1] / "data" / "vllm-recorded" / "prefix-sessions"


def test_every_id_of_a_recorded_vllm_run_joins_its_x_request_id() -> None:
    """tests/vllm/harness.py sent each chat request with X-Request-Id ``s<k>-t<j>`` (the keys of
    the run's prompts); vLLM named them ``chatcmpl-s<k>-t<j>-<8 hex>``: each joins back, and
    no two requests join to one id."""
    sent = set(json.loads(gzip.open(RECORDED / "prompts.json.gz", "rt").read()))
    engine: set[str] = set()
    with gzip.open(RECORDED / "steps.jsonl.gz", "rt") as f:
        for line in f:
            rec = json.loads(line)
            step = (rec.get("step") or {}) if "meta" in rec else rec  # the first line: the run's meta
            engine.update(r[0] for r in step.get("running") or [])
            engine.update(r[0] for r in step.get("waiting") or [])
    assert len(engine) > 20 and not engine & sent  # vLLM never keeps the id as it was sent
    joined = {dispatch_id(e) for e in engine}
    assert joined <= sent and len(joined) == len(engine)


@pytest.mark.parametrize("rid", ["bear-0123456789abcdef0123456789abcdef", "s0-t0", "a-1", "x_y-2-3", "cmpl-7",
                                 "deadbeef", "0_q", "chatcmpl-q-aaaaaaaa"])
@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("child", [None, 0, 11])
def test_engine_ids_join_back(rid: str, chat: bool, child: int | None) -> None:
    eid = engine_id(rid, chat, child)
    assert eid != rid and dispatch_id(eid) == rid
    assert engine_id(rid, chat, child) == eid  # the sim's suffix repeats


@pytest.mark.parametrize("eid", ["q17", "r3", "bear-1", "cmpl-x", "chatcmpl-", "0_", "12_chatcmpl-a-zzzzzzzz", ""])
def test_ids_not_named_the_vllm_way_are_themselves(eid: str) -> None:
    assert dispatch_id(eid) == eid
