"""The only place a step plan becomes tensors: inputs, attention metadata, forward, sampling."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from cluster.config import CacheConfig, ModelConfig
from cluster.engine.cuda_graphs import DecodeGraphs
from cluster.engine.kv_cache import allocate_kv_cache
from cluster.engine.sampler import Logprob, sample, score_tokens
from cluster.engine.step_plan import ScheduledChunk, StepPlan
from cluster.models.architecture import Architecture
from cluster.models.attention import AttentionMetadata, PrefillChunk, cpu_decode_index, cpu_verify_index
from cluster.models.linear import bf16_beats_fp32, onednn_packing
from cluster.models.loader import load_model
from cluster.engine.outputs import TokenLogprobs
from cluster.engine.request import Request
from kernels import KernelOps, ops_for

PROMPT_LOGPROB_ROWS = 256  # prompt positions per LM-head pass (256 x 49k vocab fp32 = 50 MB of logits)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """"auto": bfloat16 on CUDA, and on a CPU where it computes faster than float32 (AMX, or
    AVX512-BF16 on AMD: `bf16_beats_fp32`; `weight_dtypes` says what runs in bf16 there); float32
    on other CPUs, where bf16 is emulated or, on Intel's AVX512-BF16 without AMX, slower."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if bf16_beats_fp32() and onednn_packing(torch.bfloat16) else torch.float32
    return getattr(torch, name)


def weight_dtypes(dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(the activations' and KV cache's dtype, the layers' projections' if another).
    bfloat16 on CPU: the projections and the LM head, nearly all of the FLOPs and weight bytes,
    multiply in bf16 through oneDNN (2x fp32's speed with native bf16), the head's leading logits
    recomputed in fp32 (linear.RefinedHead); activations, attention's arithmetic, norms and
    embedding stay float32, and the KV cache is bf16 where the kernels read it (`kv_dtype`). A
    CPU without native bf16 is refused: emulated, bf16 runs far slower than fp32."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return dtype, None
    if not onednn_packing(torch.bfloat16):
        raise ValueError("dtype bfloat16 on CPU needs a CPU that computes bf16 natively (AVX512-BF16 or AMX) "
                         "and torch with oneDNN; this one does not: use float32")
    return torch.float32, torch.bfloat16


def kv_dtype(dtype: torch.dtype, matmul_dtype: torch.dtype | None, ops: KernelOps) -> torch.dtype:
    """The KV cache's dtype: the activations', except in a CPU engine computing in bf16 whose C
    kernels read bf16 caches (`KernelOps.bf16_kv`): K/V are stored rounded to bf16, as a bf16
    engine on a GPU keeps them, and attention's arithmetic stays fp32. Decode attention is bound
    by the bytes it reads; bf16 halves them (the default model, 16 chats of ~500 tokens: see
    kernels/cpu_paged_attention.py), and a hand-off between pools carries half the bytes too."""
    return torch.bfloat16 if matmul_dtype == torch.bfloat16 and ops.bf16_kv else dtype


class _Row(NamedTuple):
    """One sampled position: a request's next token, or (speculating) one of its draft positions."""

    request: Request
    output_ids: list[int]  # the output before this position (drafts before it included)
    draft: int | None  # the draft token the next row's position holds; None on a run's last row


def _rows(c: ScheduledChunk) -> list[_Row]:
    req = c.request
    if not c.num_drafts:
        return [_Row(req, req.output_token_ids, None)]
    out, drafts = req.output_token_ids, list(c.draft_token_ids)
    return [_Row(req, out + drafts[:j], drafts[j] if j < len(drafts) else None) for j in range(len(drafts) + 1)]


@dataclass
class StepResult:
    # per request that sampled: its new tokens (with drafts: the accepted ones, then one more)
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[tuple[Logprob, list[Logprob], int]]]  # one per new token
    # per request asking for prompt logprobs: the entries that continue its `prompt_logprobs`
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model_path: str, arch: Architecture, model_config: ModelConfig,
                 cache_config: CacheConfig, max_model_len: int, seed: int = 0,
                 max_graph_rows: int = 64) -> None:
        self.device = pick_device(model_config.device)
        self.dtype, matmul_dtype = weight_dtypes(pick_dtype(model_config.dtype, self.device), self.device)
        self.ops = ops_for(self.device, self.dtype)
        self.arch = arch
        self.block_size = cache_config.block_size
        self.model = load_model(model_path, arch, self.ops, self.dtype, self.device, max_model_len, matmul_dtype)
        self.kv_cache = allocate_kv_cache(arch, cache_config, kv_dtype(self.dtype, matmul_dtype, self.ops), self.device)
        self.generators: dict[str, torch.Generator] = {}
        self.default_generator = torch.Generator(device=self.device).manual_seed(seed)
        self.graphs = None  # decode and verify steps from CUDA graphs (cluster/engine/cuda_graphs.py)
        if self.device.type == "cuda" and not model_config.enforce_eager:
            self.graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, max_model_len,
                                       max_graph_rows, capture=True)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[2]

    # -- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan, eos_token_ids: frozenset[int]) -> StepResult:
        chunks = sorted(plan.chunks, key=lambda c: c.num_tokens != 1)  # decodes first (stable)
        samplers = [c for c in chunks if c.samples]
        scoring = any(c.request.needs_prompt_logprobs for c in chunks)
        prompt_lps: dict[str, list[TokenLogprobs]] = {}
        graph_rows = None if scoring else self._graph_rows(chunks)
        if graph_rows is not None:
            hidden = self.graphs.run(graph_rows)
            if len(samplers) < len(chunks):  # a one-token prefill chunk inside a prompt
                ends = list(itertools.accumulate(c.num_tokens for c in chunks))
                keep = [row for c, end in zip(chunks, ends) if c.samples for row in range(end - c.num_tokens, end)]
                hidden = hidden[self._tensor(keep, torch.int64)]
        else:
            input_ids, positions, meta, sample_rows = self._prepare(chunks)
            hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
            if scoring:
                prompt_lps = self._prompt_logprobs(chunks, hidden)
            hidden = hidden[sample_rows]
        if not samplers:
            return StepResult({}, {}, prompt_lps)
        logits = self.model.logits(hidden)
        rows = [row for c in samplers for row in _rows(c)]
        result = sample(
            logits,
            [r.request.params for r in rows],
            [self._generator(r.request, logits) for r in rows],
            [r.request.prompt_token_ids for r in rows],
            [r.output_ids for r in rows],
            eos_token_ids,
            [r.request.constraint for r in rows],  # a verify run's rows share it (sampler)
            [r.draft for r in rows],
        )
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[tuple[Logprob, list[Logprob], int]]] = {}
        i = 0
        for c in samplers:
            rid = c.request.request_id
            n = 1 + c.num_drafts
            tokens = result.token_ids[i:i + n]
            accepted = 0
            while accepted < c.num_drafts and tokens[accepted] == c.draft_token_ids[accepted]:
                accepted += 1
            sampled[rid] = tokens[:accepted + 1]
            if result.logprobs[i] is not None:
                logprobs[rid] = result.logprobs[i:i + accepted + 1]  # type: ignore[assignment]
            i += n
        return StepResult(sampled, logprobs, prompt_lps)

    def _prompt_logprobs(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """For each chunk whose request wants prompt logprobs: position p's logits (rows of
        `hidden`, in `_prepare`'s order) scored against prompt token p + 1, for the positions
        not scored before (a recompute after preemption repeats none) up to the prompt's
        second-to-last (the last one's logits are the sampler's)."""
        rows: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        owners: list[tuple[str, int]] = []  # (request id, how many rows)
        offset = 0
        for c in chunks:
            req = c.request
            if req.needs_prompt_logprobs:
                first = max(c.start, len(req.prompt_logprobs))
                last = min(c.start + c.num_tokens, req.num_prompt_tokens - 1)
                n = max(0, last - first)
                rows.extend(range(offset + first - c.start, offset + first - c.start + n))
                targets.extend(req.prompt_token_ids[first + 1: first + 1 + n])
                ks.extend([req.params.prompt_logprobs or 0] * n)
                owners.append((req.request_id, n))
            offset += c.num_tokens
        entries: list[TokenLogprobs] = []
        for s in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            part = slice(s, s + PROMPT_LOGPROB_ROWS)
            logits = self.model.logits(hidden[self._tensor(rows[part], torch.int64)])
            scored = score_tokens(torch.log_softmax(logits, dim=-1), self._tensor(targets[part], torch.int64), ks[part])
            entries += [TokenLogprobs(*e) for e in scored]
        out: dict[str, list[TokenLogprobs]] = {}
        i = 0
        for rid, n in owners:
            out[rid], i = entries[i:i + n], i + n
        return out

    @torch.inference_mode()
    def compute(self, chunks: list[ScheduledChunk], logits: bool = True) -> torch.Tensor | None:
        """Run the model over `chunks`, writing their KV, sampling nothing (a draft model's
        passes); with `logits`, those at each chunk's last position [len(chunks), V], in order."""
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].num_tokens != 1)  # decodes first
        ordered = [chunks[i] for i in order]
        input_ids, positions, meta, _ = self._prepare(ordered)
        hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
        if not logits:
            return None
        ends = list(itertools.accumulate(c.num_tokens for c in ordered))
        rows = [0] * len(chunks)
        for j, i in enumerate(order):
            rows[i] = ends[j] - 1
        return self.model.logits(hidden[self._tensor(rows, torch.int64)])

    def _prepare(self, chunks: list[ScheduledChunk]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        verify: list[tuple[int, int, int, list[int]]] = []
        for c in chunks:
            req, end = c.request, c.start + c.num_tokens
            blocks = req.block_ids
            offset = len(ids)
            ids.extend(c.token_ids)
            pos.extend(range(c.start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(c.start, end))
            if c.num_tokens == 1:
                dec_tables.append(blocks[: -(-end // bs)])
                dec_lens.append(end)
            elif c.num_drafts and self.device.type == "cpu":  # batched like decodes, not one call each
                verify.append((offset, c.num_tokens, end, blocks[: -(-end // bs)]))
            else:
                table = torch.tensor(blocks[: -(-end // bs)], dtype=torch.int64, device=self.device)
                prefills.append(PrefillChunk(offset, c.num_tokens, end, table))
            if c.samples:
                sample_rows.extend(range(len(ids) - 1 - c.num_drafts, len(ids)))
        width = max((len(t) for t in dec_tables), default=0)
        tables = self._tensor([t + [0] * (width - len(t)) for t in dec_tables], torch.int32)
        lens = self._tensor(dec_lens, torch.int32)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=len(dec_lens),
            decode_block_tables=tables,
            decode_context_lens=lens,
            prefills=tuple(prefills),
            cpu_decode=(cpu_decode_index(tables, lens, bs, self.kv_cache.shape[-2:], self.kv_cache.dtype)
                        if dec_lens and not self.ops.decode_in_place else None),
            cpu_verify=(cpu_verify_index(verify, bs, self.kv_cache.shape[-2:], self.kv_cache.dtype, self.device)
                        if verify else ()),
        )
        return (self._tensor(ids, torch.int64), self._tensor(pos, torch.int64), meta,
                self._tensor(sample_rows, torch.int64))

    def _graph_rows(self, chunks: list[ScheduledChunk]) -> list[tuple[int, int, int, int, list[int]]] | None:
        """The rows a CUDA graph replays for this step, or None when it must run eagerly. Every
        chunk must be one token, or a decode with drafts: a verify chunk of 1 + k tokens becomes
        1 + k decode rows over the same block table, row j attending up to its own position. A
        layer stores every row's KV before any row attends, so a draft sees those before it."""
        if self.graphs is None or any(c.num_tokens != 1 + c.num_drafts for c in chunks):
            return None
        if not self.graphs.fits(sum(c.num_tokens for c in chunks)):
            return None
        return [self._decode_row(c, j) for c in chunks for j in range(c.num_tokens)]

    def _decode_row(self, c: ScheduledChunk, j: int = 0) -> tuple[int, int, int, int, list[int]]:
        """Position j of a chunk as (token id, position, slot, context length, block table)."""
        bs, pos, blocks = self.block_size, c.start + j, c.request.block_ids
        token = c.request.token_ids[pos] if j == 0 else c.draft_token_ids[j - 1]
        return token, pos, blocks[pos // bs] * bs + pos % bs, pos + 1, blocks[: pos // bs + 1]

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _generator(self, req: Request, logits: torch.Tensor) -> torch.Generator | None:
        """R's own generator when seeded. A new one first skips the draws of R's tokens sampled on
        another engine (a prefill replica's first token, a migrated request's earlier output): a
        sampled step draws one uniform (engine/sampler.py), so the tokens come out as colocated."""
        if req.params.seed is None:
            return self.default_generator
        g = self.generators.get(req.request_id)
        if g is None:
            g = self.generators[req.request_id] = torch.Generator(device=self.device).manual_seed(req.params.seed)
            if not req.params.greedy:
                for _ in range(req.num_output_tokens + req.params.prior_output_tokens):
                    torch.empty((1, 1), dtype=logits.dtype, device=self.device).uniform_(generator=g)
        return g

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    # -- KV hand-off ---------------------------------------------------------------
    @torch.inference_mode()
    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """Pack blocks into one contiguous [L, 2, n, BS, Hkv, D] buffer (on CPU for transport)."""
        return self.ops.pack_kv(self.kv_cache, self._tensor(block_ids, torch.int64)).cpu()

    @torch.inference_mode()
    def import_kv(self, block_ids: list[int], packed: torch.Tensor) -> None:
        expected = (self.kv_cache.shape[0], 2, len(block_ids), *self.kv_cache.shape[3:])
        if tuple(packed.shape) != expected or packed.dtype != self.kv_cache.dtype:
            raise ValueError(f"KV payload {tuple(packed.shape)} {packed.dtype} does not fit "
                             f"{expected} {self.kv_cache.dtype}")
        self.ops.unpack_kv(packed.to(self.device), self.kv_cache, self._tensor(block_ids, torch.int64))
