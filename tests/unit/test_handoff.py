"""The hand-off's failure policy (cluster/kvtransfer/handoff.py): a prefill replica lost before
answering is retried on another, PREFILL_RETRIES times; any other prefill error is not retried."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine.kv_layout import KVLayout
from cluster.kvtransfer.handoff import (PREFILL_RETRIES, PrefillHandoff, PrefillReplicaLost, Receiver,
                                        prefill_with_retries)
from cluster.sampling_params import SamplingParams

RECEIVER = Receiver("tcp", KVLayout("m@0", 2, 1, 4, 16, "float32"), cached_blocks=1, address="tcp://127.0.0.1:1")


class Flaky:
    """A PrefillClient whose first `lost` calls die with the replica, then answer (or raise `error`)."""

    def __init__(self, lost: int, error: Exception | None = None) -> None:
        self.lost, self.error, self.calls = lost, error, []

    async def prefill(self, request_id, prompt_token_ids, params, receiver):
        self.calls.append(receiver)
        if len(self.calls) <= self.lost:
            raise PrefillReplicaLost("gone")
        if self.error is not None:
            raise self.error
        return PrefillHandoff(request_id, 7, None)

    async def ack(self, handoff):
        pass


def ask(client: Flaky) -> tuple[PrefillHandoff, int]:
    retried = []
    handoff = asyncio.run(prefill_with_retries(client, "r", [1, 2, 3], SamplingParams(), RECEIVER,
                                               lambda: retried.append(1)))
    return handoff, len(retried)


def test_a_lost_replica_is_retried_with_the_same_receiver_until_one_answers():
    client = Flaky(lost=PREFILL_RETRIES)
    handoff, retried = ask(client)
    assert handoff.first_token == 7 and retried == PREFILL_RETRIES
    assert client.calls == [RECEIVER] * (PREFILL_RETRIES + 1)


def test_after_the_last_retry_the_loss_is_raised():
    client = Flaky(lost=PREFILL_RETRIES + 1)
    with pytest.raises(PrefillReplicaLost):
        ask(client)
    assert len(client.calls) == PREFILL_RETRIES + 1


def test_other_prefill_errors_are_not_retried():
    client = Flaky(lost=0, error=ValueError("bad prompt"))
    with pytest.raises(ValueError, match="bad prompt"):
        ask(client)
    assert len(client.calls) == 1
