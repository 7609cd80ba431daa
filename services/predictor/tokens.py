"""Prompt token counts per model: the model's own ``tokenizer.json`` when one is on this host,
else the documented fallback (the number of text pieces, see ``features.analyse``).

Lookup order for a model's tokenizer: ``<tokenizer_dir>/<model name>/tokenizer.json``, then
``<tokenizer_dir>/<hf repo>/tokenizer.json``, then the Hugging Face cache
(``$HF_HOME/hub/models--<org>--<name>/snapshots/*/tokenizer.json``). Models that share one file
(the Qwen3 family) are tokenised once per prompt.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from bear.predictor.models import ModelSpec
from bear.tokenizer.chunks import encode_ids
from bear.tokenizer.loader import load_tokenizer

log = structlog.get_logger(__name__)


def _hf_cache_candidates(repo: str) -> list[Path]:
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    base = home / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots"
    return sorted(base.glob("*/tokenizer.json")) if base.is_dir() else []


def find_tokenizer(spec: ModelSpec, tokenizer_dir: Path | None) -> Path | None:
    """The ``tokenizer.json`` of ``spec`` on this host, or None."""
    cands: list[Path] = []
    if tokenizer_dir is not None:
        cands.append(tokenizer_dir / spec.name / "tokenizer.json")
        if spec.hf_repo:
            cands.append(tokenizer_dir / spec.hf_repo / "tokenizer.json")
    if spec.hf_repo:
        cands.extend(_hf_cache_candidates(spec.hf_repo))
    return next((c for c in cands if c.is_file()), None)


class TokenCounter:
    """Counts prompt tokens for each model; ``source(model)`` says which method is used."""

    def __init__(self, specs: Iterable[ModelSpec], tokenizer_dir: Path | None = None) -> None:
        self._by_model: dict[str, str | None] = {}
        self._tokenizers: dict[str, Any] = {}
        self._sources: dict[str, str] = {}
        for spec in specs:
            path = find_tokenizer(spec, tokenizer_dir)
            if path is None:
                self._by_model[spec.name] = None
                self._sources[spec.name] = "fallback"
                continue
            data = path.read_bytes()
            digest = hashlib.sha256(data).hexdigest()
            if digest not in self._tokenizers:
                self._tokenizers[digest] = load_tokenizer(data)  # the router's loader (one file read)
            self._by_model[spec.name] = digest
            self._sources[spec.name] = str(path)
        log.info("token_counters", sources=self._sources)

    def source(self, model: str) -> str:
        return self._sources.get(model, "fallback")

    def counts(self, text: str, models: Iterable[str], fallback: int) -> dict[str, int]:
        """Prompt tokens of ``text`` for each model (tokenising once per distinct tokenizer)."""
        out: dict[str, int] = {}
        memo: dict[str, int] = {}
        for m in models:
            key = self._by_model.get(m)
            if key is None:
                out[m] = fallback
                continue
            if key not in memo:
                memo[key] = len(encode_ids(self._tokenizers[key], [text], False)[0])  # the GIL released
            out[m] = memo[key]
        return out
