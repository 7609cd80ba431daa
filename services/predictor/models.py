"""What the predictor knows about each model of the pool: size, context, prices, tokenizer.

The defaults are the paper's pool (Qwen3-0.6B/8B/32B) with the prices of its Table 1; a JSON file
with the same fields replaces them (``bear predictor train --models FILE``), and the trained model
directory keeps a copy so that the service prices exactly what it was trained for.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bear.protocol.errors import BearError, ErrorCode


@dataclass(frozen=True)
class ModelSpec:
    """One model: ``name`` is the id used on the wire and in datasets."""

    name: str
    params_b: float  # parameters, billions
    max_context: int  # tokens
    price_in: float  # USD per million prompt tokens
    price_out: float  # USD per million output tokens
    hf_repo: str = ""  # Hugging Face repo id, used to find a local tokenizer.json

    @property
    def log_params(self) -> float:
        return math.log(self.params_b * 1e9)

    def cost_usd(self, prompt_tokens: float, output_tokens: float) -> float:
        """Paper A.4: tok_pre · cost_in + tok_dec · cost_out (prices are per million tokens)."""
        return (prompt_tokens * self.price_in + output_tokens * self.price_out) / 1e6

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        try:
            return cls(
                name=str(d["name"]),
                params_b=float(d["params_b"]),
                max_context=int(d["max_context"]),
                price_in=float(d["price_in"]),
                price_out=float(d["price_out"]),
                hf_repo=str(d.get("hf_repo", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BearError(ErrorCode.BAD_REQUEST, f"bad model spec {d!r}: {exc}") from exc


# Paper Table 1 (Alibaba Cloud Model Studio, non-thinking mode, USD per million tokens).
DEFAULT_MODELS: tuple[ModelSpec, ...] = (
    ModelSpec("Qwen3-0.6B", 0.6, 32768, 0.044, 0.173, "Qwen/Qwen3-0.6B"),
    ModelSpec("Qwen3-8B", 8.0, 32768, 0.072, 0.287, "Qwen/Qwen3-8B"),
    ModelSpec("Qwen3-32B", 32.0, 32768, 0.287, 0.640, "Qwen/Qwen3-32B"),
)


def load_models(path: Path | None) -> list[ModelSpec]:
    """Model specs from a JSON list (or ``{"models": [...]}``), or the defaults."""
    if path is None:
        return list(DEFAULT_MODELS)
    raw = json.loads(Path(path).read_text())
    items = raw["models"] if isinstance(raw, dict) else raw
    specs = [ModelSpec.from_dict(d) for d in items]
    if len({s.name for s in specs}) != len(specs):
        raise BearError(ErrorCode.BAD_REQUEST, f"duplicate model names in {path}")
    return specs
