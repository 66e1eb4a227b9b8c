"""The proposer contract: who drafts what, when, and what the verifier relies on.

A proposer drafts tokens that may continue a running request; the target model scores them in
the same forward pass as the other requests' tokens (engine/spec/speculator.py plans it,
sampler._choose_verifying accepts or rejects), so every accepted draft token is a token won without a
step of its own.

Who calls what (the engine thread, nothing else):

    propose(requests, limits)   once per step, after the scheduler planned it and before the
                                model runs: for each request (running, decoding, its next token
                                known) at most limits[i] tokens continuing request.token_ids
                                ([] for none). limits[i] may be 0: propose nothing for it.
    computed(chunks)            after the target's forward pass over a step's chunks (drafts
                                included): a proposer with a KV cache of its own computes the
                                same positions, so its KV is valid wherever the target's is
    finish(request)             the request finished (stop or length): its output is final
    forget(request_id)          the request left this engine by any way (finished, aborted,
                                migrated away); drop whatever is kept for it

Contract:
- Drafts are a deterministic function of what the proposer was given (a point mass): the
  verifier's exactness under sampling rests on it (engine/sampler.py: `_choose_verifying`).
- State is rebuilt from token ids: a request never seen before (a preempted one recomputed, a
  stream migrated from another replica, a prompt prefilled on another pool) is proposed for
  from `token_ids` alone, so nothing new crosses the KV connector.
- `cheap`: proposing costs next to nothing (pattern lookups), so the engine proposes for
  every candidate first and chooses lengths among what was proposed; otherwise (a draft model)
  lengths are chosen first and only those are drafted.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Sequence

from cluster.engine.request import Request

if TYPE_CHECKING:
    from cluster.engine.step_plan import ScheduledChunk


class Proposer(ABC):
    name: ClassVar[str]
    cheap: ClassVar[bool] = True
    has_kv: ClassVar[bool] = False  # its KV crosses the connector beside the target's (pack/unpack)

    @abstractmethod
    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        """Up to limits[i] draft tokens continuing requests[i].token_ids, per request."""

    def computed(self, chunks: Sequence[ScheduledChunk]) -> None:  # noqa: B027 - optional hook
        """The target computed these chunks' KV this step."""

    def finish(self, request: Request) -> None:  # noqa: B027 - optional hook
        """`request` finished normally; its output is final."""

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """`request_id` left this engine; drop its state."""
