"""What a KV cache's blocks look like: the model they belong to, their shape and dtype. Two
engines whose layouts match can exchange blocks (the KV connectors check it on both sides;
cluster/kvtransfer/wire.py puts it in every transfer's header)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# dtype name → bytes per element. Plain values, no torch: the hand-off types (and so the
# router, which maps hand-off failures to HTTP errors) import this module.
KV_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class KVLayout:
    """What must match on both sides for KV bytes to mean the same thing."""

    model: str  # model fingerprint, e.g. "SmolLM2-135M-Instruct@3f2a9c1d"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * KV_DTYPES[self.dtype]

    def payload_bytes(self, num_blocks: int) -> int:
        return self.block_bytes * num_blocks

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        return (f"{self.model} [{self.num_layers} layers, {self.num_kv_heads} kv heads, "
                f"head_dim {self.head_dim}, block_size {self.block_size}, {self.dtype}]")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of_cache(cls, model: str, kv_cache: torch.Tensor) -> KVLayout:
        """From an engine's cache [L, 2, NB, block_size, Hkv, D]."""
        layers, _, _, block_size, heads, dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        assert dtype in KV_DTYPES, kv_cache.dtype
        return cls(model, layers, heads, dim, block_size, dtype)
