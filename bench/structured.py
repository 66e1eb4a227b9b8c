"""Structured output's cost on the default model's tokenizer (vocab 49,152), one JSON line.

    python bench/structured.py [--rows 1,8] [--repeats 3] [--threads 1]

Through the engine's real path: each step calls `sampler.sample` on [rows, vocab] logits with
every row's constraint (synced with the row's output, then its mask applied), against the same
call without constraints. Each row's output walks the whole reference reply; the logits are noise
with the reply's next token ranked first (a model that wants the valid reply: rank1) or 1000th
(a weak model whose likeliest tokens break the format: rank1000).

Figures, per spec (a JSON schema, json_object, a regex):
  compile_ms             spec → grammar, cold (the engine caches it per spec)
  setup_ms               the tokenizer's tables, once per engine (not per spec)
  mask_ms_per_row_step   (constrained - unconstrained sample time) / rows, median over the reply's
                         steps, for each --rows, rank1 / rank1000, greedy and temperature 1

It also runs against the hand-written recognizers this replaced (before): from a checkout of
that code, `PYTHONPATH=<checkout> python bench/structured.py` (the script finds which API it has).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                         "ok": {"type": "boolean"}}}
REPLIES = {
    "json_schema": json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "ok": True}),
    "json_object": json.dumps({"city": "Paris", "population": 2102650, "sights": ["Louvre", "Orsay"], "capital": True}),
    "regex": "call 555-123-4567 on 2024-02-29",
}
PATTERN = r"call [0-9]{3}-[0-9]{3}-[0-9]{4} on [0-9]{4}-[0-9]{2}-[0-9]{2}"


class Api:
    """The constraint path of whichever checkout is on the path: `structured` (engine/structured/,
    xgrammar) or `recognizers` (the hand-written engine/json_mode.py and friends)."""

    def __init__(self, tokenizer, eos: set[int]) -> None:
        self.tok, self.eos = tokenizer, eos
        try:
            from cluster.engine.structured.constraint import Constraint  # noqa: F401

            self.kind = "structured"
        except ImportError:
            self.kind = "recognizers"
        started = time.perf_counter()
        if self.kind == "structured":
            from cluster.engine.structured.registry import create_backend

            self.backend = create_backend("xgrammar", tokenizer, len(tokenizer), sorted(eos))
        else:
            from cluster.engine.json_mode import token_bytes, whitespace_ids

            self.table = token_bytes(tokenizer)
            self.trailing = whitespace_ids(self.table)
        self.setup_ms = (time.perf_counter() - started) * 1e3

    def params(self, name: str, temperature: float):
        from cluster.sampling_params import SamplingParams

        if self.kind == "structured":
            from cluster.structured_output import StructuredOutput

            spec = {"json_schema": StructuredOutput.schema(SCHEMA), "json_object": StructuredOutput("json_object"),
                    "regex": StructuredOutput("regex", PATTERN)}[name]
            return SamplingParams(temperature=temperature, max_tokens=None, structured=spec)
        kw = {"json_schema": {"json_schema": json.dumps(SCHEMA)}, "json_object": {"json_object": True},
              "regex": {"regex": PATTERN}}[name]
        return SamplingParams(temperature=temperature, max_tokens=None, **kw)

    def compile_ms(self, name: str) -> float:
        params = self.params(name, 0.0)
        started = time.perf_counter()
        if self.kind == "structured":
            self.backend._cache.clear()
            self.backend.compile(params.structured)
        else:
            from cluster.engine import regex, schema_compiler

            schema_compiler.schema_recognizer.cache_clear()
            regex.regex_recognizer.cache_clear()
            if params.json_schema is not None:
                schema_compiler.schema_recognizer(params.json_schema)
            elif params.regex is not None:
                regex.regex_recognizer(params.regex)
        return (time.perf_counter() - started) * 1e3

    def constraint(self, params):
        if self.kind == "structured":
            from cluster.engine.structured.constraint import Constraint

            grammar = self.backend.compile(params.structured)
            return Constraint(self.backend.matcher(grammar), self.eos, trailing_ids=self.backend.trailing_ids)
        from cluster.engine.json_mode import JsonConstraint, JsonRecognizer
        from cluster.engine.regex import regex_recognizer
        from cluster.engine.schema_compiler import schema_recognizer

        recognizer = (regex_recognizer(params.regex) if params.regex is not None
                      else schema_recognizer(params.json_schema) if params.json_schema is not None else JsonRecognizer)
        return JsonConstraint(self.table, self.eos, trailing_ids=self.trailing, recognizer=recognizer)


def mask_cost(api: Api, name: str, rows: int, temperature: float, rank: int, gen: torch.Generator) -> float:
    """Median over the reply's steps of (constrained - plain) sample time per row, in ms."""
    from cluster.engine.sampler import sample

    ids = api.tok.encode(REPLIES[name], add_special_tokens=False)
    params = api.params(name, temperature)
    plain = api.params(name, temperature)
    plain = type(plain)(temperature=temperature, max_tokens=None)
    constraints = [api.constraint(params) for _ in range(rows)]
    vocab = len(api.tok)
    costs = []
    for k, target in enumerate(ids):
        logits = torch.randn(rows, vocab, generator=gen)
        logits[:, target] = 12.0 if rank == 1 else logits[0].topk(rank).values[-1]
        outs = [ids[:k]] * rows
        gens = [torch.Generator().manual_seed(k)] * rows
        t0 = time.perf_counter()
        sample(logits, [plain] * rows, gens, [[]] * rows, outs, api.eos)
        t1 = time.perf_counter()
        got = sample(logits, [params] * rows, gens, [[]] * rows, outs, api.eos, constraints).token_ids
        t2 = time.perf_counter()
        assert got == [target] * rows or temperature > 0 or rank > 1, (name, k, got, target)
        costs.append(((t2 - t1) - (t1 - t0)) * 1e3 / rows)
    return statistics.median(costs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from cluster.models.default_model import ensure_default_model

    path = ensure_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(str(path))
    api = Api(tok, {int(tok.eos_token_id)})
    gen = torch.Generator().manual_seed(0)
    out: dict = {"code": api.kind, "setup_ms": round(api.setup_ms, 1), "vocab": len(tok), "threads": args.threads,
                 "host": platform.node(), "python": sys.version.split()[0], "specs": {}}
    for name in REPLIES:
        entry: dict = {"compile_ms": round(statistics.median(api.compile_ms(name) for _ in range(args.repeats)), 2),
                       "reply_tokens": len(tok.encode(REPLIES[name], add_special_tokens=False))}
        for rows in (int(r) for r in args.rows.split(",")):
            for rank in (1, 1000):
                for temperature in (0.0, 1.0):
                    key = f"mask_ms_per_row_step[rows={rows},rank{rank},{'greedy' if temperature == 0 else 'T=1'}]"
                    entry[key] = round(statistics.median(mask_cost(api, name, rows, temperature, rank, gen)
                                                         for _ in range(args.repeats)), 3)
        out["specs"][name] = entry
    print(json.dumps(out))


if __name__ == "__main__":
    main()
