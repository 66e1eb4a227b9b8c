"""Finding earlier occurrences of a sequence's suffix, in C speed (bytes.rfind over int32s).

Token ids are packed 4 bytes each; a byte match at an offset that is not a multiple of 4 is not
a token match and is skipped. Used by the ngram and suffix proposers.
"""

from __future__ import annotations

from array import array
from typing import Sequence

SEPARATOR = -1  # between the sequences of one corpus: no match crosses it


def pack(token_ids: Sequence[int]) -> bytes:
    return array("i", token_ids).tobytes()


def occurrences(haystack: bytes, pattern: bytes, end: int, limit: int) -> list[int]:
    """Token offsets where `pattern` starts in haystack[:end] (byte offsets; both packed),
    latest first, at most `limit`."""
    found: list[int] = []
    stop = end
    while len(found) < limit:
        at = haystack.rfind(pattern, 0, stop)
        if at < 0:
            break
        if at % 4 == 0:
            found.append(at // 4)
        stop = at + len(pattern) - 1  # the next search ends just before this match's end
    return found
