"""Offline API in the style users know from vLLM.

    llm = LLM()                                   # the default model
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.sampling_params import SamplingParams

# text, token ids, or vLLM's prompt dicts: {"prompt": text} (TextPrompt), {"prompt_token_ids": ids}
# (TokensPrompt)
Prompt = Union[str, Sequence[int], dict[str, Any]]
Conversation = Sequence[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))

    @property
    def model_path(self) -> Path:
        return self.engine.model_path

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer.hf

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion in one continuous batch; outputs in input order."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        return self._run(batch, params)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """`chat_template_kwargs`: extra variables for the chat template (those it reads)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[Prompt] = [self.engine.tokenizer.encode_chat(c, template_kwargs=chat_template_kwargs)
                                 for c in conversations]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas of one request as the engine produces them."""
        params = params or SamplingParams()
        rid = self.engine.new_request_id()
        self.engine.add_request(rid, _one_prompt(prompt), params)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.outputs[0].delta_text:
                            yield out.outputs[0].delta_text
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def _run(self, prompts: list[str | list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        engine = self.engine
        children: dict[str, tuple[int, int]] = {}  # child request id → (prompt index, sample index)
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                for j in range(p.n):
                    rid = engine.new_request_id()
                    engine.add_request(rid, prompt, _child_params(p, j))
                    children[rid] = (i, j)
            finals: dict[str, RequestOutput] = {}
            while len(finals) < len(children):
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        finally:
            for rid in children:
                engine.abort_request(rid)
        return _merge(prompts, children, finals)


def _child_params(p: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples: its own seed (seed + j) so samples differ but stay reproducible;
    the first one alone scores the prompt (prompt_logprobs), which the n samples share."""
    seed = None if p.seed is None else p.seed + j
    return dataclasses.replace(p, n=1, seed=seed, prompt_logprobs=p.prompt_logprobs if j == 0 else None)


def _merge(prompts: list[str | list[int]], children: dict[str, tuple[int, int]],
           finals: dict[str, RequestOutput]) -> list[RequestOutput]:
    merged: list[RequestOutput | None] = [None] * len(prompts)
    for rid, (i, j) in sorted(children.items(), key=lambda kv: kv[1]):
        out = finals[rid]
        completion: CompletionOutput = dataclasses.replace(out.outputs[0], index=j, delta_text="",
                                                           delta_token_ids=[])
        if merged[i] is None:
            prompt = prompts[i] if isinstance(prompts[i], str) else None
            merged[i] = RequestOutput(f"{i}", out.prompt_token_ids, [completion], True, prompt,
                                      out.num_cached_tokens, prompt_logprobs=out.prompt_logprobs)
        else:
            merged[i].outputs.append(completion)  # type: ignore[union-attr]
    return [m for m in merged if m is not None]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one list of token ids
    return [_one_prompt(p) for p in prompts]


def _one_prompt(prompt: Prompt) -> str | list[int]:
    """Text or token ids; vLLM's prompt dicts unwrapped, any other key refused by name."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt_token_ids"}:
            return _one_prompt(prompt["prompt_token_ids"])
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        raise ValueError("a prompt dict holds 'prompt' (text) or 'prompt_token_ids' (a list of ints) and nothing "
                         f"else here, got keys {sorted(prompt)}")
    ids = list(prompt)
    if not all(isinstance(t, int) for t in ids):
        raise TypeError(f"a prompt is text, a list of token ids (ints) or a prompt dict, got a sequence of "
                        f"{sorted({type(t).__name__ for t in ids})}")
    return ids


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
