"""Collective connector: point-to-point send/recv over a 2-rank torch.distributed group.

    prefill P (rank 0, keeps the group's store)         decode D (rank 1)
    first send to D: kv_control("join") ──────────▶    a thread forms rank 1, then loops:
                     ◀──── kv_control("store", ...)    rendezvous keys, through Ray
    each transfer, over the group:
      int64 header length, header bytes ──────────▶    parse, is_expected, check_header
                     ◀──── verdict int64 [code, n]     (+ n bytes of reason on refusal)
      payload bytes, only on code 0 ──────────────▶    into a buffer of exactly that size
                                                       → mailbox; receive() checks the checksum

One group per (sender, receiver) pair, formed lazily on the first send and cached. A group
that fails (timeout, peer gone, unframeable bytes) is severed on both ends and re-formed on
the next send. The store is a Python `torch.distributed.Store` whose keys live in the sender
connector (no TCPStore, no default group); gloo binds only to `host` (loopback by default).

Trust: gloo aborts the receiving *process* when a peer sends more bytes than the posted
buffer holds, so this transport is for the actors of one cluster, and a sender refuses to
frame a payload whose size differs from its header. A refusal (unexpected request, bad or
oversized header) comes back as a verdict the sender raises as the typed error; the stream
stays in sync. Hosting actors must be threaded (max_concurrency >= 2 + concurrent sends):
a blocking store wait and a control call run beside a send.
"""

from __future__ import annotations

import threading
import uuid
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from cluster.kvtransfer.base import Expected, KVConnector
from cluster.kvtransfer.handoff import Receipt, Receiver
from cluster.kvtransfer.errors import (KVFrameError, KVIntegrityError, KVLayoutMismatchError,
                                       KVPeerGoneError, KVTimeoutError, KVTransferError)
from cluster.kvtransfer.mailbox import Mailbox
from cluster.kvtransfer.rendezvous import KeyStore, TorchStore, control, current_actor
from cluster.engine.kv_layout import KVLayout
from cluster.kvtransfer.wire import MAX_HEADER_BYTES, KVHeader, parse_header

_TAG = 0
_SEVER_TAG = 0x7FFF
_IDLE = timedelta(days=1)  # a receive loop waiting for the next transfer
_KINDS = (KVTransferError, KVFrameError, KVLayoutMismatchError, KVIntegrityError, KVTimeoutError, KVPeerGoneError)


class _Stale(Exception):
    """A cached group failed its first op: re-form it once."""

    def __init__(self, error: KVTransferError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _Link:
    group: str
    pg: Any
    peer: int  # the other rank
    store: Any = None  # kept alive with the group: nccl reads it again at its first op
    thread: threading.Thread | None = None


class CollectiveConnector(KVConnector):
    name = "collective"
    zero_copy = False
    cross_node = True
    needs_ray = True

    def __init__(self, layout: KVLayout, *, max_payload_bytes: int = 1 << 30, timeout_s: float = 30.0,
                 backend: str = "auto", host: str = "127.0.0.1") -> None:
        super().__init__(layout, max_payload_bytes=max_payload_bytes, timeout_s=timeout_s)
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"collective backend must be 'gloo', 'nccl' or 'auto', not {backend!r}")
        self.backend, self.host = backend, host
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._id = uuid.uuid4().hex
        self._mailbox = Mailbox()
        self._state = threading.Lock()
        self._closed = False
        self._links: dict[str, _Link] = {}  # sender side, by receiver connector id
        self._peer_locks: dict[str, threading.Lock] = {}
        self._stores: dict[str, KeyStore] = {}  # sender side, by group id
        self._serving: dict[str, _Link] = {}  # receiver side, by group id

    # -- decode side -----------------------------------------------------------------
    def _receiver_address(self) -> dict[str, Any]:
        return {"actor": current_actor(), "connector_id": self._id}

    def _fetch(self, expected: Expected, receipt: Receipt, timeout_s: float) -> tuple[bytes, Any]:
        return self._mailbox.wait(expected.request_id, timeout_s)

    def _forget(self, request_id: str) -> None:
        self._mailbox.discard(request_id)

    def on_control(self, op: str, args: dict[str, Any]) -> Any:
        """`join` (on the receiver: start rank 1 of a group) and `store` (on the sender)."""
        if op == "join":
            return self._join(args)
        if op == "store":
            with self._state:
                store = self._stores.get(str(args.get("group")))
            if store is None:
                raise KVPeerGoneError(f"no group {args.get('group')!r} here (dropped, or this sender restarted)")
            return store.call(str(args.get("method")), *args.get("args", ()))
        return super().on_control(op, args)

    def _join(self, args: dict[str, Any]) -> bool:
        if self._closed or args.get("receiver_id") != self._id:
            raise KVPeerGoneError("that collective receiver is closed or gone (stale receiver_info)")
        group, sender = str(args["group"]), args["sender"]
        threading.Thread(target=self._serve, args=(group, sender), daemon=True,
                         name=f"tandem-kv-collective-{group[:8]}").start()
        return True

    def _serve(self, group: str, sender: Any) -> None:
        def call(method: str, *args: Any) -> Any:
            return control(sender, "store", {"group": group, "method": method, "args": list(args)},
                            2 * self.timeout_s)
        store = TorchStore(call, self.timeout_s)
        try:
            link = _Link(group, self._new_group(store, rank=1), peer=0, store=store,
                         thread=threading.current_thread())
        except Exception:
            self.counters["group_join_failed"] += 1
            return
        with self._state:
            if not self._closed:
                self._serving[group] = link
        try:
            while not self._closed:
                self._receive_one(link)
        except Exception as exc:
            if not self._closed:
                self.counters[f"group_ended_{getattr(exc, 'kind', 'error')}"] += 1
        finally:
            with self._state:
                self._serving.pop(group, None)
            self._sever(link)

    def _receive_one(self, link: _Link) -> None:
        """One transfer; raises when the stream can no longer be framed (the group ends)."""
        n = int(self._recv(link, 1, torch.int64, _IDLE).item())
        if not 0 < n <= MAX_HEADER_BYTES:
            raise KVFrameError(f"header length {n} outside 1..{MAX_HEADER_BYTES}: cannot frame the stream")
        header_bytes = bytes(self._recv(link, n, torch.uint8).cpu().numpy())
        header, refusal = self._judge(header_bytes)
        self._send_verdict(link, refusal)
        if refusal is not None or header is None:
            return
        try:
            payload = self._recv(link, header.payload_bytes, torch.uint8) if header.payload_bytes else None
        except KVTransferError as exc:
            self._post(header.request_id, exc)
            raise
        # nccl: a device→host copy here, the price of the checksum that receive() checks on CPU
        data = payload.cpu().numpy() if payload is not None else b""
        self._post(header.request_id, (header_bytes, data))

    def _judge(self, header_bytes: bytes) -> tuple[KVHeader | None, KVTransferError | None]:
        """Accept a header (checked before anything is allocated for its payload) or say why not."""
        try:
            header = parse_header(header_bytes)
        except KVFrameError as exc:
            self.counters["refused_frame"] += 1
            return None, exc
        expected = self.is_expected(header.request_id)
        if expected is None:
            self.counters["dropped_unexpected"] += 1
            return header, KVFrameError(f"{header.request_id!r} is not expected here")
        try:
            return self.check_header(header_bytes, expected), None
        except KVTransferError as exc:
            self.counters[f"refused_{exc.kind}"] += 1
            self._post(header.request_id, exc)
            return header, exc

    def _post(self, request_id: str, item: tuple[bytes, Any] | KVTransferError) -> None:
        if isinstance(item, KVTransferError):
            self._mailbox.fail(request_id, item)
        else:
            self._mailbox.deliver(request_id, item)
        if self.is_expected(request_id) is None:  # cancelled while it was in flight
            self._mailbox.discard(request_id)
            self.counters["dropped_late"] += 1

    def _send_verdict(self, link: _Link, refusal: KVTransferError | None) -> None:
        reason = b"" if refusal is None else str(refusal).encode()[:MAX_HEADER_BYTES]
        code = 0 if refusal is None else next(i for i, c in enumerate(_KINDS) if c.kind == refusal.kind) + 1
        self._send(link, torch.tensor([code, len(reason)], dtype=torch.int64))
        if reason:
            self._send(link, _byte_tensor(reason))

    # -- prefill side ----------------------------------------------------------------
    def _transmit(self, header: KVHeader, payload: memoryview, receiver: Receiver) -> Receipt:
        if payload.nbytes != header.payload_bytes:
            raise KVFrameError(f"payload of {payload.nbytes} bytes under a header declaring "
                               f"{header.payload_bytes}: refusing to frame it")
        return self.transmit_frames(header.encode(), payload, receiver)

    def transmit_frames(self, header_bytes: bytes, payload: memoryview, receiver: Receiver) -> Receipt:
        """One transfer over the cached group, formed first if needed (also the fault-test hook)."""
        if not 0 < len(header_bytes) <= MAX_HEADER_BYTES:
            raise KVFrameError(f"header of {len(header_bytes)} bytes outside 1..{MAX_HEADER_BYTES}")
        peer_id = receiver.connector_id
        with self._peer_lock(peer_id):
            link = self._links.get(peer_id)
            if link is not None:
                try:
                    return self._transfer(peer_id, link, header_bytes, payload)
                except _Stale:
                    self.counters["groups_stale"] += 1
            try:
                return self._transfer(peer_id, self._form(peer_id, receiver), header_bytes, payload)
            except _Stale as stale:
                raise stale.error from None

    def _peer_lock(self, peer_id: str) -> threading.Lock:
        with self._state:
            if self._closed:
                raise KVTransferError("this collective connector is closed")
            return self._peer_locks.setdefault(peer_id, threading.Lock())

    def _transfer(self, peer_id: str, link: _Link, header_bytes: bytes, payload: memoryview) -> Receipt:
        try:
            refusal = self._exchange(link, header_bytes, payload)
        except BaseException:
            self._drop_link(peer_id)
            raise
        if refusal is not None:
            raise refusal
        return Receipt()

    def _exchange(self, link: _Link, header_bytes: bytes, payload: memoryview) -> KVTransferError | None:
        try:
            self._send(link, torch.tensor([len(header_bytes)], dtype=torch.int64))
        except KVPeerGoneError as exc:
            raise _Stale(exc) from None
        self._send(link, _byte_tensor(header_bytes))
        code, n = self._recv(link, 2, torch.int64).tolist()
        if code == 0:
            if payload.nbytes:
                self._send(link, _byte_tensor(payload))
            return None
        if not 0 < code <= len(_KINDS) or not 0 <= n <= MAX_HEADER_BYTES:
            raise KVFrameError(f"malformed verdict {code}/{n} from the receiver")
        reason = bytes(self._recv(link, n, torch.uint8).cpu().numpy()).decode(errors="replace") if n else ""
        return _KINDS[code - 1](f"receiver refused the KV: {reason}")

    def _form(self, peer_id: str, receiver: Receiver) -> _Link:
        actor, me = receiver.actor, current_actor()
        if actor is None:
            raise KVTransferError("receiver_info carries no actor: not a collective receiver")
        group, store = uuid.uuid4().hex, KeyStore(self.timeout_s)
        with self._state:
            self._stores[group] = store
        try:
            control(actor, "join", {"group": group, "receiver_id": peer_id, "sender": me}, self.timeout_s)
            torch_store = TorchStore(store.call, self.timeout_s)
            link = _Link(group, self._new_group(torch_store, rank=0), peer=1, store=torch_store)
        except Exception as exc:
            with self._state:
                self._stores.pop(group, None)
            raise _transfer_error(exc, "forming the group") from None
        with self._state:
            self._links[peer_id] = link
        self.counters["groups_formed"] += 1
        return link

    def _drop_link(self, peer_id: str) -> None:
        with self._state:
            link = self._links.pop(peer_id, None)
            if link is not None:
                self._stores.pop(link.group, None)
        if link is not None:
            self._sever(link)
            self.counters["groups_dropped"] += 1

    # -- the group -------------------------------------------------------------------
    def _new_group(self, store: dist.Store, rank: int) -> Any:
        if self.backend == "nccl":
            torch.cuda.set_device(self._device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _IDLE  # the watchdog would kill an idle receive loop; ops pass their own timeouts
            return dist.ProcessGroupNCCL(store, rank, 2, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        opts._timeout = timedelta(seconds=self.timeout_s)
        opts._threads = 1  # its worker pool serves collectives; send/recv bypass it
        return dist.ProcessGroupGloo(store, rank, 2, opts)

    def _send(self, link: _Link, tensor: torch.Tensor) -> None:
        self._run(lambda: link.pg.send([tensor.to(self._device)], link.peer, _TAG))

    def _recv(self, link: _Link, n: int, dtype: torch.dtype, timeout: timedelta | None = None) -> torch.Tensor:
        tensor = torch.empty(n, dtype=dtype, device=self._device)
        self._run(lambda: link.pg.recv([tensor], link.peer, _TAG), timeout)
        return tensor

    def _run(self, start: Callable[[], Any], timeout: timedelta | None = None) -> None:
        """Start one op and wait for it; a failure while posting it (gloo raises there when the
        peer's connection is already closed) or while waiting ends as a typed error."""
        try:
            start().wait(timeout or timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise _transfer_error(exc, "collective op") from None

    def _sever(self, link: _Link) -> None:
        """Close the group's connections: every pending op on both ends fails now."""
        try:
            if self.backend == "nccl":
                link.pg.abort()
            else:  # gloo has no abort, but an op that times out closes its pair and fails the rest
                probe = torch.empty(1, dtype=torch.uint8)
                link.pg.recv([probe], link.peer, _SEVER_TAG).wait(timedelta(milliseconds=1))
        except Exception:
            pass

    def close(self) -> None:
        with self._state:
            if self._closed:
                return
            self._closed = True
            links = [*self._links.values(), *self._serving.values()]
            self._links.clear()
            self._stores.clear()
        for link in links:
            self._sever(link)
        for link in links:
            if link.thread is not None and link.thread is not threading.current_thread():
                link.thread.join(timeout=2)


def _byte_tensor(data: Any) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only buffers are fine: a send only reads them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def _transfer_error(exc: BaseException, what: str) -> KVTransferError:
    if isinstance(exc, KVTransferError):
        return exc
    text = f"{what} failed: {exc}"
    return KVTimeoutError(text) if "timed out" in str(exc).lower() else KVPeerGoneError(text)
