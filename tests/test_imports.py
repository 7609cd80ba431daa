"""Every module of the installed ``bear`` package imports: a command or benchmark whose module
names one that moved fails here, not in a user's hands (``bear bench gateway`` once failed at
once with ModuleNotFoundError: bear.router.bench)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import bear

# Loaded inside vLLM's own process (VLLM_PLUGINS); here only where vLLM is installed.
NEEDS_VLLM = {"bear.snapshotter.bear_vllm_plugin"}
MODULES = sorted(m.name for m in pkgutil.walk_packages(bear.__path__, "bear.") if not m.name.endswith("__main__"))


def test_the_package_is_walked() -> None:
    assert len(MODULES) > 100 and "bear.benchmarks.gateway" in MODULES and NEEDS_VLLM <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str) -> None:
    if name in NEEDS_VLLM:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            assert exc.name == "vllm" or (exc.name or "").startswith("vllm."), exc
        return
    importlib.import_module(name)
