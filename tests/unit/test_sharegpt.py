"""The ShareGPT loader: a JSON array cut short still gives every complete conversation, and the
requests keep their real lengths within the caps, drawn the same way for the same seed."""

from __future__ import annotations

import json

import pytest

from cluster.sharegpt import Caps, first_exchange, iter_json_array, load_exchanges, sample_requests


def conversation(i: int, reply_words: int = 5) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i} with \"quotes\", [brackets] and {{braces}} é"},
        {"from": "gpt", "value": " ".join(["word"] * reply_words)}]}


CONVERSATIONS = [conversation(i) for i in range(6)]
TEXT = json.dumps(CONVERSATIONS, indent=2, ensure_ascii=False)


def cut_inside(k: int) -> str:
    """TEXT cut in the middle of conversation k (inside its human turn's string)."""
    start = TEXT.index(f'"c{k}"')
    return TEXT[:TEXT.index("question", start) + 12]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_cut_array_gives_the_complete_items_before_the_cut(k):
    assert list(iter_json_array(cut_inside(k))) == CONVERSATIONS[:k]


def test_a_cut_right_after_an_item_or_its_comma_keeps_that_item():
    end_of_2 = TEXT.index('"c3"')
    end_of_2 = TEXT.rindex("}", 0, end_of_2) + 1
    assert list(iter_json_array(TEXT[:end_of_2])) == CONVERSATIONS[:3]
    assert list(iter_json_array(TEXT[:end_of_2 + 1])) == CONVERSATIONS[:3]


def test_a_whole_array_gives_every_item():
    assert list(iter_json_array(TEXT)) == CONVERSATIONS
    assert list(iter_json_array("[]")) == []


def test_load_exchanges_reads_a_cut_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    inside_4 = TEXT[:TEXT.index("é", TEXT.index('"c4"')) + 1]
    path.write_bytes(inside_4.encode()[:-1])  # the cut splits a two-byte character
    pairs = load_exchanges(path)
    assert [p for p, _ in pairs] == [c["conversations"][0]["value"] for c in CONVERSATIONS[:4]]


def test_the_first_exchange_is_the_first_human_turn_and_the_gpt_turn_answering_it():
    turns = [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yes"},
             {"from": "human", "value": "later"}, {"from": "gpt", "value": "no"}]
    assert first_exchange({"conversations": turns}) == ("hi", "yes")
    unanswered = [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]
    assert first_exchange({"conversations": unanswered}) is None
    assert first_exchange({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": " "}]}) is None
    assert first_exchange({"conversations": []}) is None


class Words:
    """A tokenizer whose tokens are words."""

    def encode(self, text):
        return text.split()

    def decode(self, ids):
        return " ".join(ids)


def test_requests_keep_real_lengths_within_the_caps():
    exchanges = [(" ".join(["p"] * n), " ".join(["r"] * m)) for n, m in [(3, 10), (50, 2), (8, 500), (20, 40)]]
    caps = Caps(max_prompt_tokens=10, max_output_tokens=32, min_output_tokens=4)
    got = sorted((r.prompt_tokens, len(r.prompt.split()), r.max_tokens)
                 for r in sample_requests(exchanges, 3, seed=0, tokenizer=Words(), caps=caps))
    # (50, 2) is dropped (reply under 4 tokens); 20 prompt words are cut to 10; 500 reply tokens to 32
    assert got == [(3, 3, 10), (8, 8, 32), (10, 10, 32)]
    with pytest.raises(ValueError):
        sample_requests(exchanges, 4, seed=0, tokenizer=Words(), caps=caps)


def test_the_same_seed_draws_the_same_requests():
    exchanges = [(f"prompt {i}", "a b c d e") for i in range(200)]
    draw = [r.prompt for r in sample_requests(exchanges, 20, seed=7, tokenizer=Words())]
    assert draw == [r.prompt for r in sample_requests(exchanges, 20, seed=7, tokenizer=Words())]
    assert draw != [r.prompt for r in sample_requests(exchanges, 20, seed=8, tokenizer=Words())]
    assert len(set(draw)) == 20
