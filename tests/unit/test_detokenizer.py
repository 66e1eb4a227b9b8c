"""Incremental detokenization, on tiny byte-level BPE and SentencePiece-style tokenizers built in memory."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from cluster.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, the café serves crème brûlée.",
    "日本語のテキスト 日本 東京",
    "I love pizza 🍕 and 🎉 parties!",
    "stop here. The END is near.",
    "naïve résumé",
] * 3
PROMPT = "Tell me:"
OUTPUT = " I love pizza 🍕 and 日本 café! The END is near."


@functools.cache
def byte_level_bpe() -> PreTrainedTokenizerFast:
    """GPT-2/Llama-3 style: bytes mapped to printable chars; multi-byte chars split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|eos|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>")


@functools.cache
def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Llama-2/Mistral style: '▁' for spaces, <0xNN> byte fallback, first leading space stripped."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    alphabet = [chr(c) for c in range(32, 127)] + ["▁"]  # anything else falls back to bytes
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=alphabet, limit_alphabet=len(alphabet)))
    spec = json.loads(tok.to_str())
    for b in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte_level": byte_level_bpe, "sentencepiece": sentencepiece_like}


def split_ids(tok, prompt: str, output: str) -> tuple[list[int], list[int]]:
    """Token ids of prompt+output, split where the prompt's own tokens end."""
    full = tok.encode(prompt + output, add_special_tokens=False)
    n = len(tok.encode(prompt, add_special_tokens=False))
    assert tok.decode(full[:n]) == prompt, "prompt must end on a token boundary"
    return full[:n], full[n:]


def stream(tok, prompt_ids, output_ids, *, chunk: int = 1, **kwargs):
    """Feed output ids `chunk` at a time; return (detokenizer, deltas incl. the final one, stop)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas, stop = [], None
    for i in range(0, len(output_ids), chunk):
        stop = detok.add_tokens(output_ids[i:i + chunk])
        deltas.append(detok.take_delta(finished=stop is not None))
        if stop is not None:
            return detok, deltas, stop
    deltas.append(detok.take_delta(finished=True))
    return detok, deltas, stop


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_text_the_full_decode_gives(name, chunk):
    tok = TOKENIZERS[name]()
    prompt_ids, output_ids = split_ids(tok, PROMPT, OUTPUT)
    detok, deltas, stop = stream(tok, prompt_ids, output_ids, chunk=chunk)
    assert stop is None
    assert "".join(deltas) == detok.output_text == OUTPUT  # leading space of the first token kept
    if name == "byte_level":
        assert detok.output_text == tok.decode(output_ids)


def test_sentencepiece_first_token_keeps_its_space_unlike_a_bare_decode():
    tok = sentencepiece_like()
    prompt_ids, output_ids = split_ids(tok, "I love", " pizza parties!")
    assert tok.decode(output_ids) == "pizza parties!"  # decoding the output alone strips it
    assert stream(tok, prompt_ids, output_ids)[0].output_text == " pizza parties!"


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multibyte_characters_split_across_tokens_never_stream_as_replacement_chars(name):
    tok = TOKENIZERS[name]()
    prompt_ids, output_ids = split_ids(tok, PROMPT, OUTPUT)
    assert any("\ufffd" in tok.decode([t]) for t in output_ids), "precondition: some char spans tokens"
    detok = IncrementalDetokenizer(tok, prompt_ids)
    streamed = ""
    for k, token in enumerate(output_ids, start=1):
        detok.add_tokens([token])
        delta = detok.take_delta(finished=False)
        assert "\ufffd" not in delta
        streamed += delta
        assert OUTPUT.startswith(streamed)
        # a character is streamed no later than a full decode shows it whole
        shown = tok.decode(prompt_ids + output_ids[:k]).rstrip("\ufffd")[len(PROMPT):]
        assert len(streamed) >= len(shown)
    assert streamed == OUTPUT


def test_output_cut_mid_character_never_ends_in_a_replacement_char():
    tok = byte_level_bpe()
    prompt_ids, output_ids = split_ids(tok, PROMPT, " pizza 🍕")
    cut = output_ids[:-1]
    assert tok.decode(cut).endswith("\ufffd")
    detok, deltas, _ = stream(tok, prompt_ids, cut)
    assert "".join(deltas) == detok.output_text == " pizza "


@pytest.mark.parametrize("name", TOKENIZERS)
def test_stop_string_spanning_tokens_is_found_and_excluded(name):
    tok = TOKENIZERS[name]()
    prompt_ids, output_ids = split_ids(tok, PROMPT, OUTPUT)
    assert not any("The END" in tok.decode([t]) for t in output_ids), "precondition: spans tokens"
    detok, deltas, stop = stream(tok, prompt_ids, output_ids, stop=["The END"])
    assert stop == "The END" == detok.stop_reason
    assert detok.output_text == " I love pizza 🍕 and 日本 café! "
    assert "".join(deltas) == detok.output_text  # nothing of the stop string was ever streamed


def test_held_back_text_is_released_when_no_stop_string_matches():
    tok = byte_level_bpe()
    prompt_ids, output_ids = split_ids(tok, PROMPT, OUTPUT)
    detok, deltas, stop = stream(tok, prompt_ids, output_ids, stop=["never appears"])
    assert stop is None
    assert len("".join(deltas[:-1])) <= len(OUTPUT) - len("never appears") + 1
    assert "".join(deltas) == OUTPUT


def test_earliest_stop_string_wins_regardless_of_list_order():
    tok = byte_level_bpe()
    prompt_ids, output_ids = split_ids(tok, PROMPT, OUTPUT)
    detok, deltas, stop = stream(tok, prompt_ids, output_ids, stop=["near", "café", "pizza"])
    assert stop == "pizza"
    assert detok.output_text == "".join(deltas) == " I love "


def test_stop_string_that_completes_first_wins_within_one_chunk():
    tok = byte_level_bpe()
    prompt_ids, output_ids = split_ids(tok, PROMPT, OUTPUT)
    detok, _, stop = stream(tok, prompt_ids, output_ids, chunk=len(output_ids), stop=["love pizza", "ove"])
    assert (stop, detok.output_text) == ("ove", " I l")


def test_stop_string_in_the_prompt_does_not_stop_generation():
    tok = byte_level_bpe()
    prompt_ids, output_ids = split_ids(tok, "Tell me: I love", " pizza")
    detok, deltas, stop = stream(tok, prompt_ids, output_ids, stop=["love"])
    assert stop is None and "".join(deltas) == " pizza"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_are_skipped_only_when_asked(skip):
    tok = byte_level_bpe()
    prompt_ids, output_ids = split_ids(tok, PROMPT, " I love pizza")
    output_ids = output_ids + [tok.eos_token_id]
    detok, deltas, _ = stream(tok, prompt_ids, output_ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(output_ids, skip_special_tokens=skip)
    assert detok.output_text.endswith("<|eos|>") != skip


SMOLLM2 = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(), reason="real SmolLM2 tokenizer folder absent")
def test_real_smollm2_tokenizer_streams_chat_output_exactly():
    """Optional: the default model's real tokenizer (skipped when its folder is absent)."""
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    if not isinstance(prompt_ids, list):
        prompt_ids = prompt_ids["input_ids"]
    text = "Bonjour! 日本語 🍕🎉 — naïve café. Done."
    output_ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    detok, deltas, stop = stream(tok, prompt_ids, output_ids, stop=["Done"])
    assert stop == "Done"
    assert "".join(deltas) == detok.output_text == "Bonjour! 日本語 🍕🎉 — naïve café. "
    assert not any("\ufffd" in d for d in deltas)
