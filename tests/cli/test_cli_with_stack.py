"""The CLI against a real ``bear up`` (issue 12), started as a user starts it in a terminal: the
other commands find it without ``--nats``; a prompt from stdin or a file; a prompt or
``--max-tokens`` the engine refuses ends in one line with the engine's reason and is not retried;
a prompt larger than NATS allows is refused before sending; Ctrl-C in ``bear submit`` exits 130 in
one line; a second ``bear up`` refuses in one line, or names the port it cannot have; Ctrl-C
stops everything and leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bear_cli import all_gone, assert_one_line_error, make_bear, start_up
from waiting import HANG_S, wait_until_sync

# `bear up` with its default ports (the gateway's 8000): one such module at a time (docs/testing.md)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("bear_up_ports")]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    b = make_bear(tmp_path_factory.mktemp("cli-stack"))
    u = start_up(b)
    pids = u.pids()
    yield u
    u.proc.send_signal(signal.SIGINT)  # Ctrl-C
    rc = u.proc.wait(60)
    out = u.log.read_text()
    assert rc == 0 and "stopped." in out and "Traceback" not in out, out[-3000:]
    assert all_gone(pids)
    assert not list(b.state_dir.glob("up-*.json"))  # no stack published any more
    assert not list((b.cwd / ".bear-up" / "runs").glob("*/jetstream"))  # the temporary store went
    b.assert_clean()


def records(up) -> list[dict]:
    path = Path(up.state()["outcome_logs"][0])
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def records_of(up, ids: set[str]) -> dict[str, dict] | None:
    """The outcome records by query id once every one of ``ids`` has one (None before)."""
    recs = {r["query_id"]: r for r in records(up)}
    return recs if ids <= set(recs) else None


def test_submit_finds_the_stack_and_says_the_text_is_placeholder(up) -> None:
    res = up.bear("submit", "Explain KV caching briefly", "--max-tokens", "8")
    assert res.rc == 0, res.err
    assert res.out.split() and set(res.out.split()) <= {"lorem", "ipsum", "dolor", "sit", "amet", "consectetur",
                                                        "adipiscing", "elit"}
    assert "placeholder" in res.err and "[bea]" in res.err and "target 500 ms" in res.err  # markup not eaten
    assert "Traceback" not in res.err


def test_prompt_from_stdin_and_file(up) -> None:
    res = up.bear("submit", "-", "--max-tokens", "3", stdin="a prompt from stdin\n")
    assert res.rc == 0 and len(res.out.split()) == 3, res.err
    (up.bear.cwd / "prompt.txt").write_text("a prompt from a file")
    res = up.bear("submit", "--file", "prompt.txt", "--max-tokens", "2")
    assert res.rc == 0 and len(res.out.split()) == 2, res.err


def test_engine_refusals_are_one_line_and_not_retried(up) -> None:
    (up.bear.cwd / "long.txt").write_text("word " * 40_000)  # ≈ 50k tokens > max_model_len 40960, < 1 MB
    assert_one_line_error(up.bear("submit", "--file", "long.txt", "--query-id", "too-long"), 1,
                          "context_length_exceeded", "refused the query", "maximum context length", only=False)
    # max_tokens beyond every registered max_model_len: refused by the router before dispatch
    assert_one_line_error(up.bear("submit", "hi", "--max-tokens", "10000000", "--query-id", "too-many"), 1,
                          "context_length_exceeded", "maximum context length", only=False)
    recs = wait_until_sync(lambda: records_of(up, {"too-long", "too-many"}), what="both queries' outcome records")
    assert recs["too-long"]["status"] == "context_length_exceeded" and recs["too-long"]["attempt"] == 1
    assert recs["too-long"]["http_status"] == 400
    assert recs["too-many"]["status"] == "context_length_exceeded" and "http_status" not in recs["too-many"]
    res = up.bear("submit", "still routed", "--max-tokens", "2")  # no instance was held against it
    assert res.rc == 0, res.err


def test_prompt_beyond_nats_max_payload_is_refused_before_sending(up) -> None:
    (up.bear.cwd / "huge.txt").write_text("x" * 1_200_000)
    assert_one_line_error(up.bear("submit", "--file", "huge.txt"), 1, "too_large", "max_payload", only=False)


def test_ctrl_c_in_submit_exits_130_in_one_line(up) -> None:
    p = subprocess.Popen([sys.executable, "-m", "bear", "submit", "a long answer", "--max-tokens", "30000"],
                         cwd=up.bear.cwd, env=up.bear.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    assert p.stdout.read(6)  # the answer is streaming
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=HANG_S)  # it exits on the signal, long before its 30,000 tokens
    print(f"bear submit: exit {p.returncode} {time.monotonic() - t0:.1f} s after Ctrl-C")
    assert p.returncode == 130
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == "error: interrupted" and "Traceback" not in err, err


def test_load_finds_the_stack_and_explains_its_summary(up) -> None:
    res = up.bear("load", "--rate", "4", "--duration", "2", "--max-tokens", "64", timeout=120)
    assert res.rc == 0, res.err[-2000:]
    out = " ".join(res.out.split())
    for figure in ("OnTimeUtility:", "SLO attainment:", "mean TTFT:", "routing composition:"):
        assert figure in out, out
    assert "eq. 6" in out and "evaluation table" in out


def test_load_that_completes_nothing_fails_in_one_line(up) -> None:
    # a prefix no router serves: every query unanswered (a max_tokens beyond every context no longer
    # does it: the load fits its cap into the chosen engine's context, docs/cli.md)
    res = up.bear("load", "--rate", "3", "--duration", "1", "--prefix", "nobody", timeout=120)
    assert_one_line_error(res, 3, "no query completed", "unavailable", "is the stack running", only=False)  # 3: unreachable


def test_a_load_with_a_cap_beyond_every_context_completes(up) -> None:
    out = up.bear.cwd / "fitted.json"
    res = up.bear("load", "--rate", "3", "--duration", "1", "--max-tokens", "10000000", "--out", str(out), timeout=120)
    rep = json.loads(out.read_text())
    # before the fit every one of them was context_length_exceeded; now none is (a loaded host may shed one)
    assert res.rc == 0 and "context_length_exceeded" not in rep["errors"] and rep["done"] >= 1, (res.err, rep)


def test_second_up_refuses_here_and_names_the_port_elsewhere(up, tmp_path) -> None:
    line = assert_one_line_error(up.bear("up"), 1, "already running from this directory", str(up.proc.pid))
    assert up.state()["nats_url"] in line
    port = up.state()["metrics"][0].rsplit(":", 1)[1].split("/")[0]
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert_one_line_error(up.bear("up", "--metrics-port", port, cwd=other), 1, port, "already in use")
    assert not (other / ".bear-up" / "runs").exists() or not list((other / ".bear-up" / "runs").iterdir())


def test_banner_names_the_gateway_its_key_and_a_curl_line_that_works(up) -> None:
    def banner() -> str | None:
        text = up.log.read_text()
        return text if " curl " in text else None

    text = wait_until_sync(banner, what="the banner's curl line")
    line = next(ln for ln in text.splitlines() if "OpenAI gateway" in ln)
    url = line.split()[2]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1") and "gateway-api-key" in line
    curl = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("curl "))
    assert curl.startswith(f"curl {url}/chat/completions") and "Authorization: Bearer $(cat " in curl
    key = (up.bear.cwd / ".bear-up" / "gateway-api-key").read_text().strip()

    r = httpx.post(f"{url}/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=HANG_S,
                   json={"model": "bear", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text

    if shutil.which("curl"):  # the line as printed, run by a shell in the stack's directory
        res = subprocess.run(["bash", "-c", curl.replace('"content": "Hi"}]}', '"content": "Hi"}], "max_tokens": 3}')],
                             cwd=up.bear.cwd, capture_output=True, text=True, timeout=HANG_S)
        assert res.returncode == 0 and json.loads(res.stdout)["object"] == "chat.completion", res
