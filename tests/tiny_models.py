"""Tiny random Llama-family checkpoints written as ordinary HF folders, for fast real tests.

They borrow the default model's tokenizer (so chat templates and detokenization are real)
and use a large init range so greedy choices are decided by clear margins, not float noise.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")

COMMON = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)

VARIANTS = {
    # untied embeddings, GQA, llama3 RoPE scaling
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    # q/k/v biases, tied embeddings
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0,
                  use_sliding_window=False),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, rope_theta=10000.0,
                    sliding_window=None, head_dim=32),
}


def build_tiny_model(kind: str, target: Path, tokenizer_from: Path, seed: int = 0, **overrides: object) -> Path:
    """`overrides`: config fields over COMMON and the variant's (bench/dataplane.py: hidden_size=16)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(COMMON, **VARIANTS[kind], **overrides)
    config = AutoConfig.for_model(**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "qwen2":  # HF initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, target / name)
    return target
