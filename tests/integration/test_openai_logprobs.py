"""Logprobs over the in-process OpenAI server (colocated, and disaggregated over TCP): the
completions object's text offsets, `echo` scoring the prompt as lm-eval asks, and vLLM's
`prompt_logprobs`."""

from __future__ import annotations

import pytest

from cluster.sampling_params import SamplingParams
from openai_helpers import MODEL, NEAR_TIE, chat, drain, greedy_agreement, run


def test_completion_logprobs_carry_text_offsets_streamed_or_not(stack):
    body = {"model": MODEL, "prompt": "Once upon", "temperature": 0, "max_tokens": 8, "logprobs": 2}

    async def go():
        full = await stack["disagg"].completions(body)
        return full, await drain(await stack["disagg"].completions({**body, "stream": True}))

    full, chunks = run(go())
    lp = full["choices"][0]["logprobs"]
    assert len(lp["text_offset"]) == len(lp["tokens"]) == 8
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(8)]
    # The streamed reply is a second greedy run: its tokens, offsets and scores are the first
    # run's (up to a near-tie, where float noise may pick either of the top two)
    parts = [c["choices"][0]["logprobs"] for c in chunks[:-1] if c["choices"][0]["logprobs"]]
    tokens = [t for p in parts for t in p["tokens"]]
    offsets = [o for p in parts for o in p["text_offset"]]
    scores = [x for p in parts for x in p["token_logprobs"]]
    assert len(tokens) == 8 and offsets == [sum(len(t) for t in tokens[:i]) for i in range(8)]
    assert "".join(tokens) == "".join(c["choices"][0]["text"] for c in chunks[:-1])
    agreed = greedy_agreement(lp["tokens"], tokens, lp["top_logprobs"])
    assert offsets[:agreed] == lp["text_offset"][:agreed]
    assert scores[:agreed] == pytest.approx(lp["token_logprobs"][:agreed], abs=NEAR_TIE)


def test_echo_scores_the_prompt_as_generation_scored_its_tokens(stack):
    """lm-eval's loglikelihood request (echo + logprobs + max_tokens 1): the prompt comes back
    scored, its first token null; a reply's tokens, sent back as prompt, score as they were
    generated; both pools agree, streamed or not."""
    colocated = stack["colocated"]
    prompt = "Once upon a time"
    prompt_ids = colocated.tokenizer.encode(prompt)
    body = {"model": MODEL, "temperature": 0, "logprobs": 2, "echo": True, "ignore_eos": True}

    async def go():
        gen = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
        deltas = [d async for ds in colocated.generate("echo-gen", prompt_ids, gen) for d in ds]
        reply = ([t for d in deltas for t in d.token_ids], [e.sampled.logprob for d in deltas for e in d.logprobs])
        rescored = {name: await stack[name].completions({**body, "prompt": prompt_ids + reply[0], "max_tokens": 1})
                    for name in ("colocated", "disagg")}
        streamed = await drain(await stack["disagg"].completions({**body, "prompt": prompt, "max_tokens": 6,
                                                                   "stream": True, "n": 2}))
        only = {"prompt": prompt_ids + reply[0], "max_tokens": 0}  # echo alone: the prompt scored, nothing more
        echo_only = [await stack["disagg"].completions({**body, **only}),
                     await drain(await stack["colocated"].completions({**body, **only, "stream": True}))]
        return reply, rescored, streamed, echo_only

    (reply_ids, reply_lps), rescored, streamed, (whole, chunks) = run(go())
    n = len(prompt_ids)
    for name, out in rescored.items():
        choice = out["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(colocated.tokenizer.hf.decode(prompt_ids + reply_ids)), name
        assert len(lp["tokens"]) == n + 6 + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
        assert lp["token_logprobs"][n:n + 6] == pytest.approx(reply_lps, abs=1e-4)
        assert all(len(top) == 2 and max(top.values()) >= score - 1e-6
                   for top, score in zip(lp["top_logprobs"][1:], lp["token_logprobs"][1:]))
        assert out["usage"] == {"prompt_tokens": n + 6, "completion_tokens": 1, "total_tokens": n + 7,
                                "prompt_tokens_details": {"cached_tokens": 0}}  # a scored prompt is computed
    for j in (0, 1):
        parts = [c["choices"][0] for c in streamed[:-1] if c["choices"][0]["index"] == j]
        assert parts[0]["text"].startswith(prompt)  # the choice's first chunk starts with the prompt
        assert "".join(p["text"] for p in parts) == prompt + colocated.tokenizer.hf.decode(reply_ids)
        scores = [x for p in parts if p["logprobs"] for x in p["logprobs"]["token_logprobs"]]
        assert scores[0] is None and scores[n:] == pytest.approx(reply_lps, abs=1e-4)
        rescored_prompt = rescored["colocated"]["choices"][0]["logprobs"]["token_logprobs"][1:n]
        assert scores[1:n] == pytest.approx(rescored_prompt, abs=1e-4)
    scored = rescored["colocated"]["choices"][0]["logprobs"]
    text = colocated.tokenizer.hf.decode(prompt_ids + reply_ids)
    assert whole["choices"][0]["text"] == text and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 0
    assert whole["choices"][0]["logprobs"]["tokens"] == scored["tokens"][:-1]
    assert whole["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(scored["token_logprobs"][1:-1],
                                                                                 abs=1e-4)
    parts = [c["choices"][0] for c in chunks[:-1]]
    assert "".join(p["text"] for p in parts) == text and parts[-1]["finish_reason"] == "length"
    assert [t for p in parts if p["logprobs"] for t in p["logprobs"]["tokens"]] == scored["tokens"][:-1]


def test_prompt_logprobs_extra_scores_the_prompt_with_ranks(stack):
    """vLLM's `prompt_logprobs` (what reward scorers and eval scripts read): every prompt token
    after the first with its logprob, vocabulary rank, text and top alternatives, the scores
    echo gives; both pools agree; n samples share one scoring; chat scores its templated prompt;
    with echo as well, each keeps its own number of alternatives."""
    colocated = stack["colocated"]
    prompt = "Once upon a time there was"
    ids = colocated.tokenizer.encode(prompt)
    chat_ids = colocated.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    base = {"model": MODEL, "temperature": 0, "max_tokens": 2}

    async def go():
        echo = await colocated.completions({**base, "prompt": prompt, "echo": True, "logprobs": 3})
        extra = {name: await stack[name].completions({**base, "prompt": prompt, "prompt_logprobs": 3, "n": 2,
                                                      "temperature": 1.0, "seed": 3})
                 for name in ("colocated", "disagg")}
        both = await colocated.completions({**base, "prompt": prompt, "echo": True, "logprobs": 1,
                                           "prompt_logprobs": 3})
        in_chat = await stack["disagg"].chat(chat(max_tokens=2, prompt_logprobs=0,
                                                  messages=[{"role": "user", "content": "Hello there"}]))
        as_text = await colocated.completions({**base, "prompt": chat_ids, "prompt_logprobs": 0})
        return echo, extra, both, in_chat, as_text

    echo, extra, both, in_chat, as_text = run(go())
    want = echo["choices"][0]["logprobs"]
    for name, out in extra.items():
        first = out["choices"][0]["prompt_logprobs"]
        assert [c["prompt_logprobs"] for c in out["choices"]] == [first, first], name  # one prompt, one scoring
        assert out["choices"][0]["logprobs"] is None and not out["choices"][0]["text"].startswith(prompt)
        assert len(first) == len(ids) and first[0] is None
        for p, entry in enumerate(first[1:], start=1):
            mine = entry[str(ids[p])]
            assert mine["logprob"] == pytest.approx(want["token_logprobs"][p], abs=1e-4), (name, p)
            assert mine["decoded_token"] == colocated.tokenizer.hf.decode([ids[p]]) == want["tokens"][p]
            top = sorted((e for key, e in entry.items() if e["rank"] <= 3), key=lambda e: e["rank"])
            assert [e["rank"] for e in top] == [1, 2, 3]
            if len(want["top_logprobs"][p]) == 3:  # (echo's are keyed by text: two tokens may share one)
                assert [e["logprob"] for e in top] == pytest.approx(sorted(want["top_logprobs"][p].values(),
                                                                           reverse=True), abs=1e-4)
            if mine["rank"] > 3:  # not among the top 3: then below them, else it is the one of its rank
                assert len(entry) == 4 and mine["logprob"] <= top[-1]["logprob"]
            else:
                assert len(entry) == 3 and top[mine["rank"] - 1] is mine
    assert all(top is None or len(top) == 1 for top in both["choices"][0]["logprobs"]["top_logprobs"])
    assert both["choices"][0]["prompt_logprobs"] == extra["colocated"]["choices"][0]["prompt_logprobs"]
    scores = in_chat["prompt_logprobs"]
    assert "prompt_logprobs" not in in_chat["choices"][0]
    assert len(scores) == in_chat["usage"]["prompt_tokens"] == len(chat_ids) and scores[0] is None
    assert [list(e) for e in scores[1:]] == [[str(t)] for t in chat_ids[1:]]  # k = 0: the token alone
    text_scores = as_text["choices"][0]["prompt_logprobs"]
    for e, t in zip(scores[1:], text_scores[1:]):
        (key, mine), = e.items()
        assert mine["rank"] == t[key]["rank"] and mine["logprob"] == pytest.approx(t[key]["logprob"], abs=1e-4)
