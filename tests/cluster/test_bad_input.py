"""Bad input over real HTTP against the Serve app: every case gets a 4xx whose body is an
OpenAI error object that does not echo what was sent, never a 500, and the server stays
healthy (checked after each case, and by a normal request at the end). Plus the API key.

The app: colocated, a tiny random Llama (its tokenizer is the default model's), 1 decode
replica; bodies limited to 64 KiB so the 413 case stays small."""

from __future__ import annotations

import json
import pickle

import pytest

from serving import deploy, fetch_stats, settled
from serving import http_request as request

pytestmark = pytest.mark.slow

MODEL = "tiny"
MARK = "ZQXMARK"  # put into the bad input where it fits; an error message must never contain it
BODY_LIMIT = 64 << 10


def app_args(model_path: str, **extra) -> dict:
    return {"mode": "colocated", "model": model_path, "served_model_name": MODEL, "max_request_bytes": BODY_LIMIT,
            "engine": {"num_blocks": 128, "max_num_seqs": 8}, **extra}


@pytest.fixture(scope="module")
def app(serve_url):
    """Deploys these app args unless they are the ones deployed already: a test that needs other
    args deploys them and leaves them, and the next test that needs the module's own redeploys."""
    deployed: dict[str, dict] = {}

    def ensure(args: dict) -> None:
        if deployed.get("args") != args:
            deploy(args)
            deployed["args"] = args

    return ensure


@pytest.fixture
def url(serve_url, app, tiny_model_paths):
    """The module's app (app_args), deployed."""
    app(app_args(str(tiny_model_paths["llama"])))
    return serve_url


def chat(**fields) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Hello {MARK}"}], "max_tokens": 4, **fields}
    return json.dumps(body).encode()


def completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": f"Hello {MARK}", "max_tokens": 4, **fields}).encode()


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


LONG_PROMPT = " ".join(f"w{i}" for i in range(1200))  # > 1024 tokens, the tiny model's max_model_len
CHAT, COMP = "/v1/chat/completions", "/v1/completions"

# id → (method, path, body, headers, expected status, expected error param or ... for "any")
CASES = {
    "malformed_json": ("POST", CHAT, b'{"model": "tiny", "messages": [', None, 400, None),
    "body_is_a_json_array": ("POST", CHAT, b"[1, 2, 3]", None, 400, None),
    "body_is_json_null": ("POST", CHAT, b"null", None, 400, None),
    "empty_body": ("POST", CHAT, b"", None, 400, None),
    "temperature_wrong_type": ("POST", CHAT, chat(temperature=MARK), None, 400, "temperature"),
    "messages_not_a_list": ("POST", CHAT, json.dumps({"model": MODEL, "messages": MARK}).encode(), None, 400,
                            "messages"),
    "empty_messages": ("POST", CHAT, chat(messages=[]), None, 400, "messages"),
    "unknown_role": ("POST", CHAT, chat(messages=[{"role": MARK, "content": "hi"}]), None, 400, "messages.0.role"),
    "message_without_role": ("POST", CHAT, chat(messages=[{"content": MARK}]), None, 400, "messages.0.role"),
    "content_part_of_unknown_type": ("POST", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"http://{MARK}"}}]}]), None, 400, ...),
    "unknown_model": ("POST", CHAT, chat(model=MARK), None, 404, "model"),
    "prompt_longer_than_max_model_len": ("POST", CHAT, chat(messages=[{"role": "user", "content": LONG_PROMPT}]),
                                         None, 400, "messages"),
    "max_tokens_zero": ("POST", CHAT, chat(max_tokens=0), None, 400, "max_tokens"),
    "max_tokens_negative": ("POST", CHAT, chat(max_tokens=-5), None, 400, "max_tokens"),
    "max_tokens_above_the_context": ("POST", CHAT, chat(max_tokens=10**12), None, 400, "max_tokens"),
    "max_completion_tokens_zero": ("POST", CHAT, chat(max_completion_tokens=0), None, 400, "max_completion_tokens"),
    "n_too_large": ("POST", CHAT, chat(n=1000), None, 400, "n"),
    "n_zero": ("POST", CHAT, chat(n=0), None, 400, "n"),
    "chat_template_from_the_request": ("POST", CHAT, chat(chat_template_kwargs={"chat_template": f"{{{{ 7*7 }}}}{MARK}"}),
                                       None, 400, "chat_template_kwargs"),
    "priority_without_the_priority_policy": ("POST", CHAT, chat(priority=-1), None, 400, "priority"),
    "chat_template_kwargs_not_an_object": ("POST", CHAT, chat(chat_template_kwargs=[MARK]), None, 400,
                                           "chat_template_kwargs"),
    "temperature_nan": ("POST", CHAT, chat(temperature=0.5).replace(b"0.5", b"NaN"), None, 400, "temperature"),
    "temperature_negative": ("POST", CHAT, chat(temperature=-1), None, 400, "temperature"),
    "temperature_huge": ("POST", CHAT, chat(temperature=1e308), None, 400, "temperature"),
    "temperature_infinite": ("POST", CHAT, chat(temperature=0.5).replace(b"0.5", b"1e999"), None, 400, "temperature"),
    "top_p_zero": ("POST", CHAT, chat(top_p=0), None, 400, "top_p"),
    "top_p_above_one": ("POST", CHAT, chat(top_p=1.5), None, 400, "top_p"),
    "top_k_below_minus_one": ("POST", CHAT, chat(top_k=-2), None, 400, "top_k"),
    "top_k_fractional": ("POST", CHAT, chat(top_k=1.5), None, 400, "top_k"),
    "top_logprobs_too_many": ("POST", CHAT, chat(logprobs=True, top_logprobs=99), None, 400, "top_logprobs"),
    "top_logprobs_without_logprobs": ("POST", CHAT, chat(top_logprobs=2), None, 400, "top_logprobs"),
    "completion_logprobs_too_many": ("POST", COMP, completion(logprobs=99), None, 400, "logprobs"),
    "too_many_stop_strings": ("POST", CHAT, chat(stop=[f"{MARK}{i}" for i in range(17)]), None, 400, ...),
    "stop_string_too_long": ("POST", CHAT, chat(stop=[MARK * 100]), None, 400, ...),
    "stream_options_without_stream": ("POST", CHAT, chat(stream_options={"include_usage": True}), None, 400,
                                      "stream_options"),
    "stream_not_a_bool": ("POST", CHAT, chat(stream=MARK), None, 400, "stream"),
    "seed_negative": ("POST", CHAT, chat(seed=-1), None, 400, "seed"),
    "seed_too_large": ("POST", CHAT, chat(seed=2**64), None, 400, "seed"),
    "min_tokens_above_max_tokens": ("POST", CHAT, chat(min_tokens=10, max_tokens=4), None, 400, ...),
    "presence_penalty_out_of_range": ("POST", CHAT, chat(presence_penalty=5), None, 400, "presence_penalty"),
    "repetition_penalty_zero": ("POST", CHAT, chat(repetition_penalty=0), None, 400, "repetition_penalty"),
    "stop_token_ids_negative": ("POST", CHAT, chat(stop_token_ids=[-1]), None, 400, ...),
    "completion_token_id_outside_vocab": ("POST", COMP, completion(prompt=[1, 10**9]), None, 400, "prompt"),
    "completion_empty_prompt": ("POST", COMP, completion(prompt=""), None, 400, ...),
    "completion_suffix_unsupported": ("POST", COMP, completion(suffix=MARK), None, 400, "suffix"),
    "completion_best_of_unsupported": ("POST", COMP, completion(best_of=3), None, 400, "best_of"),
    "completion_batch_of_mixed_prompts": ("POST", COMP, completion(prompt=[MARK, [1, 2]]), None, 400, "prompt"),
    "completion_batch_over_the_choice_limit": ("POST", COMP, completion(prompt=[MARK] * 65), None, 400, "prompt"),
    "completion_empty_token_list": ("POST", COMP, completion(prompt=[]), None, 400, "prompt"),
    "response_format_json_schema_without_a_schema": ("POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "m"}}), None, 400, "response_format"),
    "response_format_json_schema_keyword_not_enforced": ("POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "m", "schema": {"type": "object", "properties": {
            "s": {"type": "array", "uniqueItems": True, "description": MARK}}}}}), None, 400, "response_format"),
    "response_format_json_schema_pattern_that_does_not_parse": ("POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "m", "schema": {"type": "object", "properties": {
            "s": {"type": "string", "pattern": f"[{MARK}"}}}}}), None, 400, "response_format"),
    "structured_outputs_regex_with_lookaround": ("POST", CHAT, chat(structured_outputs={"regex": f"(?={MARK})a"}),
                                                 None, 400, "structured_outputs"),
    "structured_outputs_grammar_that_does_not_compile": ("POST", CHAT, chat(structured_outputs={
        "grammar": f'root ::= "{MARK}" ('}), None, 400, ...),  # refused by the engine's compiler
    "structured_outputs_structural_tag_of_no_known_shape": ("POST", CHAT, chat(structured_outputs={
        "structural_tag": {"type": "structural_tag", "format": {"type": "nothing"}}}), None, 400, ...),
    "response_format_json_schema_nested_80_deep": ("POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "m", "schema": nested_schema(80)}}), None, 400,
        "response_format"),
    "response_format_json_schema_nested_400_deep": ("POST", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "m", "schema": nested_schema(400)}}), None, 400, ...),
    "tool_choice_auto_unsupported": ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
                                     None, 400, "tool_choice"),
    "tool_choice_names_no_given_tool": ("POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                        tool_choice={"type": "function", "function": {"name": MARK}}), None, 400,
                                        "tool_choice"),
    "tool_parameters_keyword_not_enforced": ("POST", CHAT, chat(tool_choice="required", tools=[{
        "type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "s": {"type": "array", "uniqueItems": True, "description": MARK}}}}}]), None, 400, "tools"),
    "json_schema_keyword_7kb_long": ("POST", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "m", "schema": {"type": "object", MARK * 1000: 1}}}), None, 400, "response_format"),
    "logit_bias_key_not_a_token_id": ("POST", CHAT, chat(logit_bias={MARK: 1}), None, 400, "logit_bias"),
    "logit_bias_out_of_range": ("POST", CHAT, chat(logit_bias={"7": 1000}), None, 400, "logit_bias.7"),
    "logit_bias_token_outside_vocab": ("POST", CHAT, chat(logit_bias={"4000000000": 1}), None, 400, "logit_bias"),
    "logit_bias_key_of_5000_digits": ("POST", CHAT, chat(logit_bias={"9" * 5000: 1}), None, 400, "logit_bias"),
    "logit_bias_same_id_twice": ("POST", CHAT, chat(logit_bias={"7": 1, "007": 2}), None, 400, "logit_bias"),
    "body_over_the_size_limit": ("POST", CHAT, chat(user=MARK * (BODY_LIMIT // len(MARK))), None, 413, None),
    "too_many_headers": ("POST", CHAT, chat(), [(f"X-Pad-{i}", MARK) for i in range(80)], 431, None),
    "headers_too_large": ("POST", CHAT, chat(), {"X-Pad": MARK * 1500}, 431, None),
    "deeply_nested_json": ("POST", CHAT, b'{"model": "tiny", "messages": ' + b"[" * 30_000 + b"]" * 30_000 + b"}",
                           None, 400, None),
    "nested_json_inside_a_field": ("POST", CHAT, chat(user=None).replace(b"null", b"[" * 500 + b"]" * 500), None,
                                   400, "user"),
    "invalid_utf8": ("POST", CHAT, chat().replace(MARK.encode(), b"\xff\xfe" + MARK.encode()), None, 400, None),
    "lone_surrogate": ("POST", CHAT, chat().replace(MARK.encode(), b"\\ud800" + MARK.encode()), None, 400,
                       "messages.0.content"),
    "nul_character": ("POST", CHAT, chat().replace(MARK.encode(), b"\\u0000" + MARK.encode()), None, 400,
                      "messages.0.content"),
    "wrong_content_type": ("POST", CHAT, chat(), {"Content-Type": "text/plain"}, 415, None),
    "pickle_as_json": ("POST", CHAT, pickle.dumps({"model": MODEL, "x": MARK}), None, 400, None),
    "pickle_as_octet_stream": ("POST", CHAT, pickle.dumps({"model": MODEL}),
                               {"Content-Type": "application/octet-stream"}, 415, None),
    "request_timeout_header_not_a_number": ("POST", CHAT, chat(), {"X-Request-Timeout": MARK}, 400,
                                            "X-Request-Timeout"),
    "request_timeout_header_negative": ("POST", CHAT, chat(), {"X-Request-Timeout": "-1"}, 400, "X-Request-Timeout"),
    "get_on_a_post_route": ("GET", CHAT, None, None, 405, None),
    "tokenize_unknown_model": ("POST", "/tokenize", json.dumps({"model": MARK, "prompt": "x"}).encode(), None, 404,
                               "model"),
    "tokenize_continue_final_message": ("POST", "/tokenize", chat(continue_final_message=True), None, 400,
                                        "continue_final_message"),
    "tokenize_tool_choice_auto": ("POST", "/tokenize", chat(tools=[{"type": "function", "function": {"name": "f"}}]),
                                  None, 400, "tool_choice"),  # as chat completions: no "auto" parser
    "tokenize_over_the_size_limit": ("POST", "/tokenize", completion(prompt=MARK * (BODY_LIMIT // len(MARK))), None,
                                     413, None),
    "detokenize_id_outside_vocab": ("POST", "/detokenize", json.dumps({"tokens": [1, 10**9]}).encode(), None, 400,
                                    "tokens"),
    "detokenize_not_ids": ("POST", "/detokenize", json.dumps({"tokens": MARK}).encode(), None, 400, "tokens"),
    "unknown_route": ("POST", f"/v1/{MARK}", chat(), None, 404, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_an_openai_error_and_the_server_stays_healthy(url, case):
    method, path, body, headers, status, param = CASES[case]
    got, resp_headers, raw = request(url, method, path, body, headers)
    assert got == status, (case, got, raw[:300])
    assert resp_headers.get("content-type", "").startswith("application/json")
    err = json.loads(raw)["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] and "code" in err and "param" in err
    if param is not ...:
        assert err["param"] == param, err
    assert MARK not in raw.decode(errors="replace")  # nothing the client sent is echoed back
    assert request(url, "GET", "/health")[0] == 200


def test_internal_kv_fields_from_a_client_are_ignored(url):
    plain = json.loads(request(url, "POST", CHAT, chat(temperature=0, max_tokens=8))[2])
    forged = {"kv_transfer_params": {"remote_host": "10.0.0.1", "remote_port": 1, "do_remote_prefill": True},
              "receiver": {"address": "tcp://10.0.0.1:1"}, "request_id": "forged", "prompt_token_ids": [1, 2, 3]}
    status, _, raw = request(url, "POST", CHAT, chat(temperature=0, max_tokens=8, **forged))
    assert status == 200
    got = json.loads(raw)
    assert got["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    counts = ("prompt_tokens", "completion_tokens")  # (cached_tokens: the same prompt again, now cached)
    assert [got["usage"][k] for k in counts] == [plain["usage"][k] for k in counts] and got["id"] != "forged"


def test_after_every_bad_request_the_server_still_serves_and_holds_nothing(url):
    status, _, raw = request(url, "POST", CHAT, chat(temperature=0, max_tokens=6))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 6
    stats = settled(url)
    assert list(stats) == ["decode"]
    decode = stats["decode"]
    assert decode["blocks_in_use"] == 0 and decode["num_running"] == 0 and decode["num_waiting"] == 0


def test_api_key_guards_v1_and_tokenize_but_not_health(serve_url, app, tiny_model_paths):
    url = serve_url
    app(app_args(str(tiny_model_paths["llama"]), api_key="sk-tandem-test"))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-tandem-test"}):
        for method, path, body in (("POST", CHAT, chat()), ("POST", COMP, completion()),
                                   ("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                                   ("GET", "/debug/stats", None), ("POST", "/tokenize", completion()),
                                   ("POST", "/detokenize", b'{"tokens": [1]}')):
            status, _, raw = request(url, method, path, body, headers)
            assert status == 401, (path, headers, status)
            err = json.loads(raw)["error"]
            assert err["type"] == "authentication_error" and "sk-tandem-test" not in raw.decode()
    assert request(url, "GET", "/health")[0] == 200
    ok = {"Authorization": "Bearer sk-tandem-test"}
    assert request(url, "GET", "/v1/models", None, ok)[0] == 200
    assert request(url, "POST", CHAT, chat(), ok)[0] == 200
    assert request(url, "POST", "/tokenize", completion(), ok)[0] == 200


def test_overload_beyond_the_limit_is_a_fast_503_and_admitted_requests_finish(serve_url, app, tiny_model_paths):
    import concurrent.futures
    import time

    url = serve_url

    # one sequence at a time on the engine and 4 samples of 300 tokens per request, so three
    # requests stay in flight for seconds even on the tiny model (3,600 steps one after another)
    args = app_args(str(tiny_model_paths["llama"]), max_concurrent_requests=3)
    args["engine"] = {**args["engine"], "max_num_seqs": 1}
    app(args)
    long = chat(max_tokens=300, ignore_eos=True, temperature=0, n=4)
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        def sent(_):
            status, headers, raw = request(url, "POST", CHAT, long)
            return status, time.monotonic(), raw, headers
        # five at once: three are admitted, two refused at once
        submitted = time.time()
        burst = [pool.submit(sent, i) for i in range(5)]
        deadline, seen = time.monotonic() + 30, []
        while True:  # the three admitted are inside the server: the board read every 0.1 s, its
            # posts made since the burst was sent (the previous app's replicas linger on it for its
            # staleness window, their last posts as they were) and within the last 0.3 s
            now = time.time()
            busy = sum(d.get("num_running", 0) + d.get("num_waiting", 0) for d in fetch_stats(url)
                       if submitted < d.get("posted_at", 0) > now - 0.3)
            if busy >= 10:  # at most two of the twelve samples done: each request has 300+ steps
                break       # left, longer than the board's lag and the next request's way in
            seen.append(busy)
            answered = [f.result()[::2] for f in burst if f.done() and f.result()[0] != 503]  # (not in flight)
            assert not answered and time.monotonic() < deadline, \
                f"three requests never were in flight together: {seen[-20:]}, answered: {answered}"
            time.sleep(0.1)
        refused_first = [f.result() for f in burst if f.done() and f.result()[0] == 503]
        t0 = time.monotonic()
        status, headers, raw = request(url, "POST", CHAT, chat())
        refused_at = time.monotonic()
        outcomes = [f.result() for f in burst]
    results = [(s, t, raw_) for s, t, raw_, _ in outcomes if s == 200]
    assert len(results) == 3 and len(refused_first) == 2, [s for s, *_ in outcomes]
    assert all(h.get("retry-after") == "1" and json.loads(r)["error"]["code"] == "overloaded"
               for _, _, r, h in refused_first)
    assert status == 503 and headers.get("retry-after") == "1", (status, raw)
    assert json.loads(raw)["error"]["code"] == "overloaded"
    assert refused_at - t0 < 0.5  # refused at once, not queued
    for status, _, body in results:  # what was admitted still completes, untouched
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4 * 300
    assert max(finished for _, finished, _ in results) > refused_at
    assert request(url, "POST", CHAT, chat())[0] == 200  # room again
