"""vLLM's `POST /tokenize` and `POST /detokenize`: a prompt's token ids as the server itself
would count them (a chat through the same template, tools included, as /v1/chat/completions),
and token ids back to text. Answered by the router alone; the pools are never asked.

    /tokenize    {"prompt": str, "add_special_tokens": true}
              or {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                  "tools": ..., "tool_choice": ...}
                 (either with "return_token_strs": true for the tokens' own strings)
              → {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [ids]} → {"prompt": str}
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, field_validator

from cluster.router.openai_server import OpenAIServer
from cluster.router.errors import APIError, parse_body
from cluster.router.protocol import ChatPrompt, clean_text


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields ignored, as on the /v1 routes


class _Tokenize(_Body):
    model: str | None = None  # optional, as in vLLM; when given, this server's
    return_token_strs: StrictBool = False


class TokenizeText(_Tokenize):
    prompt: str
    add_special_tokens: StrictBool = True

    _clean = field_validator("prompt")(clean_text)


class TokenizeChat(_Tokenize, ChatPrompt):
    """A chat's prompt as chat completions take it, with /tokenize's own options."""


class Detokenize(_Body):
    model: str | None = None
    tokens: list[StrictInt]


def tokenize(server: OpenAIServer, body: Any) -> dict[str, Any]:
    chat = isinstance(body, dict) and "messages" in body
    req = parse_body(TokenizeChat if chat else TokenizeText, body)
    if req.model is not None:
        server.check_model(req.model)
    if chat:
        ids, _ = server.chat_prompt(req)
    else:
        ids = list(server.tokenizer.hf.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    strs = server.tokenizer.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(server: OpenAIServer, body: Any) -> dict[str, Any]:
    req = parse_body(Detokenize, body)
    if req.model is not None:
        server.check_model(req.model)
    vocab = server.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in req.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": server.tokenizer.hf.decode(req.tokens)}

