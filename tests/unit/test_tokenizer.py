"""An engine's tokenizer without transformers (`Tokenizer(path, lazy=True)`): the text it decodes
is transformers' own, and a folder whose tokenizer.json is not all there is to its tokenizer
goes through transformers as before."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from cluster.engine.tokenizer import Tokenizer

TEXTS = ["What is the capital of France? Paris.", "日本語のテキスト 東京", "pizza 🍕 and 🎉!", "naïve  résumé\n\tend",
         "<|im_start|>user\nHi<|im_end|>"]


@pytest.fixture(scope="module")
def hf(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path))


def id_runs(hf, n: int = 300, seed: int = 0) -> list[list[int]]:
    """Token id sequences: the texts' own (multi-byte characters split across tokens), their
    every prefix, and random draws over the whole vocabulary, special tokens included."""
    rng = random.Random(seed)
    runs = []
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        runs += [ids[:k] for k in range(1, len(ids) + 1)]
    size = len(hf)
    runs += [[rng.randrange(size) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    runs += [[size - 1 - rng.randrange(32), rng.randrange(size)] for _ in range(50)]  # the added tokens
    return runs


def test_the_default_models_text_is_transformers_own(default_model_path, hf):
    lazy = Tokenizer(default_model_path, lazy=True)
    assert lazy._fast is not None  # the folder qualifies: the test covers the path without transformers
    for ids in id_runs(hf):
        for skip in (True, False):
            assert lazy.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False) == \
                hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (ids, skip)
    assert lazy.eos_token_ids == Tokenizer(default_model_path).eos_token_ids and hf.eos_token_id in lazy.eos_token_ids
    assert lazy.vocab_size == len(hf)
    assert "hf" not in vars(lazy)  # none of that loaded transformers' tokenizer
    # what only transformers does (its own default clean-up: the folder sets none; encode): loaded on first need
    assert lazy.decode(id_runs(hf)[-1]) == hf.decode(id_runs(hf)[-1], skip_special_tokens=True)
    assert lazy.encode("Paris") == hf.encode("Paris")
    assert "hf" in vars(lazy)


def copy_tokenizer(src: Path, dst: Path, **settings) -> Path:
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, **settings}))
    return dst


def test_a_folder_whose_config_adds_to_its_tokenizer_json_decodes_through_transformers(default_model_path, hf,
                                                                                      tmp_path):
    """A special token the config names that tokenizer.json does not mark special (transformers
    would mark it, and skip it), a class other than the generic one, or a clean-up of spaces:
    each decodes through transformers, with its text."""
    plain = next(t for t, i in sorted(hf.get_vocab().items(), key=lambda kv: kv[1]) if i > 1000 and t.isalpha())
    cases = {"named": {"additional_special_tokens": [plain]}, "class": {"tokenizer_class": "GPT2TokenizerFast"},
             "cleanup": {"clean_up_tokenization_spaces": True}}
    for name, settings in cases.items():
        folder = copy_tokenizer(Path(default_model_path), tmp_path / name, **settings)
        lazy = Tokenizer(folder, lazy=True)
        ids = hf.encode("Hello , world !", add_special_tokens=False)
        if name != "cleanup":
            assert lazy._fast is None, name
        assert lazy.decode(ids) == lazy.hf.decode(ids, skip_special_tokens=True), name
    named = Tokenizer(tmp_path / "named", lazy=True)
    plain_id = hf.convert_tokens_to_ids(plain)
    assert named.decode([plain_id, 42]) == named.hf.decode([plain_id, 42], skip_special_tokens=True)
    assert plain not in named.decode([plain_id, 42])  # transformers made it special: skipped
