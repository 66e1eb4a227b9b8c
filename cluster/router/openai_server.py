"""The OpenAI API as a plain object: validate, tokenize, fan out n samples to a `generate`
function (the decode pool, or an in-process decode server in tests), and shape responses.

    chat(body) / completions(body)
      → request schema (400 on anything invalid, 404 on an unknown model)
      → prompt token ids (chat template for chat; tool calls: router/tools.py plans them and
        holds the reply to their JSON), limits checked against max_model_len
      → n child requests "<id>-<j>" with seed + j, run concurrently (a completions batch of
        P prompts: P x n children, choice i*n + j is prompt i's sample j, as OpenAI orders them)
      → one response, or an SSE stream: role chunk, content chunks (several tokens per chunk
        when the client is behind; tool_calls deltas instead when calls were asked for), a
        finish chunk per choice, usage when asked, [DONE]
      completions `echo`: each choice's text (and, with `logprobs`, its logprobs) starts with
        its prompt's; the prompt's are scored by the engine (`prompt_logprobs`) with the first
        token's logprob null, as OpenAI's legacy API returns them
      vLLM's `prompt_logprobs` (either API, not streamed): each prompt token's score, rank and
        alternatives (router/logprobs.py), per choice (completions) or once (chat); the n
        samples of a prompt share the scores of its first
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable, NamedTuple

import orjson

from cluster.engine.outputs import TokenDelta, TokenLogprobs
from cluster.router.logprobs import echo_entries, openai_logprobs, vllm_prompt_logprobs
from cluster.router.errors import APIError, parse_body
from cluster.router.protocol import ChatCompletionRequest, ChatPrompt, CompletionRequest
from cluster.router.streams import SSEStream, deadline_after, merge_samples, within
from cluster.router.tools import CallStream, ToolPlan, messages as template_messages, plan as tool_plan
from cluster.sampling_params import SamplingParams

GenerateFn = Callable[[str, list[int], SamplingParams], AsyncIterator[list[TokenDelta]]]


@dataclasses.dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached_tokens: int | None = None  # its prompt's tokens served by a prefix cache (first delta's)


class Child(NamedTuple):
    """One choice: its own id ("<id>-<choice index>"), its prompt, its params (seed + j)."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated request: its sampling parameters, id, and the children to run, one per choice."""

    kind: str  # "chat" | "text"
    request: Any  # ChatCompletionRequest | CompletionRequest
    params: SamplingParams
    request_id: str
    children: list[Child]  # in choice order
    prompt_tokens: int  # usage: every prompt's tokens, once each (n samples share their prompt)
    tools: ToolPlan | None = None  # chat: the calls the reply is held to (router/tools.py)
    echo: list[str] | None = None  # completions with echo: per prompt, the text each choice starts with

    def cached_tokens(self, per_choice: list[int | None]) -> int:
        """usage's cached_tokens: per prompt, what its first sample found cached (as prompt_tokens
        counts each prompt once)."""
        return sum(per_choice[i] or 0 for i in range(0, len(per_choice), self.request.n))

    def echo_of(self, choice: int) -> str | None:
        return None if self.echo is None else self.echo[choice // self.request.n]

    @property
    def echo_only(self) -> bool:
        return self.kind == "text" and self.request.echo_only


class OpenAIServer:
    def __init__(self, model_name: str, tokenizer: Any, max_model_len: int, generate: GenerateFn,
                 clock: Callable[[], float] = time.time,
                 map_error: Callable[[BaseException], APIError] | None = None,
                 scheduling_policy: str = "fcfs", read_ahead: bool = True) -> None:
        self.model_name = model_name
        self.scheduling_policy = scheduling_policy  # the pools' (a request's `priority` needs "priority")
        self.tokenizer = tokenizer  # cluster.engine.tokenizer.Tokenizer
        self.max_model_len = max_model_len
        self.generate = generate
        # False: each read of a `generate` stream takes all that arrived since the last (the
        # router's multiplexed buffers), so a single choice needs no task reading ahead of it
        self.read_ahead = read_ahead
        self.clock = clock
        # what an error from `generate` becomes in an error chunk (after the first byte)
        self.map_error = map_error or (lambda exc: APIError(500, f"generation failed: {type(exc).__name__}",
                                                            type_="internal_error"))

    def models(self, model_id: str | None = None) -> dict[str, Any]:
        if model_id is not None:
            self.check_model(model_id)  # GET /v1/models/{model_id}: this model's card, or a 404
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tandem",
                "max_model_len": self.max_model_len}
        return card if model_id is not None else {"object": "list", "data": [card]}

    # -- entry points ----------------------------------------------------------------
    async def chat(self, body: Any, timeout_s: float | None = None) -> dict[str, Any] | SSEStream:
        """`timeout_s`: the request's deadline, from now (408 before the first byte, an error
        chunk after it)."""
        deadline = deadline_after(timeout_s)
        return await self._run(self.prepare("chat", body), deadline)

    async def completions(self, body: Any, timeout_s: float | None = None) -> dict[str, Any] | SSEStream:
        deadline = deadline_after(timeout_s)
        return await self._run(self.prepare("text", body), deadline)

    def prepare(self, kind: str, body: Any) -> Prepared:
        """A chat ("chat") or completions ("text") request body, validated, tokenized and
        checked against the context: raises APIError on anything the client got wrong."""
        if kind == "chat":
            req = parse_body(ChatCompletionRequest, body)
            self.check_model(req.model)
            req.check_stream_options()
            req.check_supported()
            ids, tools = self.chat_prompt(req)
            held = req.held()
            if tools is not None and held is not None:
                raise APIError(400, "response_format or structured_outputs and a tool_choice that calls tools "
                                    "exclude each other", param="response_format")
            if req.continue_final_message and (tools is not None or (held is not None and held.is_json)):  # its JSON starts the reply
                raise APIError(400, "continue_final_message cannot be held to JSON (response_format, tool calls)",
                               param="continue_final_message")
            prompts = [ids]
        else:
            req = parse_body(CompletionRequest, body)
            self.check_model(req.model)
            req.check_stream_options()
            req.check_supported()
            tools = None
            prompts = [self._completion_prompt(p) for p in req.prompts()]
        req.check_extras()
        prompts = [req.truncated(ids, self.max_model_len) for ids in prompts]
        if req.priority and self.scheduling_policy != "priority":  # as vLLM: not silently first-come
            raise APIError(400, "priority scheduling is not enabled (the engine's scheduling_policy is "
                                f"{self.scheduling_policy!r})", param="priority")
        limits = [self._limits(ids, req.requested_max_tokens()) for ids in prompts]  # each its own room
        bias = req.logit_bias_ids(self.tokenizer.vocab_size)
        extras = req.token_fields(self.tokenizer.hf, self.tokenizer.vocab_size)
        per_prompt = [req.sampling_params(limit, req.requested_logprobs(), bias, **extras) for limit in limits]
        if tools is not None:
            per_prompt = [dataclasses.replace(ps, structured=tools.schema) for ps in per_prompt]
        echo = None
        if kind == "text" and req.echo:
            echo = [p if isinstance(p, str) and req.truncate_prompt_tokens is None else self.tokenizer.hf.decode(ids)
                    for p, ids in zip(req.prompts(), prompts)]
        scored = req.requested_prompt_logprobs()
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        # a prompt is scored once, by its first sample, unless every choice streams its own echo
        children = [Child(f"{rid}-{i * req.n + j}", ids, dataclasses.replace(
                        ps, seed=_child_seed(ps.seed, j), prompt_logprobs=scored if j == 0 or req.stream else None))
                    for i, (ids, ps) in enumerate(zip(prompts, per_prompt)) for j in range(req.n)]
        return Prepared(kind, req, per_prompt[0], rid, children, sum(len(ids) for ids in prompts), tools, echo)

    def chat_prompt(self, req: ChatPrompt) -> tuple[list[int], ToolPlan | None]:
        """A chat request's (or /tokenize's) prompt ids through the chat template, and the tool
        calls its reply is held to."""
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt exclude each other: set "
                                "add_generation_prompt to false", param="continue_final_message")
        tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        native = self.tokenizer.template_takes_tools
        messages = template_messages([m.as_dict() for m in req.messages], tools, native)
        try:
            return self.tokenizer.encode_chat(messages, tools.tools if tools and native else None,
                                              req.add_generation_prompt, req.continue_final_message,
                                              req.chat_template_kwargs), tools
        except Exception as exc:  # a template that rejects this conversation
            raise APIError(400, f"cannot apply the chat template: {type(exc).__name__}") from None

    def _completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if any(t < 0 or t >= self.tokenizer.vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", param="prompt")
        return list(prompt)

    def samples(self, p: Prepared) -> AsyncIterator[tuple[int, TokenDelta]]:
        """The choices of a prepared request, running concurrently, as (choice, delta);
        closing it aborts them."""
        return merge_samples([self.generate(*c) for c in p.children], self.read_ahead)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.hf.decode([token_id])

    # -- shared ----------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the requested model does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")

    def _limits(self, prompt_ids: list[int], requested: int | None) -> int:
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="messages")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} tokens; "
                                f"the prompt has {len(prompt_ids)} tokens", param="messages",
                           code="context_length_exceeded")
        if requested is not None and requested > room:
            raise APIError(400, f"max_tokens is {requested}, but the prompt has {len(prompt_ids)} tokens "
                                f"and the maximum context length is {self.max_model_len}",
                           param="max_tokens", code="context_length_exceeded")
        return requested if requested is not None else room

    async def _run(self, p: Prepared, deadline: float | None) -> dict[str, Any] | SSEStream:
        req, params, created = p.request, p.params, int(self.clock())
        if not req.stream:
            choices = await within(asyncio.gather(*(self._collect(c) for c in p.children)), deadline)
            for i, (child, c) in enumerate(zip(p.children, choices)):
                c.prompt_logprobs = choices[i - i % req.n].prompt_logprobs  # the prompt's first sample's
                if p.echo_only:  # the one token sampled after the prompt is not part of the reply
                    c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason = "", [], [], "length", None
                if p.echo is not None:
                    c.text = p.echo_of(i) + c.text
                    c.logprobs = echo_entries(child.prompt_ids, c.prompt_logprobs, req.logprobs) + c.logprobs
            return self._response(p, created, choices)
        merged = self.samples(p)
        try:
            first = await within(merged.__anext__(), deadline)  # errors before the first byte keep their status
        except BaseException:
            await merged.aclose()
            raise
        o = req.stream_options
        usage = None if not (o and o.include_usage) else "every chunk" if o.continuous_usage_stats else "at the end"
        lines = self._stream(p, created, first, merged, usage, deadline)
        return SSEStream(lines, merged)

    async def _collect(self, child: Child) -> _Choice:
        choice = _Choice()
        async for deltas in self.generate(*child):
            for d in deltas:
                choice.text += d.text
                choice.token_ids += d.token_ids
                choice.logprobs += d.logprobs or []
                choice.finish_reason, choice.stop_reason = d.finish_reason, d.stop_reason
                if d.prompt_logprobs is not None:
                    choice.prompt_logprobs = d.prompt_logprobs
                if choice.cached_tokens is None:  # a migrated request's later deltas count its new prompt
                    choice.cached_tokens = d.num_cached_tokens
        return choice

    # -- shapes ----------------------------------------------------------------------
    def _response(self, p: Prepared, created: int, choices: list[_Choice]) -> dict[str, Any]:
        kind, tools, scores = p.kind, p.tools, p.request.prompt_logprobs  # scores: vLLM's prompt_logprobs
        out = []
        for i, c in enumerate(choices):
            lp = openai_logprobs(kind, c.logprobs, self.token_text) if p.params.logprobs is not None else None
            body = {"message": {"role": "assistant", "content": c.text}} if kind == "chat" else {"text": c.text}
            finish = c.finish_reason
            calls = tools.calls(c.text) if tools is not None else None
            if calls is not None:  # else cut before the calls' JSON closed: the text, as it is
                body, finish = {"message": {"role": "assistant", "content": None, "tool_calls": calls}}, tools.finish_reason
            out.append({"index": i, **body, "logprobs": lp, "finish_reason": finish, "stop_reason": c.stop_reason})
            if scores is not None and kind == "text":
                out[-1]["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_logprobs, self.token_text, scores)
        completion = sum(len(c.token_ids) for c in choices)
        response = {"id": p.request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
                    "created": created, "model": self.model_name, "choices": out,
                    "usage": _usage(p.prompt_tokens, completion, p.cached_tokens([c.cached_tokens for c in choices]))}
        if scores is not None and kind == "chat":  # one prompt: once, beside the choices
            response["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_logprobs, self.token_text, scores)
        return response

    async def _stream(self, p: Prepared, created: int, first: tuple[int, TokenDelta],
                      rest: AsyncIterator[tuple[int, TokenDelta]], usage: str | None,
                      deadline: float | None) -> AsyncIterator[str]:
        """SSE lines; `usage`: None, "at the end" (include_usage) or "every chunk" (vLLM's
        continuous_usage_stats: the counts so far in each chunk too)."""
        kind, rid, n, tools = p.kind, p.request_id, len(p.children), p.tools
        with_logprobs = p.params.logprobs is not None
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": self.model_name}
        completion_tokens = 0
        offsets = [0] * n  # per choice: where its next token starts in its text (completions logprobs)
        calls = [CallStream(tools) for _ in range(n)] if tools is not None else None
        echoed = [False] * n
        cached: list[int | None] = [None] * n  # per choice, from its first delta

        def chunk(choices: list[dict[str, Any]]) -> str:
            so_far = _usage(p.prompt_tokens, completion_tokens, p.cached_tokens(cached)) if usage == "every chunk" else None
            extra = {"usage": so_far} if usage else {}
            return _sse({**base, 'choices': choices, **extra})

        try:
            if kind == "chat":
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for j in range(n)])
            item: tuple[int, TokenDelta] | None = first
            while item is not None:
                j, d = item
                if cached[j] is None:
                    cached[j] = d.num_cached_tokens
                if p.echo_only:
                    d = dataclasses.replace(d, text="", token_ids=[], logprobs=None, stop_reason=None,
                                            finish_reason=d.finish_reason and "length")
                completion_tokens += len(d.token_ids)
                entries, finish = d.logprobs or [], d.finish_reason
                body = ({"delta": {"content": d.text} if d.text else {}} if kind == "chat" else {"text": d.text})
                if p.echo is not None and not echoed[j]:  # the choice's first chunk starts with its prompt
                    echoed[j] = True
                    body = {"text": p.echo_of(j) + d.text}
                    entries = echo_entries(p.children[j].prompt_ids, d.prompt_logprobs, p.request.logprobs) + entries
                if calls is not None:
                    delta, entries, finish = calls[j].step(d.text, entries, finish)
                    body = {"delta": delta or {}}
                lp = openai_logprobs(kind, entries, self.token_text, offsets[j]) if with_logprobs else None
                if lp is not None and kind == "text" and lp["tokens"]:
                    offsets[j] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                if (d.text or body.get("text") or d.token_ids or finish) and (calls is None or delta is not None):
                    yield chunk([{"index": j, **body, "logprobs": lp, "finish_reason": finish,
                                  **({"stop_reason": d.stop_reason} if finish else {})}])
                item = await within(rest.__anext__(), deadline)
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # after the first byte an error can only be a chunk
            err = exc if isinstance(exc, APIError) else self.map_error(exc)
            yield _sse(err.body())
            yield "data: [DONE]\n\n"
            return
        finally:
            await rest.aclose()
        if usage:
            total = _usage(p.prompt_tokens, completion_tokens, p.cached_tokens(cached))
            yield _sse({**base, 'choices': [], 'usage': total})
        yield "data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> str:
    """One SSE event. orjson: a one-token chunk in 0.24 us against json.dumps' 3.2 (2026-11-26,
    EPYC); chunks are the router's hot path. UTF-8 as is, like ensure_ascii=False; a non-finite
    float becomes null, not a bare -Infinity no strict JSON parser reads."""
    return f"data: {orjson.dumps(obj).decode()}\n\n"


def _child_seed(seed: int | None, j: int) -> int | None:
    """Choice j of n samples with seed + j (wrapping inside the seed range)."""
    return None if seed is None else (seed + j) % 2**63


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens a prefix cache
    served (not computed again), as OpenAI reports prompt caching."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
