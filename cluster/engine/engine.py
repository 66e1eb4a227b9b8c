"""The step loop: schedule → run → apply, plus the two seams disaggregation needs.

    (a) prefill side: add_request(..., prefill_only=True); step until it finishes;
        take_prefilled(id) → first token + block ids; export_kv(id); release(id).
    (b) decode side: admit_remote(...) → block ids to fill (after the blocks of the prompt's prefix
        this engine's cache already holds); import_kv(id, packed);
        finish_remote(id, ok, first_token) → the request joins the running batch (or recomputes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import time
from collections import Counter
from typing import Any, Sequence

import torch

from cluster.config import EngineConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.detokenizer import IncrementalDetokenizer
from cluster.engine.model_runner import ModelRunner
from cluster.engine.scheduler import Scheduler
from cluster.engine.spec.registry import create_proposer
from cluster.engine.spec.speculator import Speculator
from cluster.engine.step_cost import StepCost
from cluster.engine.structured.base import StructuredBackend
from cluster.engine.structured.constraint import Constraint
from cluster.engine.structured.registry import create_backend
from cluster.engine.tokenizer import Tokenizer
from cluster.engine.kv_layout import KVLayout
from cluster.models.architecture import Architecture
from cluster.models.default_model import resolve_model_path
from cluster.engine.outputs import CompletionOutput, PrefillResult, RequestOutput, TokenLogprobs
from cluster.engine.request import Request, RequestStatus
from cluster.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model.model, config.model.cache_dir)
        self.arch = Architecture.from_folder(self.model_path)
        self.tokenizer = Tokenizer(self.model_path, lazy=True)  # ids to text: no transformers
        limit = config.model.max_model_len or self.arch.max_position_embeddings
        if self.arch.sliding_window:  # no sliding-window attention: stay inside the window
            limit = min(limit, self.arch.sliding_window)
        self.runner = ModelRunner(str(self.model_path), self.arch, config.model, config.cache, limit,
                                  config.seed, self._graph_rows(config))
        bs = config.cache.block_size
        self.num_blocks = self.runner.num_blocks
        self.max_model_len = min(limit, self.num_blocks * bs)
        self.blocks = BlockManager(self.num_blocks, bs, config.cache.enable_prefix_caching)
        self.step_cost = StepCost()  # seconds per token in a step, from this engine's own steps
        self.scheduler = Scheduler(config.scheduler, self.blocks, self.step_cost)
        self.speculator = self._speculator(config)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._logprobs: dict[str, list[TokenLogprobs]] = {}
        self._scores: dict[str, list[TokenLogprobs | None]] = {}  # see _prompt_scores
        self._prompts: dict[str, str | None] = {}
        self._ids = itertools.count()
        self._structured: StructuredBackend | None = None  # engine/structured/, on first use
        # prompt tokens admitted; tokens handed to callers; requests finished, by reason
        self.counters: Counter[str] = Counter()
        if config.speculative is not None and config.speculative.adaptive:
            self.calibrate()  # draft lengths are chosen from the step cost: know it from the start

    @staticmethod
    def _graph_rows(config: EngineConfig) -> int:
        """Rows the CUDA graphs hold: a decode per sequence, and with speculation its drafts too,
        within the step's token budget."""
        k = config.speculative.num_speculative_tokens if config.speculative is not None else 0
        seqs = config.scheduler.max_num_seqs
        return seqs if not k else max(seqs, min(seqs * (1 + k), config.scheduler.max_num_batched_tokens))

    # -- requests ------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                    prefill_only: bool = False) -> Request:
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(prompt_ids)
        if len(self.scheduler.waiting) >= self.config.scheduler.max_waiting:
            raise OverflowError(f"engine queue is full ({self.config.scheduler.max_waiting} waiting)")
        req = self._new_request(request_id, prompt_ids, params, prefill_only)
        self.scheduler.add(req)
        self.counters["prompt_tokens"] += len(prompt_ids)
        self._track(req, prompt if isinstance(prompt, str) else None)
        return req

    def abort_request(self, request_id: str) -> bool:
        req = self.scheduler.abort(request_id)
        self._forget(request_id)
        return req is not None

    def calibrate(self, tokens: int = 64) -> float | None:
        """Time steps of 1 and of `tokens` prompt tokens, so `step_cost` knows what a token costs
        before the first request (a warm-up round first, not counted). Call it on an idle
        engine: it leaves the counters, the prefix-cache figures and the cache as they were (the
        throwaway prompts carry salts of their own, and their blocks are uncached after)."""
        if self.has_unfinished_requests():
            raise RuntimeError("calibrate() needs an idle engine")
        saved = Counter(self.counters), self.blocks.prefix_queries, self.blocks.prefix_hits
        sizes = (1, max(2, min(tokens, self.config.scheduler.max_num_batched_tokens, self.max_model_len - 1)))
        for round_ in range(3):
            if round_ == 1:
                self.step_cost.reset()  # the warm-up round paid first-call costs
            for n in sizes:
                rid = f"calibrate-{round_}-{n}"
                prompt = [(i * 31 + 7) % self.arch.vocab_size for i in range(n)]
                req = self.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                                   ignore_eos=True, cache_salt=rid))
                while self.has_unfinished_requests():
                    self.step()
                self.blocks.uncache(req.block_hashes)
        self.counters = saved[0]
        self.blocks.prefix_queries, self.blocks.prefix_hits = saved[1:]
        return self.step_cost.per_token_s

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the step --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if self.speculator is not None:
            plan = self.speculator.draft(plan)
        started = time.perf_counter()
        result = self.runner.execute(plan, self.eos_token_ids)
        self.step_cost.observe(plan.num_tokens, time.perf_counter() - started)
        if self.speculator is not None:
            self.speculator.computed(plan)
        for chunk in plan.chunks:
            chunk.request.prompt_logprobs.extend(result.prompt_logprobs.get(chunk.request.request_id, ()))
        known = {c.request.request_id: c.request.num_tokens for c in plan.chunks}
        self.scheduler.update(plan, result.sampled)
        if self.speculator is not None:
            self.speculator.observe(plan, result.sampled)
        outputs = []
        for chunk in plan.chunks:
            req = chunk.request
            if req.request_id not in result.sampled or req.status == RequestStatus.FINISHED_ABORTED:
                continue
            new_tokens = req.token_ids[known[req.request_id]:]  # a stop may have cut the step's tokens
            lps = result.logprobs.get(req.request_id)
            if lps is not None:
                self._logprobs[req.request_id].extend(TokenLogprobs(*lp) for lp in lps[:len(new_tokens)])
            outputs.append(self._emit(req, new_tokens))
        return outputs

    def _emit(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        detok = self._detok[req.request_id]
        stop = None
        for i, token in enumerate(new_tokens):  # a stop string ends the reply at its token
            stop = detok.add_tokens([token])
            if stop is not None:
                self._cut(req, len(new_tokens) - i - 1)
                new_tokens = new_tokens[:i + 1]
                break
        if stop is not None and not req.is_finished:
            req.stop_reason = stop
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        elif stop is not None and req.status == RequestStatus.FINISHED_PREFILLED:
            req.stop_reason = stop  # the first token already ends it: nothing to hand off
            self.scheduler.release(req.request_id)
            req.status = RequestStatus.FINISHED_STOPPED
        out = CompletionOutput(
            index=0,
            text=detok.output_text,
            token_ids=req.output_token_ids,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=self._logprobs[req.request_id] if req.params.logprobs is not None else None,
            delta_text=detok.take_delta(finished=req.is_finished),
            delta_token_ids=new_tokens,
        )
        result = RequestOutput(req.request_id, req.prompt_token_ids, [out], req.is_finished,
                               self._prompts.get(req.request_id), req.num_cached_tokens, time.monotonic(),
                               req.queue_s, self._prompt_scores(req), req.num_draft_tokens,
                               req.num_accepted_tokens)
        if not req.prefill_only:  # a prefill-only request's token reaches its caller through decode
            self.counters["generation_tokens"] += len(new_tokens)
            if out.finish_reason is not None:
                self.counters[f"finished_{out.finish_reason}"] += 1
        if req.is_finished and req.status != RequestStatus.FINISHED_PREFILLED:
            if self.speculator is not None and out.finish_reason in ("stop", "length"):
                self.speculator.finish(req)
            self._forget(req.request_id)
        return result

    def _cut(self, req: Request, num_tokens: int) -> None:
        """Drop the last `num_tokens` tokens of a reply a stop string ended before them (tokens
        a step appended after the one that completed it: accepted drafts)."""
        if num_tokens <= 0:
            return
        del req.token_ids[-num_tokens:]
        del self._logprobs[req.request_id][len(req.output_token_ids):]
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)

    # -- seam (a): prefill-only hand-off --------------------------------------------
    def take_prefilled(self, request_id: str) -> PrefillResult:
        """After a prefill-only request finished its step: the first token and the held blocks."""
        req = self.scheduler.held.get(request_id)
        if req is None:
            raise KeyError(f"{request_id!r} holds no prefilled KV")
        lps = self._logprobs.get(request_id) or [None]
        self._forget(request_id)
        scores = req.prompt_logprobs if req.params.prompt_logprobs is not None else None
        return PrefillResult(request_id, req.prompt_token_ids, req.output_token_ids[0], lps[0],
                             list(req.block_ids), scores, req.num_cached_tokens)

    def export_kv(self, request_id: str, skip_blocks: int = 0) -> torch.Tensor:
        """The prompt's KV packed, after its first `skip_blocks` blocks (those the receiver holds)."""
        req = self.scheduler.held[request_id]
        needed = self.blocks.blocks_needed(req.num_prompt_tokens)
        if not 0 <= skip_blocks < needed:
            raise ValueError(f"skip_blocks must be in [0, {needed}) for {request_id!r}, got {skip_blocks}")
        block_ids = req.block_ids[skip_blocks:needed]
        packed = self.runner.export_kv(block_ids)
        draft = self._draft_kv()
        return packed if draft is None else torch.cat([packed, draft.pack(block_ids, packed)])

    def release(self, request_id: str) -> bool:
        return self.scheduler.release(request_id) is not None

    # -- seam (b): admit a request whose prompt KV comes from elsewhere --------------
    def admit_remote(self, request_id: str, prompt_token_ids: Sequence[int],
                     params: SamplingParams) -> list[int] | None:
        """Reserve blocks for the prompt's KV before it is sent; None when they don't fit now.

        Returns the blocks the sender must fill: the prompt's blocks after those of its prefix
        that this engine's prefix cache already holds (shared, not sent again; at least the
        last block is always sent, as `find_cached_prefix` leaves the last token to compute).
        """
        prompt_ids = list(prompt_token_ids)
        self._validate_prompt(prompt_ids)
        req = self._new_request(request_id, prompt_ids, params, False)
        block_ids = self.scheduler.add_remote(req)
        if block_ids is None:
            return None
        self._track(req, None)
        return block_ids

    def import_kv(self, request_id: str, packed: torch.Tensor) -> None:
        req = self.scheduler.remote[request_id]
        block_ids = req.block_ids[req.num_computed_tokens // self.blocks.block_size:]
        draft = self._draft_kv()
        layers = self.runner.kv_cache.shape[0]
        if draft is not None and packed.shape[0] == layers + draft.layers_like(tuple(packed.shape[3:])):
            draft.unpack(block_ids, packed[layers:])
            packed = packed[:layers]
        self.runner.import_kv(block_ids, packed)

    def _draft_kv(self) -> Any:
        """The draft model whose KV crosses the connector beside the target's, if any."""
        proposer = self.speculator.proposer if self.speculator is not None else None
        return proposer if proposer is not None and proposer.has_kv else None

    def finish_remote(self, request_id: str, ok: bool, first_token: int | None = None,
                      first_logprobs: TokenLogprobs | None = None,
                      recompute: bool = True,
                      prompt_logprobs: list[TokenLogprobs] | None = None,
                      num_cached_tokens: int = 0) -> RequestOutput | None:
        """KV landed (ok) or failed: join the batch, recompute locally, or fail.

        `first_token` is the token the prefill side sampled; with it the request continues
        from there (after recomputing the prompt's KV if `ok` is False). Without it (the
        prefill itself failed) a recompute starts from the prompt. Returns the output that
        carries the first token (or the failure), None when nothing is known yet.
        `prompt_logprobs`: the prefill side's, for prompt tokens 1.. (a recompute then skips them).
        `num_cached_tokens`: what the prefill side's prefix cache served (a recompute counts its own).
        """
        req = self.scheduler.remote[request_id]
        req.num_cached_tokens = num_cached_tokens
        if prompt_logprobs is not None:
            req.prompt_logprobs = list(prompt_logprobs)
        if first_token is not None:
            req.token_ids.append(first_token)
            if first_logprobs is not None:
                self._logprobs[request_id].append(first_logprobs)
            status = req.check_token_stop()
            if status is not None:  # the first token already ends R: its KV is not needed
                self.scheduler.finish(req, status)
                return self._emit(req, [first_token])
        elif ok:
            raise ValueError("a landed transfer needs the prefill side's first token")
        self.scheduler.finish_remote(request_id, ok, recompute)
        if req.is_finished:  # failure policy "fail"
            return self._emit(req, [])
        if first_token is None:
            return None
        return self._emit(req, [first_token])

    # -- helpers -------------------------------------------------------------------
    def _speculator(self, config: EngineConfig) -> Speculator | None:
        if config.speculative is None:
            return None
        proposer = create_proposer(config.speculative, self)
        return Speculator(config.speculative, proposer, self.blocks, self.step_cost,
                          config.scheduler.max_num_batched_tokens)

    def _new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     prefill_only: bool) -> Request:
        req = Request(request_id, prompt_ids, params, self.max_model_len, self.eos_token_ids, prefill_only)
        if params.structured is not None:  # a spec the backend refuses: StructuredOutputError, a ValueError (400)
            backend = self._structured_backend()
            prior = prompt_ids[-params.prior_output_tokens:] if params.prior_output_tokens else []
            req.constraint = Constraint(backend.matcher(backend.compile(params.structured)),
                                        self.eos_token_ids | set(params.stop_token_ids), replay=prior,
                                        trailing_ids=backend.trailing_ids)
        return req

    def _structured_backend(self) -> StructuredBackend:
        """Built on the first constrained request (~0.4 s: importing xgrammar, the tokenizer's table;
        ~1.6 s more on a slow host where it loads transformers, which the engine's decode never did)."""
        if self._structured is None:
            self._structured = create_backend("xgrammar", self.tokenizer.hf, self.arch.vocab_size,
                                              sorted(self.eos_token_ids))
        return self._structured

    def _track(self, req: Request, prompt: str | None) -> None:
        self._detok[req.request_id] = IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids,
            skip_special_tokens=req.params.skip_special_tokens, stop=req.params.stop,
            include_stop=req.params.include_stop_str_in_output)
        self._logprobs[req.request_id] = []
        self._prompts[req.request_id] = prompt
        if req.output_token_ids:
            self._detok[req.request_id].add_tokens(req.output_token_ids)

    def _prompt_scores(self, req: Request) -> list[TokenLogprobs | None] | None:
        """A scored prompt's logprobs as outputs carry them ([None, ...]), built once they are
        complete (not on every step's output)."""
        if req.params.prompt_logprobs is None:
            return None
        scores = self._scores.get(req.request_id)
        if scores is None:
            scores = [None, *req.prompt_logprobs]
            if not req.needs_prompt_logprobs:
                self._scores[req.request_id] = scores
        return scores

    def _forget(self, request_id: str) -> None:
        self._detok.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._scores.pop(request_id, None)
        self._prompts.pop(request_id, None)
        self.runner.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.arch.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.arch.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}, leaving no room to generate")

    def kv_layout(self) -> KVLayout:
        """What a KV payload from this engine looks like, with a fingerprint of the model."""
        digest = hashlib.blake2b((self.model_path / "config.json").read_bytes(), digest_size=4).hexdigest()
        layout = KVLayout.of_cache(f"{self.model_path.name}@{digest}", self.runner.kv_cache)
        draft = self._draft_kv()
        if draft is None:
            return layout
        # the draft's KV travels as extra layers: both pools must run the same draft (or none)
        draft_digest = hashlib.blake2b((draft.model_path / "config.json").read_bytes(), digest_size=4).hexdigest()
        extra = draft.layers_like((layout.block_size, layout.num_kv_heads, layout.head_dim))
        return dataclasses.replace(layout, model=f"{layout.model}+draft:{draft.model_path.name}@{draft_digest}",
                                   num_layers=layout.num_layers + extra)

    def stats(self) -> dict[str, Any]:
        return {
            "kv_cache_dtype": str(self.runner.kv_cache.dtype).removeprefix("torch."),
            "num_blocks": self.num_blocks,
            "blocks_in_use": self.blocks.num_used_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_held": len(self.scheduler.held),
            "num_remote": len(self.scheduler.remote),
            "prefix_cache_queries": self.blocks.prefix_queries,
            "prefix_cache_hits": self.blocks.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "step_s_per_token": self.step_cost.per_token_s,
            "step_fixed_s": self.step_cost.fixed_s,
            "step_tail": round(self.step_cost.tail, 3),
            "step_stall_s": round(self.step_cost.stall_s, 4),
            "max_num_batched_tokens": self.config.scheduler.max_num_batched_tokens,
            **self.counters,
            **(self.speculator.stats() if self.speculator is not None else {}),
        }
