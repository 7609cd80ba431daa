"""bear.predict/1 → bear.prediction/1 as structs (bear.protocol.predict): the router's request is
the map it sent before, the predictor's reply map decodes into Prediction, and bad requests are
coded."""

from __future__ import annotations

import numpy as np
import pytest

from bear.protocol import schemas
from bear.protocol.codec import pack, unpack
from bear.protocol.errors import BearError, ErrorCode, error_reply
from bear.protocol.messages import encode
from bear.protocol.predict import PredictRequest, decode_predict, decode_prediction


def test_the_request_is_the_map_the_router_sent() -> None:
    r = PredictRequest(prompt="hi", models=["a", "b"], deadline=12.5, id="q1", prompt_tokens=3)
    assert unpack(encode(r)) == {"v": schemas.PREDICT, "prompt": "hi", "models": ["a", "b"], "deadline": 12.5,
                                 "id": "q1", "prompt_tokens": 3}
    back = decode_predict(encode(r), max_bytes=1 << 20)
    assert back == r and back.tokens_by_model() == {"a": 3, "b": 3}
    per = decode_predict(pack({"v": schemas.PREDICT, "prompt": "x", "models": ["a"], "prompt_tokens": {"a": 2, "z": 9}}),
                         max_bytes=1 << 20)
    assert per.tokens_by_model() == {"a": 2} and per.deadline is None
    assert "prompt_tokens" not in unpack(encode(PredictRequest(prompt="x", models=["a"], id="")))


def test_the_predictor_reply_map_decodes() -> None:
    """The map Predictor.predict_wire builds (numpy numbers in it, as msgpack writes them)."""
    wire = {"v": schemas.PREDICTION, "id": "q1", "models": {"a": {
        "acc": np.float64(0.7), "len": {"mean": np.float64(120.0), "p50": 100.0, "p90": 300.0},
        "prompt_tokens": 6, "cost": 1e-5}}}
    p = decode_prediction(pack(wire))
    assert p is not None and p.id == "q1" and p.models["a"].len.p90 == 300.0 and p.models["a"].prompt_tokens == 6
    assert decode_prediction(encode(error_reply(ErrorCode.OVERLOADED, "busy"))) is None
    assert decode_prediction(pack({"v": schemas.PREDICTION, "models": {"a": {"acc": 1}}})) is None


@pytest.mark.parametrize(("raw", "message"), [
    ({"v": "bear.predict/0", "prompt": "x", "models": ["a"]}, "expected v="),
    ({"prompt": 3, "models": ["a"]}, "prompt must be a string"),
    ({"prompt": "x", "models": []}, "models must be a non-empty list"),
    ({"prompt": "x", "models": ["a", 1]}, "models must be a non-empty list"),
    ({"prompt": "x", "models": ["a"], "prompt_tokens": -1}, "prompt_tokens must be"),
    ({"prompt": "x", "models": ["a"], "deadline": "soon"}, "deadline must be"),
    ({"models": ["a"]}, "prompt must be a string"),
])
def test_bad_requests_are_coded(raw: dict, message: str) -> None:
    with pytest.raises(BearError) as e:
        decode_predict(pack(raw), max_bytes=1 << 20)
    assert e.value.code == ErrorCode.BAD_REQUEST and e.value.message.startswith(message), e.value.message
    with pytest.raises(BearError) as e:
        decode_predict(pack({"prompt": "x", "models": ["a"]}), max_bytes=4)
    assert e.value.code == ErrorCode.TOO_LARGE
