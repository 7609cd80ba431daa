"""Model/GPU profiles of the simulated instance: small JSON files (``profiles/*.json``) with the
public model shape, the GPU's peak numbers and the vLLM scheduler settings; everything else
(parameter count, KV bytes per token, KV blocks) is derived here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROFILES_DIR = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    dtype_bytes: int = 2

    @property
    def layer_params(self) -> int:
        """Dense parameters of the transformer blocks (attention projections + SwiGLU MLP)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (q + kv + o + mlp)

    @property
    def total_params(self) -> int:
        emb = self.vocab * self.hidden
        return self.layer_params + emb * (1 if self.tied_embeddings else 2)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class Gpu:
    name: str
    count: int  # tensor-parallel degree
    peak_flops: float  # dense bf16 FLOP/s per GPU
    bandwidth_bytes_s: float  # HBM bytes/s per GPU
    memory_bytes: float
    interconnect_bytes_s: float = 450e9  # NVLink, per direction, for the TP all-reduces


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    shape: Shape
    gpu: Gpu
    compute_efficiency: float
    memory_efficiency: float
    step_overhead_s: float
    per_request_overhead_s: float
    allreduce_latency_s: float
    noise_sigma: float
    outlier_prob: float
    outlier_factor: float
    prices: dict[str, float]
    scheduler: dict[str, Any]

    @property
    def weight_bytes(self) -> float:
        return float(self.shape.total_params * self.shape.dtype_bytes)

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks left after weights and activations, as vLLM sizes its cache."""
        s = self.scheduler
        if "num_gpu_blocks" in s:
            return int(s["num_gpu_blocks"])
        budget = (
            self.gpu.count * self.gpu.memory_bytes * float(s.get("gpu_memory_utilization", 0.9))
            - self.weight_bytes
            - self.gpu.count * float(s.get("activation_reserve_bytes", 4e9))
        )
        per_block = int(s.get("block_size", 16)) * self.shape.kv_bytes_per_token
        blocks = int(budget // per_block)
        if blocks < 1:
            raise ValueError(f"profile {self.name}: the model does not fit in GPU memory")
        return blocks

    def engine_config(self) -> dict[str, Any]:
        """The ``config`` map of bear.snapshot/1 (and of libbea.Engine) for this profile."""
        s = self.scheduler
        mnbt = int(s.get("max_num_batched_tokens", 8192))
        return {
            "max_num_batched_tokens": mnbt,
            "max_num_scheduled_tokens": int(s.get("max_num_scheduled_tokens", mnbt)),
            "max_num_seqs": int(s.get("max_num_seqs", 256)),
            "long_prefill_token_threshold": int(s.get("long_prefill_token_threshold", 0)),
            "enable_chunked_prefill": bool(s.get("enable_chunked_prefill", True)),
            "policy": str(s.get("policy", "fcfs")),
            "block_size": int(s.get("block_size", 16)),
            "num_gpu_blocks": self.num_gpu_blocks,
            "watermark_blocks": int(s.get("watermark_blocks", 0)),
            "max_model_len": int(s.get("max_model_len", 40960)),
            "scheduler_reserve_full_isl": bool(s.get("scheduler_reserve_full_isl", True)),
            "enable_prefix_caching": bool(s.get("enable_prefix_caching", False)),
            "async_scheduling": False,
        }


def _from_json(d: dict[str, Any]) -> Profile:
    try:
        eff = d.get("efficiency", {})
        ovh = d.get("overhead", {})
        noise = d.get("noise", {})
        return Profile(
            name=str(d["name"]),
            model=str(d["model"]),
            shape=Shape(**d["shape"]),
            gpu=Gpu(**d["gpu"]),
            compute_efficiency=float(eff.get("compute", 0.6)),
            memory_efficiency=float(eff.get("memory", 0.8)),
            step_overhead_s=float(ovh.get("step_s", 4e-3)),
            per_request_overhead_s=float(ovh.get("per_request_s", 1.5e-5)),
            allreduce_latency_s=float(ovh.get("allreduce_latency_s", 8e-6)),
            noise_sigma=float(noise.get("sigma", 0.03)),
            outlier_prob=float(noise.get("outlier_prob", 0.0)),
            outlier_factor=float(noise.get("outlier_factor", 1.0)),
            prices={k: float(v) for k, v in d.get("prices", {}).items()},
            scheduler=dict(d.get("scheduler", {})),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"bad sim profile: {exc}") from exc


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name (``qwen3-8b-h100``) or any profile file by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = PROFILES_DIR / f"{name_or_path}.json"
    if not path.exists():
        raise ValueError(f"unknown sim profile {name_or_path!r}; shipped: {', '.join(available_profiles())}")
    return _from_json(json.loads(path.read_text()))
