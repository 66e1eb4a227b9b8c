"""Where pushed payloads (or trailing checksums) wait for `receive`: one slot per expected
request, bounded waits.

A transport thread (socket listener, collective receive loop) calls `deliver`; the decode
side's `receive` calls `wait`. Payloads for requests nobody expects are dropped and counted.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from cluster.kvtransfer.errors import KVTimeoutError, KVTransferError


class Mailbox:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[str, Any] = {}  # request id -> what arrived, or a KVTransferError
        self.counters: Counter[str] = Counter()

    def deliver(self, request_id: str, item: Any) -> None:
        with self._cond:
            self._items[request_id] = item
            self._cond.notify_all()

    def fail(self, request_id: str, error: KVTransferError) -> None:
        """The transport already knows R's transfer failed (bad header, peer gone)."""
        with self._cond:
            self._items[request_id] = error
            self._cond.notify_all()

    def wait(self, request_id: str, timeout_s: float, what: str = "KV") -> Any:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while request_id not in self._items:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KVTimeoutError(f"{what} for {request_id!r} did not arrive within {timeout_s:.1f}s")
                self._cond.wait(left)
            item = self._items.pop(request_id)
        if isinstance(item, KVTransferError):
            raise item
        return item

    def discard(self, request_id: str) -> None:
        with self._cond:
            self._items.pop(request_id, None)

    def pending(self) -> int:
        with self._cond:
            return len(self._items)
