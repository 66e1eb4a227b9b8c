"""The prefill → decode hand-off as one typed contract, imported by both pools.

    decode replica                                         prefill replica
    --------------                                         ---------------
    receiver = importer.reserve(R)      ── Receiver ──▶    exporter: R's prompt KV → connector.send
    handoff = await client.prefill(R, ..., receiver)  ◀──  PrefillHandoff (first token, Receipt)
    KV = connector.receive(R, handoff.receipt)
    await client.ack(handoff)           ── ack(R) ──▶      R's blocks freed (or its lease expires)

What crosses between the pools is these frozen dataclasses, no free-form dicts: Serve pickles
them between our own actors. The KV bytes themselves never travel in them; they go over the
connector's wire (msgpack header + raw bytes, never unpickled: cluster/kvtransfer/wire.py).

Failure policy: a prefill replica that dies before answering (`PrefillReplicaLost`) is retried
on another one, `PREFILL_RETRIES` times; any other prefill error, or a transfer that fails,
takes `kv_load_failure_policy` (`FAILURE_POLICIES`): "recompute" (the decode replica computes
the prompt itself, keeping the first token when it has one) or "fail" (`PrefillFailed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from cluster.engine.outputs import TokenLogprobs
from cluster.engine.kv_layout import KVLayout
from cluster.sampling_params import SamplingParams

PREFILL_RETRIES = 2
FAILURE_POLICIES = ("recompute", "fail")


@dataclass(frozen=True)
class Receiver:
    """Where a prefill side sends R's KV: the decode side's connector (`receiver_info()`) and
    how many of R's leading blocks it holds already (its prefix cache; they are not sent).
    The transport fields are each one connector's: tcp reads `address`, collective `actor` and
    `connector_id`, shared_store none."""

    connector: str
    layout: KVLayout
    cached_blocks: int = 0
    address: str = ""  # tcp: the decode replica's listener, "tcp://host:port"
    actor: Any = None  # collective: the decode replica's actor handle (its kv_control)
    connector_id: str = ""  # collective: which connector of that actor


@dataclass(frozen=True)
class Receipt:
    """What the decode side needs besides the connector to find R's KV. Only shared_store
    fills it: the msgpack header and the object ref of the payload (borrowed, not resolved, on
    its way through Serve); tcp and collective deliver straight to the receiver."""

    header: bytes = b""
    ref: Any = None


@dataclass(frozen=True)
class PrefillHandoff:
    """What the decode side needs besides the KV itself. `finished`: the first token already
    ended the request (EOS, stop, max_tokens=1), so nothing was sent and nothing is held."""

    request_id: str
    first_token: int
    first_logprobs: TokenLogprobs | None
    receipt: Receipt = Receipt()
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    origin: str = ""  # which prefill replica holds R's blocks (acks go back there)
    prefill_s: float = 0.0  # on the prefill replica: queued + computed + sent
    kv_send_s: float = 0.0  # of which moving the KV (the connector's send)
    kv_bytes: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., when asked for
    num_cached_tokens: int = 0  # prompt tokens the prefill side's prefix cache served (usage's cached_tokens)


class PrefillClient(Protocol):
    """How a decode replica reaches the prefill pool (over Serve: decode/deployment.py; in one
    process: prefill/server.py's LocalPrefillClient). `prefill` raises `PrefillReplicaLost`
    when the replica died before answering; cancelling it cancels R's prefill."""

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: Receiver) -> PrefillHandoff: ...

    async def ack(self, handoff: PrefillHandoff) -> None: ...


class PrefillReplicaLost(RuntimeError):
    """The prefill replica died before answering (a `PrefillClient` raises it): worth a retry."""


class PrefillFailed(RuntimeError):
    """The prefill pool could not produce R's first token and the policy is `fail`."""


async def prefill_with_retries(client: PrefillClient, request_id: str, prompt: Sequence[int],
                               params: SamplingParams, receiver: Receiver,
                               on_retry: Callable[[], None] = lambda: None) -> PrefillHandoff:
    """Ask the prefill pool; a replica lost before answering is retried on another one
    (`PREFILL_RETRIES` times: the pool's router no longer picks a dead replica)."""
    for attempt in range(PREFILL_RETRIES + 1):
        try:
            return await client.prefill(request_id, prompt, params, receiver)
        except PrefillReplicaLost:
            if attempt == PREFILL_RETRIES:
                raise
            on_retry()
    raise AssertionError("unreachable")
