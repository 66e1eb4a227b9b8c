"""The structured-output backend: a grammar library behind two small ABCs (the engine builds one
with `registry.create_backend(name, ...)`; xgrammar_backend.py is the one there is).

    engine (add_request / admit_remote)      backend.compile(spec) → grammar   (cached per spec)
                                              backend.matcher(grammar) → one request's Matcher
    sampler, each step, per constrained row  matcher.fill_bitmask(bitmask, row)
    Constraint.sync, after tokens land       matcher.accept(token) for each new output token
    speculative verify, per draft            accept(draft), fill the next row ... rollback(n)

Bitmask layout (xgrammar's and llguidance's): int32 words [rows, ceil(vocab / 32)], bit t % 32 of
word t // 32 set ⇔ token t may come next. A matcher sets the bits of the tokenizer's stop tokens
exactly when the reply may end here (`may_end`); it never sees a stop token fed (engine/structured/
constraint.py keeps them out, so a request's own stop_token_ids work the same way).

Who owns what: a grammar is immutable and shared by every request with the same spec; a matcher is
one request's and is used by the engine thread only. Nothing here is called concurrently.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from cluster.structured_output import StructuredOutput


class Matcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write row `row` of `bitmask` (an int32 tensor, layout above): the tokens that may come next."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected drafts; a reply cut by a stop string)."""

    @abstractmethod
    def may_end(self) -> bool:
        """The reply so far is complete: a stop token may come next (it may also go on: `\\d+`)."""


class StructuredBackend(ABC):
    """Compiles specs for one tokenizer. Built once per engine, on its first constrained request.

    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's: padding ids are
    never allowed); `stop_token_ids` are the ids that end a reply (EOS). `trailing_ids`: the
    whitespace-only tokens, what may pad a complete reply while min_tokens holds its end back."""

    name: ClassVar[str]
    trailing_ids: frozenset[int]

    @abstractmethod
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None: ...

    @abstractmethod
    def compile(self, spec: StructuredOutput) -> Any:
        """The spec's grammar, cached by spec; StructuredOutputError (a ValueError) when the
        library refuses it, its message safe to show the client."""

    @abstractmethod
    def matcher(self, grammar: Any) -> Matcher:
        """A new matcher at the start of `grammar`."""
