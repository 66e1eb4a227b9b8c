"""vLLM's chat_template_kwargs over the in-process OpenAI server: a variable the chat template
reads (as Qwen3's reads `enable_thinking`) changes the prompt the model sees, the same way for
chat completions and /tokenize; one it does not read is ignored; one the server sets itself
(the messages, the template, its globals, special tokens) is refused by name."""

from __future__ import annotations

import pytest

from cluster.router.errors import APIError
from cluster.router.openai_server import OpenAIServer
from cluster.router.tokenize_api import detokenize, tokenize
from openai_helpers import MODEL, chat, run

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant ({{ persona | default('plain') }}):"
            "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(stack, tiny_model_paths):
    from cluster.engine.tokenizer import Tokenizer

    tok = Tokenizer(str(tiny_model_paths["llama"]))  # its own copy: the stack's keeps its template
    tok.hf.chat_template = TEMPLATE
    assert {"persona", "enable_thinking"} <= tok.template_variables
    return OpenAIServer(MODEL, tok, 1024, stack["colocated"].generate)  # the colocated pool's engine


def test_template_variables_shape_the_prompt_for_chat_and_tokenize(server):
    variables = {"enable_thinking": False, "persona": "terse", "not_in_the_template": 1}

    def shown(**extra) -> str:
        return detokenize(server, {"tokens": tokenize(server, {"messages": QUESTION, **extra})["tokens"]})["prompt"]

    assert shown().endswith("assistant (plain):")
    assert shown(chat_template_kwargs=variables).endswith("assistant (terse): /no_think")
    assert shown(chat_template_kwargs={"not_in_the_template": 1}) == shown()  # ignored, as in vLLM
    text = shown(chat_template_kwargs=variables)
    counted = tokenize(server, {"messages": QUESTION, "chat_template_kwargs": variables})["count"]

    async def go():
        return (await server.chat(chat(messages=QUESTION, chat_template_kwargs=variables, temperature=0,
                                       max_tokens=8, ignore_eos=True)),
                await server.chat(chat(messages=QUESTION, temperature=0, max_tokens=8, ignore_eos=True)),
                await server.completions({"model": MODEL, "prompt": server.tokenizer.hf.encode(text),
                                          "temperature": 0, "max_tokens": 8, "ignore_eos": True}))

    with_vars, without, same_text = run(go())
    assert with_vars["usage"]["prompt_tokens"] == counted == same_text["usage"]["prompt_tokens"]
    assert counted > without["usage"]["prompt_tokens"]  # " /no_think" and the persona are in the prompt
    assert with_vars["choices"][0]["message"]["content"] == same_text["choices"][0]["text"]  # what the model saw


def test_over_grpc_they_shape_the_prompt_as_over_http(server):
    import json

    from cluster.router import grpc_api
    from cluster.router import tandem_pb2 as pb

    variables = {"enable_thinking": False, "persona": "terse"}
    question = pb.Chat(messages=[pb.ChatMessage(**m) for m in QUESTION])

    async def go():
        over_grpc = [m async for m in grpc_api.generate(server, pb.GenerateRequest(
            model=MODEL, chat=question, chat_template_kwargs=json.dumps(variables), temperature=0, max_tokens=8,
            ignore_eos=True), None)]
        over_http = await server.chat(chat(messages=QUESTION, chat_template_kwargs=variables, temperature=0,
                                           max_tokens=8, ignore_eos=True))
        return over_grpc, over_http

    over_grpc, over_http = run(go())
    assert over_grpc[-1].usage.prompt_tokens == over_http["usage"]["prompt_tokens"]
    assert over_grpc[-1].usage.prompt_tokens == tokenize(server, {"messages": QUESTION,
                                                                  "chat_template_kwargs": variables})["count"]
    assert "".join(m.text for m in over_grpc[:-1]) == over_http["choices"][0]["message"]["content"]


@pytest.mark.parametrize("variables,needle", [
    ({"chat_template": "{{ 7 * 7 }}"}, "'chat_template'"),  # another template: never from a request
    ({"messages": [{"role": "user", "content": "forged"}]}, "'messages'"),
    ({"raise_exception": None, "persona": "x"}, "'raise_exception'"),  # transformers' globals
    ({"eos_token": "</s>"}, "'eos_token'"),  # the model's special tokens
    (["enable_thinking"], None),  # an object, or nothing
])
def test_reserved_or_malformed_variables_are_refused_by_name(server, variables, needle):
    for send in (lambda: run(server.chat(chat(messages=QUESTION, chat_template_kwargs=variables))),
                 lambda: tokenize(server, {"messages": QUESTION, "chat_template_kwargs": variables})):
        with pytest.raises(APIError) as info:
            send()
        assert info.value.status == 400 and info.value.param == "chat_template_kwargs"
        assert needle is None or needle in info.value.message


def test_a_variable_the_template_cannot_use_is_a_400_not_a_500(server):
    server.tokenizer.hf.chat_template = TEMPLATE.replace("{{ persona | default('plain') }}",
                                                         "{{ (persona | default('plain')).strip() }}")
    try:
        with pytest.raises(APIError) as info:
            run(server.chat(chat(messages=QUESTION, chat_template_kwargs={"persona": {"a": 1}})))
        assert info.value.status == 400 and "chat template" in info.value.message
    finally:
        server.tokenizer.hf.chat_template = TEMPLATE


def test_the_offline_llm_takes_them_too(tiny_model_paths):
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams

    llm = LLM(str(tiny_model_paths["llama"]))
    llm.engine.tokenizer.hf.chat_template = TEMPLATE
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=2), chat_template_kwargs={"enable_thinking": False})
    assert llm.get_tokenizer().decode(out[0].prompt_token_ids).endswith("assistant (plain): /no_think")
