"""The shape of a Llama-family model, read from an HF config.json (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",  # Llama 2/3, SmolLM, TinyLlama ...
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",  # q/k/v bias
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class Architecture:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...]
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Architecture:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder} is not an HF model folder (no config.json)")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Architecture:
        archs = cfg.get("architectures") or []
        name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if name is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"Tandem supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope_type {rope_type!r}; Tandem supports {SUPPORTED_ROPE_TYPES}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg['hidden_act']!r}; only silu")
        heads = int(cfg["num_attention_heads"])
        kind = SUPPORTED_ARCHITECTURES[name]
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", kind == "mistral") else None
        return cls(
            name=name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted({**rope, "rope_type": rope_type}.items())),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=int(window) if window else None,
        )
