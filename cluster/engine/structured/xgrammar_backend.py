"""The structured-output backend on xgrammar (vLLM's default): engine/structured/base.py's contract.

Measured against llguidance 1.9.1 on the default model's tokenizer (vocab 49,152, this 2-core
host): xgrammar compiles a JSON schema in ~0.1-0.2 s, once per schema (cached), and then fills
a row's mask in ~0.1-0.3 ms; llguidance compiles lazily, and its first masks of the same schema
took up to ~1.8 s (bench/structured.py). JSON is held to whitespace runs of at most
MAX_WHITESPACE_RUN characters (a weak model could otherwise spend its tokens there).
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

from cluster.engine.structured.base import Matcher, StructuredBackend
from cluster.structured_output import StructuredOutput, StructuredOutputError

MAX_WHITESPACE_RUN = 16
GRAMMAR_CACHE_BYTES = 256 << 20  # compiled grammars kept by xgrammar's own cache (evicted LRU)
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[03:22:10] /project/cpp/x.cc:83: "


class XGrammarMatcher(Matcher):
    def __init__(self, grammar: xgr.CompiledGrammar) -> None:
        self._m = xgr.GrammarMatcher(grammar)

    def accept(self, token_id: int) -> bool:
        return bool(self._m.accept_token(token_id))

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def may_end(self) -> bool:
        return bool(self._m.is_completed())


class XGrammarBackend(StructuredBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.trailing_ids = frozenset(i for i, b in enumerate(info.decoded_vocab)
                                      if b and not b.strip(b" \t\n\r") and i not in stop_token_ids)

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Compiled once per spec: xgrammar's compiler caches what it compiled."""
        try:
            return self._compile(spec)
        except (RuntimeError, ValueError, TypeError, KeyError, xgr.InvalidJSONError,
                xgr.InvalidStructuralTagError) as exc:
            raise StructuredOutputError(f"the {spec.kind} does not compile: {_message(exc)}") from None

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        c, kind = self._compiler, spec.kind
        if kind in ("json_object", "json_schema"):
            schema = spec.spec if kind == "json_schema" else '{"type": "object"}'
            return c.compile_json_schema(schema, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE_RUN,
                                         strict_mode=kind == "json_schema")
        if kind == "regex":
            return c.compile_regex(spec.spec)
        if kind == "choice":
            options = json.loads(spec.spec)
            return c.compile_grammar("root ::= " + " | ".join(_ebnf_string(o) for o in options))
        if kind == "grammar":
            return c.compile_grammar(spec.spec)
        tag = json.loads(spec.spec)  # structural_tag
        if "structures" in tag:  # the legacy form vLLM documents: {structures: [{begin, schema, end}], triggers}
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return c.compile_structural_tag(items, tag["triggers"])
        return c.compile_structural_tag(spec.spec)

    def matcher(self, grammar: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(grammar)


def _ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)


def _message(exc: BaseException) -> str:
    """The library's message, first line, without its C++ source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _LOG_PREFIX.sub("", text)[:200]
