"""One request's constraint inside the engine: its Matcher (base.py) kept in step with the
request's output tokens, plus the end ids (EOS and the request's stop_token_ids). Plain Python:
the sampler hands it a bitmask row to fill.

    sync(output_ids)          before the request's rows are filled: feed the tokens since the last
                              sync (fewer tokens than seen: a stop string cut them; roll back)
    fill(bitmask, row)        the next token's mask; end ids allowed exactly when the reply may end
    push_draft(t) ... fill    a verify run: each row advances one draft from the row before
    pop_drafts()              after the run's last row: back to the request's own output
    accepted_prefix(out, d)   how many of draft `d` the grammar allows (the speculator's cut)

End ids are never fed to the matcher (EOS under ignore_eos leaves the text as it was), nor is
whitespace after a complete reply (`trailing_ids`: the sampler's padding while min_tokens holds
the end back). A token
the grammar refuses (only possible if it was chosen without this constraint: the sampler's safety
net, or a migrated request's earlier output) ends the constraint: the request goes on
unconstrained rather than failing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from cluster.engine.structured.base import Matcher


class Constraint:
    def __init__(self, matcher: Matcher, end_ids: Collection[int], replay: Sequence[int] = (),
                 trailing_ids: Collection[int] = frozenset()) -> None:
        self.matcher = matcher
        self.end_ids = frozenset(end_ids)
        self.trailing_ids = trailing_ids
        self.active = True
        self._fed: list[bool] = []  # per output token seen: whether the matcher accepted it
        self._drafts: list[bool] = []  # the same for drafts pushed in this verify run
        self._dead = False  # a draft of this run was refused: the rows after it are never used
        self._feed(replay)
        self._replayed = len(self._fed)

    @property
    def seen(self) -> int:
        return len(self._fed) - self._replayed

    def sync(self, output_ids: Sequence[int]) -> None:
        assert not self._drafts, "pop_drafts() first"
        if len(output_ids) < self.seen:
            cut = self._fed[self._replayed + len(output_ids):]
            del self._fed[self._replayed + len(output_ids):]
            if self.active:
                self.matcher.rollback(sum(cut))
        self._feed(output_ids[self.seen:])

    def allows_end(self) -> bool:
        return not self.active or self.matcher.may_end()

    def fill(self, bitmask: Any, row: int) -> None:
        """Row `row` of `bitmask` [R, W] int32: every bit set when the constraint has ended."""
        if not self.active or self._dead:
            return  # the caller's bitmask starts all ones
        self.matcher.fill_bitmask(bitmask, row)
        may_end = self.matcher.may_end()
        words = bitmask[row]
        for t in self.end_ids:
            w = t >> 5
            if w < words.shape[0]:
                value = int(words[w]) & 0xFFFFFFFF
                value = value | (1 << (t & 31)) if may_end else value & ~(1 << (t & 31))
                words[w] = value - (1 << 32) if value >= 1 << 31 else value

    def push_draft(self, token_id: int) -> None:
        """Advance by a draft token for the next row of a verify run (undone by pop_drafts)."""
        if not self.active or token_id in self.end_ids or self._dead:
            self._drafts.append(False)
            return
        ok = self.matcher.accept(token_id)
        self._drafts.append(ok)
        self._dead = not ok

    def pop_drafts(self) -> None:
        if self.active:
            self.matcher.rollback(sum(self._drafts))
        self._drafts, self._dead = [], False

    def accepted_prefix(self, output_ids: Sequence[int], draft: Sequence[int]) -> int:
        """How many leading tokens of `draft` the grammar allows after `output_ids`."""
        self.sync(output_ids)
        n = 0
        for token in draft:
            if token in self.end_ids:
                n += self.allows_end()
                break
            if self.active and not self.matcher.accept(token):
                break
            self._drafts.append(self.active)
            n += 1
        self.pop_drafts()
        return n

    def _feed(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            if not self.active or t in self.end_ids:
                self._fed.append(False)
                continue
            ok = self.matcher.accept(t)
            self._fed.append(ok)
            if not ok and not (t in self.trailing_ids and self.matcher.may_end()):
                self.active = False
