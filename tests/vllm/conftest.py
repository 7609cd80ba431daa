"""Fixtures for the real-vLLM tests: the vLLM interpreter and a tiny local model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness import make_tiny_model, vllm_python


@pytest.fixture(scope="session")
def vllm_py() -> str:
    py = vllm_python()
    if py is None:
        if os.environ.get("BEAR_REQUIRE_VLLM") == "1":  # .ci/test.sh installed it: a skip would hide a failure
            pytest.fail("BEAR_REQUIRE_VLLM=1 but BEAR_VLLM_PYTHON is not set or not runnable")
        pytest.skip("BEAR_VLLM_PYTHON is not set (CI sets it; locally: .ci/install-vllm.sh)")
    return py


@pytest.fixture(scope="session")
def tiny_model(vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(vllm_py, tmp_path_factory.mktemp("tiny-qwen3"))
