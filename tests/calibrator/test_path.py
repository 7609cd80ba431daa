"""The path term (bear.calibrator.path): fitted from recorded outcomes as documented, carried by
Calibration, added by build_candidates exactly once; old messages still decode."""

from __future__ import annotations

import msgspec
import pytest

from bear.calibrator.path import MIN_PATH, PathWindow, fit_path
from bear.protocol import schemas
from bear.protocol.messages import Calibration, EstimateRow, Outcome, decode, encode


def test_constant_path_when_prompts_do_not_span() -> None:
    """Prompts within MIN_SPAN tokens: b = 0, a = the median residual (an outlier does not move it)."""
    w = PathWindow()
    for i in range(40):
        w.add(86 + i % 3, observed_s=0.030 + (0.5 if i == 7 else 0.0), elapsed_s=0.002, engine_s=0.010)
    f = w.fit()
    assert f is not None and f.n == 40
    assert f.b == 0.0
    assert f.a == pytest.approx(0.018)


def test_linear_path_is_recovered_exactly() -> None:
    """r = 5 ms + 20 µs · n over spread prompts: Theil–Sen gives both coefficients exactly."""
    pts = [(float(n), 0.005 + 20e-6 * n) for n in range(16, 16 + 40 * 16, 16)]
    pts[3] = (pts[3][0], 3.0)  # one stall: the median slope and intercept ignore it
    f = fit_path(pts)
    assert f is not None
    assert f.b == pytest.approx(20e-6)
    assert f.a == pytest.approx(0.005)
    assert f.at(100) == pytest.approx(0.005 + 20e-6 * 100)


def test_nothing_below_the_minimum_count() -> None:
    assert fit_path([(10.0, 0.01)] * (MIN_PATH - 1)) is None
    assert fit_path([(10.0, 0.01)] * MIN_PATH) is not None


def test_negative_slope_is_clipped() -> None:
    pts = [(float(n), 0.050 - 10e-6 * n) for n in range(0, 4000, 100)]
    f = fit_path(pts)
    assert f is not None and f.b == 0.0


def test_old_messages_decode() -> None:
    """Calibration and Outcome bytes from before the path fields decode, to no path."""
    cal_tag, out_tag = schemas.CALIBRATION, schemas.OUTCOME
    old_cal = msgspec.defstruct("C", [("instance", str), ("beta", tuple[float, float, float, float])],
                                tag=cal_tag, tag_field="v", kw_only=True)
    old_out = msgspec.defstruct("O", [("instance", str), ("ttft_s", float), ("t", float)],
                                tag=out_tag, tag_field="v", kw_only=True)
    c = decode(Calibration, msgspec.msgpack.encode(old_cal(instance="i", beta=(1e-3, 0.0, 0.0, 0.0))))
    assert c.path_s0 is None and c.path_n == 0 and c.path_s(500) == 0.0
    o = decode(Outcome, msgspec.msgpack.encode(old_out(instance="i", ttft_s=0.02, t=1.0)))
    assert o.engine_ttft_s is None and o.elapsed_s is None and o.prompt_tokens is None
    rt = decode(Calibration, encode(msgspec.structs.replace(c, path_s0=0.004, path_per_token_s=1e-5, path_n=31)))
    assert rt.path_s(100) == pytest.approx(0.005)


def test_build_candidates_adds_exactly_the_path() -> None:
    """A BEA row's TTFT is elapsed + engine + Calibration.path_s(prompt tokens); no path: as before."""
    from bear.router.candidates import ModelPrediction, build_candidates
    from bear.router.registry import InstanceInfo

    inst = InstanceInfo("i", model="m", base_url="http://127.0.0.1:1/v1", price_in=0.1, price_out=0.4,
                        predictor_model="m")
    pred = {"m": ModelPrediction(acc=0.5, out_len=100.0, out_p90=150.0, prompt_tokens=200, cost_usd=1e-5)}
    rows = {"i": EstimateRow(instance="i", ttft_s=0.010, method="bea", status="ok")}
    bare, _ = build_candidates(200, [inst], pred, rows, 0.0, default_output_tokens=256, elapsed_s=0.003)
    assert bare[0].ttft == pytest.approx(0.013) and bare[0].ttft_path == 0.0
    inst.calibration = msgspec.structs.replace(inst.calibration, path_s0=0.006, path_per_token_s=2e-5, path_n=50)
    with_path, _ = build_candidates(200, [inst], pred, rows, 0.0, default_output_tokens=256, elapsed_s=0.003)
    assert with_path[0].ttft_path == pytest.approx(0.006 + 2e-5 * 200)
    assert with_path[0].ttft - bare[0].ttft == pytest.approx(with_path[0].ttft_path)
