"""vLLM's /tokenize and /detokenize over the in-process OpenAI server: a client counting its
prompt before sending it gets the count the completion's usage will report (chat template and
tool calls included), and token ids decode back to the text they came from."""

from __future__ import annotations

import pytest

from cluster.router.errors import APIError
from cluster.router.tokenize_api import detokenize, tokenize
from openai_helpers import MODEL, chat, run

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tokenize_counts_what_the_completion_uses(stack):
    server = stack["colocated"]
    prompt = "The capital of France is"
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def go():
        return (await server.completions({"model": MODEL, "prompt": prompt, "max_tokens": 1}),
                await server.chat(chat(messages=messages, max_tokens=1)),
                await server.chat(chat(messages=messages, max_tokens=1, tools=TOOLS, tool_choice=named)))

    as_text, as_chat, with_tools = run(go())
    text = tokenize(server, {"model": MODEL, "prompt": prompt, "return_token_strs": True})
    assert text["count"] == len(text["tokens"]) == as_text["usage"]["prompt_tokens"]
    assert text["tokens"] == server.tokenizer.encode(prompt) and text["max_model_len"] == server.max_model_len
    assert "".join(text["token_strs"]).replace("Ġ", " ") == prompt  # the tokens' own strings (byte-level BPE)
    assert detokenize(server, {"tokens": text["tokens"]}) == {"prompt": prompt}

    in_chat = tokenize(server, {"messages": messages})  # model is optional, as in vLLM
    assert in_chat["count"] == as_chat["usage"]["prompt_tokens"] and in_chat["token_strs"] is None
    shown = detokenize(server, {"model": MODEL, "tokens": in_chat["tokens"]})["prompt"]
    assert shown == server.tokenizer.chat_prompt(messages) and "What is the weather in Paris?" in shown
    bare = tokenize(server, {"messages": messages, "add_generation_prompt": False})
    assert bare["tokens"] == in_chat["tokens"][:bare["count"]] and bare["count"] < in_chat["count"]
    go_on = messages + [{"role": "assistant", "content": "It is sunny and"}]
    cont = tokenize(server, {"messages": go_on, "continue_final_message": True, "add_generation_prompt": False})
    assert detokenize(server, {"tokens": cont["tokens"]})["prompt"].endswith("<|im_start|>assistant\nIt is sunny and")
    tools = tokenize(server, {"messages": messages, "tools": TOOLS, "tool_choice": named})
    assert tools["count"] == with_tools["usage"]["prompt_tokens"] > in_chat["count"]  # the tools are described


@pytest.mark.parametrize("call,body,status,param", [
    (tokenize, {"model": "nope", "prompt": "x"}, 404, "model"),
    (tokenize, {"prompt": 5}, 400, "prompt"),
    (tokenize, {"messages": []}, 400, "messages"),
    (tokenize, {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message"),  # and add_generation_prompt, true by default
    (tokenize, [1], 400, None),
    (detokenize, {"tokens": [1, -1]}, 400, "tokens"),
    (detokenize, {"tokens": ["a"]}, 400, "tokens.0"),
])
def test_bad_tokenize_requests_get_openai_errors(stack, call, body, status, param):
    with pytest.raises(APIError) as info:
        call(stack["colocated"], body)
    assert info.value.status == status and info.value.param == param
