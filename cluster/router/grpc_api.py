"""The gRPC face of the OpenAI server (tandem.proto's Generate), as plain functions: the router
deployment's `Generate` method is a thin shell over `generate` (cluster/router/app.py).

    GenerateRequest → the HTTP body it stands for (chat or completions; unset fields left out, so
                      they take the HTTP defaults) → OpenAIServer.prepare (the same validation)
                    → the n samples → one GenerateResponse per delta, then one with usage
    APIError        → its HTTP message with the matching gRPC status code (`status_code`)

Serve's gRPC proxy finds the method by name: register the servicer in `grpc_options`
(`SERVICER` below) and every Tandem app answers /tandem.v1.Tandem/Generate (with several apps,
the client names one in the `application` metadata).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

import grpc

from cluster.router import tandem_pb2 as pb
from cluster.router.openai_server import OpenAIServer
from cluster.router.errors import APIError
from cluster.router.streams import deadline_after, within

SERVICER = "cluster.router.grpc_servicer.add_tandem_servicer"  # for grpc_options

# HTTP statuses the router answers with, and the gRPC codes that mean the same (google.rpc's map)
STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_SAMPLING = ("n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens",
             "cache_salt", "priority", "include_stop_str_in_output", "truncate_prompt_tokens")
_CHAT_ONLY = ("add_generation_prompt", "continue_final_message")


def status_code(err: APIError) -> grpc.StatusCode:
    return STATUS_CODES.get(err.status, grpc.StatusCode.INTERNAL)


def request_body(req: pb.GenerateRequest) -> tuple[str, dict[str, Any]]:
    """("chat" | "text", the JSON body the same request has over HTTP)."""
    which = req.WhichOneof("prompt")
    if which is None:
        raise APIError(400, "prompt: set one of chat, text or token_ids", param="prompt")
    body: dict[str, Any] = {"model": req.model}
    body.update({name: getattr(req, name) for name in _SAMPLING if req.HasField(name)})
    if req.stop:
        body["stop"] = list(req.stop)
    for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
        if getattr(req, name):
            body[name] = list(getattr(req, name))
    if req.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in req.logit_bias.items()}
    if req.json_object:
        body["response_format"] = {"type": "json_object"}
    if req.HasField("json_schema"):
        if req.json_object:
            raise APIError(400, "json_object and json_schema exclude each other", param="json_schema")
        schema = _json_text(req.json_schema, "json_schema", "a JSON Schema as JSON text")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "grpc", "schema": schema}}
    structured = {name: getattr(req, name) for name in ("regex", "grammar", "structural_tag") if req.HasField(name)}
    if req.choice:
        structured["choice"] = list(req.choice)
    if structured:
        body["structured_outputs"] = structured
    chat_only = [name for name in (*_CHAT_ONLY, "chat_template_kwargs") if req.HasField(name)]
    if which == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        body.update({name: getattr(req, name) for name in _CHAT_ONLY if req.HasField(name)})
        if req.HasField("chat_template_kwargs"):
            body["chat_template_kwargs"] = _json_text(req.chat_template_kwargs, "chat_template_kwargs",
                                                     "a JSON object as text")
        if req.HasField("logprobs"):
            body.update(logprobs=True, top_logprobs=req.logprobs)
        return "chat", body
    if chat_only:
        raise APIError(400, f"{chat_only[0]} is for chat prompts", param=chat_only[0])
    body["prompt"] = req.text if which == "text" else list(req.token_ids.ids)
    if req.HasField("logprobs"):
        body["logprobs"] = req.logprobs
    return "text", body


def _json_text(text: str, name: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past what the parser takes
        raise APIError(400, f"{name} must be {what}", param=name) from None


async def generate(server: OpenAIServer, req: pb.GenerateRequest, timeout_s: float | None,
                   max_bytes: int | None = None) -> AsyncIterator[pb.GenerateResponse]:
    """Stream one request's tokens; raises APIError (before or after the first message).
    `max_bytes`: the largest request taken (the HTTP body limit)."""
    deadline = deadline_after(timeout_s)
    if max_bytes is not None and req.ByteSize() > max_bytes:
        raise APIError(413, f"the request exceeds {max_bytes} bytes")
    kind, body = request_body(req)
    prepared = server.prepare(kind, body)
    with_logprobs = prepared.params.logprobs is not None
    samples = server.samples(prepared)
    completion = 0
    cached: list[int | None] = [None] * len(prepared.children)  # per choice, from its first delta
    try:
        while True:
            try:
                j, d = await within(samples.__anext__(), deadline)
            except StopAsyncIteration:
                break
            if cached[j] is None:
                cached[j] = d.num_cached_tokens
            if not (d.text or d.token_ids or d.finish_reason):
                continue
            completion += len(d.token_ids)
            out = pb.GenerateResponse(id=prepared.request_id, index=j, text=d.text, token_ids=d.token_ids,
                                      finish_reason=d.finish_reason or "")
            if isinstance(d.stop_reason, str):
                out.stop_string = d.stop_reason
            elif d.stop_reason is not None:
                out.stop_token_id = d.stop_reason
            if with_logprobs:
                out.logprobs.extend(_logprobs(server, e) for e in d.logprobs or [])
            yield out
    finally:
        await samples.aclose()
    prompt = prepared.prompt_tokens
    yield pb.GenerateResponse(id=prepared.request_id, usage=pb.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        cached_tokens=prepared.cached_tokens(cached)))


def _logprobs(server: OpenAIServer, entry: Any) -> pb.TokenLogprob:
    s = entry.sampled
    return pb.TokenLogprob(token_id=s.token_id, token=server.token_text(s.token_id), logprob=s.logprob,
                           top=[pb.TopLogprob(token_id=t.token_id, token=server.token_text(t.token_id),
                                              logprob=t.logprob) for t in entry.top])

