"""Typed transfer failures; `kind` is the counter and metric label."""

from __future__ import annotations


class KVTransferError(RuntimeError):
    """Base of every transfer failure. `kind` is the counter / metric label."""

    kind = "error"


class KVTimeoutError(KVTransferError):
    kind = "timeout"


class KVLayoutMismatchError(KVTransferError):
    kind = "layout_mismatch"


class KVIntegrityError(KVTransferError):
    """The payload's checksum does not match its header."""

    kind = "checksum"


class KVFrameError(KVTransferError):
    """Malformed, truncated or oversized header/payload."""

    kind = "frame"


class KVPeerGoneError(KVTransferError):
    kind = "peer_gone"
