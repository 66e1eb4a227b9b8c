"""Load a local HF Llama-family folder (config.json + *.safetensors) into Tandem's model."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from cluster.models.architecture import Architecture
from cluster.models.linear import Linear, RefinedHead
from cluster.models.llama import LayerWeights, LlamaModel, ModelWeights
from kernels import KernelOps
from kernels.block_weights import pack_exact

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_model(folder: str | Path, arch: Architecture, ops: KernelOps, dtype: torch.dtype,
               device: torch.device, max_positions: int, matmul_dtype: torch.dtype | None = None) -> LlamaModel:
    """`matmul_dtype`: the layers' projections hold their weights in it, and the LM head a copy
    (a CPU engine's bfloat16: see model_runner.weight_dtypes, linear.RefinedHead); the embedding
    and norms stay in `dtype`."""
    raw = read_tensors(Path(folder))

    def take(key: str, required: bool = True) -> torch.Tensor | None:
        t = raw.pop(key, None)
        if t is None:
            if required:
                raise KeyError(f"{folder}: weight {key!r} is missing")
            return None
        return t.to(device=device, dtype=dtype)

    def fuse(*keys: str, required: bool = True) -> torch.Tensor | None:
        parts = [take(k, required) for k in keys]
        if any(p is None for p in parts):
            return None
        return torch.cat(parts, dim=0)  # type: ignore[arg-type]

    def proj(*keys: str, bias: tuple[str, ...] = ()) -> Linear:
        """HF stores [out, in] (fused along out); `Linear` holds it the fastest way for the device."""
        b = fuse(*bias, required=False) if bias else None
        w = fuse(*keys)
        exact = blocks(w)  # of the float32 weights, before any bf16 copy
        if matmul_dtype is not None:
            w, b = w.to(matmul_dtype), None if b is None else b.to(matmul_dtype)  # type: ignore[union-attr]
        return Linear(w, b, blocks=exact)  # type: ignore[arg-type]

    def blocks(w: torch.Tensor):  # the weights' 4/8-bit blocks, where they are exactly that
        return pack_exact(w) if ops.block_weights else None

    layers = []
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=proj(*(attn + f"{n}_proj.weight" for n in "qkv"),
                     bias=tuple(attn + f"{n}_proj.bias" for n in "qkv")),
            o=proj(attn + "o_proj.weight", bias=(attn + "o_proj.bias",)),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            down=proj(p + "mlp.down_proj.weight"),
        ))
    embed = take("model.embed_tokens.weight")
    lm_head: Linear | RefinedHead
    if arch.tie_word_embeddings:
        raw.pop("lm_head.weight", None)  # some checkpoints also save the tied copy
        if matmul_dtype is not None:
            lm_head = RefinedHead(embed, blocks=blocks(embed))  # type: ignore[arg-type]
        else:
            lm_head = Linear(embed, shared=True, blocks=blocks(embed))  # packed, it is a copy: a packed
                                                                         # head cannot be indexed
    elif matmul_dtype is not None:
        head = take("lm_head.weight")
        lm_head = RefinedHead(head, blocks=blocks(head))  # type: ignore[arg-type]
    else:
        lm_head = proj("lm_head.weight")
    weights = ModelWeights(embed=embed, layers=layers, norm=take("model.norm.weight"), lm_head=lm_head)
    leftover = [k for k in raw if not k.endswith(_IGNORED_SUFFIXES)]
    if leftover:
        raise ValueError(f"{folder}: weights Tandem does not know how to use: {leftover[:5]}")
    return LlamaModel(arch, weights, ops, max_positions)
