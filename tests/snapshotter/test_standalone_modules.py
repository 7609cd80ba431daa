"""The modules vLLM's side loads on their own (the plugin and what it needs; the offline vLLM
driver's ``step_decoder`` and ``records``) import with the standard library alone and without the
``bear`` package: vLLM's venv has neither BEAR nor its dependencies. CI 5 Dec: ``records`` took
its schema ids from ``bear.protocol`` and every offline vLLM test failed on the import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SNAPSHOTTER = Path(__file__).resolve().parents[2] / "services" / "snapshotter"
# bear_vllm_plugin imports vllm at the top: its own helpers are checked, vLLM's side tests load it
STANDALONE = ("records", "step_decoder", "plugin_config", "plugin_block_ops", "shm")


def test_vllm_side_modules_import_with_the_stdlib_alone() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import importlib\n"
            "for m in sys.argv[2:]: importlib.import_module(m)\n"
            "import records; assert records.SNAPSHOT_SCHEMA == 'bear.snapshot/1', records.SNAPSHOT_SCHEMA\n"
            "assert 'bear' not in sys.modules")
    # -S: no site-packages at all (neither bear nor msgspec/numpy); -I: no user site, no PYTHONPATH
    res = subprocess.run([sys._base_executable, "-S", "-I", "-c", code, str(SNAPSHOTTER), *STANDALONE],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
