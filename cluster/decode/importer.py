"""The decode half of the hand-off (cluster/kvtransfer/handoff.py): reserve R's blocks, fetch its
prompt KV, start decoding it. A plain object driven by DecodeServer (decode/server.py); every
method but `fetch` runs on the engine thread.

    reserve(R, prompt, params)  → engine allocates R's destination blocks (after the prompt's
                                  prefix its cache already holds), connector expects R
                                → receiver info for the prefill side, with how many leading
                                  blocks not to send (None: no room now)
    start(R, handoff)           → receive + verify KV → import → R joins the running batch;
                                  on a transfer error: policy "recompute" (prefill locally,
                                  keep the first token) or "fail" (R ends, the error is raised)
    abandon(R)                  → the prefill side failed: recompute R from its prompt, or drop it
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Sequence

import torch

from cluster.engine.engine import LLMEngine
from cluster.kvtransfer.base import KVConnector
from cluster.kvtransfer.errors import KVTransferError
from cluster.kvtransfer.handoff import FAILURE_POLICIES, PrefillHandoff, Receiver
from cluster.engine.outputs import RequestOutput
from cluster.sampling_params import SamplingParams


class KVImporter:
    def __init__(self, engine: LLMEngine, connector: KVConnector, kv_load_failure_policy: str = "recompute",
                 timeout_s: float | None = None) -> None:
        if kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {FAILURE_POLICIES}, "
                             f"got {kv_load_failure_policy!r}")
        self.engine = engine
        self.connector = connector
        self.policy = kv_load_failure_policy
        self.timeout_s = timeout_s
        self.counters: Counter[str] = Counter()

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int],
                params: SamplingParams) -> Receiver | None:
        blocks = self.engine.admit_remote(request_id, prompt_token_ids, params)
        if blocks is None:
            return None
        self.connector.expect(request_id, len(blocks))
        cached = self.engine.blocks.blocks_needed(len(prompt_token_ids)) - len(blocks)
        if cached:
            self.counters["kv_reused_blocks"] += cached
        # the sender skips the leading blocks this side's prefix cache already holds
        return dataclasses.replace(self.connector.receiver_info(), cached_blocks=cached)

    def fetch(self, request_id: str, handoff: PrefillHandoff) -> torch.Tensor:
        """Wait for R's verified KV (touches no engine state: may run off the engine thread)."""
        return self.connector.receive(request_id, handoff.receipt, self.timeout_s)

    def start(self, request_id: str, handoff: PrefillHandoff, packed: torch.Tensor | None = None,
              error: KVTransferError | None = None) -> RequestOutput | None:
        """Land R's KV and start decoding it; returns the output carrying the first token.

        `packed`/`error`: the result of a `fetch` done elsewhere; with neither, fetch here.
        """
        if handoff.finished:  # nothing was sent: the first token's own stop check ends R here
            self.connector.cancel(request_id)
            return self._finish(request_id, handoff, ok=False)
        try:
            if error is not None:
                raise error
            if packed is None:
                packed = self.fetch(request_id, handoff)
            self.engine.import_kv(request_id, packed)
        except KVTransferError as exc:
            self.counters[f"kv_failed_{exc.kind}"] += 1
            out = self._finish(request_id, handoff, ok=False, recompute=self.policy == "recompute")
            if self.policy == "fail":
                raise
            self.counters["recomputed"] += 1
            return out
        self.counters["kv_landed"] += 1
        return self._finish(request_id, handoff, ok=True)

    def _finish(self, request_id: str, handoff: PrefillHandoff, ok: bool,
                recompute: bool = True) -> RequestOutput | None:
        return self.engine.finish_remote(request_id, ok, handoff.first_token, handoff.first_logprobs,
                                         recompute, handoff.prompt_logprobs, handoff.num_cached_tokens)

    def abandon(self, request_id: str) -> None:
        """The prefill side never produced R's first token: recompute from the prompt, or drop R."""
        self.connector.cancel(request_id)
        if self.policy == "recompute":
            self.engine.finish_remote(request_id, ok=False, first_token=None, recompute=True)
            self.counters["recomputed"] += 1
        else:
            self.engine.abort_request(request_id)

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), **self.counters,
                **{f"kv_{k}": v for k, v in self.connector.stats().items()}}
