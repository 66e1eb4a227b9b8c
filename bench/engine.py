"""Engine throughput on the default model: Tandem vs HF transformers `generate`, one JSON line.

    python bench/engine.py [--threads 1] [--new-tokens 64] [--repeats 3] [--skip-hf]
                           [--malloc-hugetlb 1]

Both engines run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, as configs/ deploy the pools (the
script runs itself again with it: glibc reads it at start); --malloc-hugetlb 0 for glibc's default.

Figures (median of --repeats):
  prefill_tok_s          prompt tokens / time to first token, one ~100-token prompt
  single_stream_ms_token decode time per token of one request (after its first token)
  stream16_tok_s         decode tokens / s with 16 concurrent requests (after all first tokens)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

PROMPT = ("You are a helpful assistant. Summarize the following passage in two sentences. "
          "The history of computing spans centuries, from mechanical calculators and the "
          "difference engine to vacuum tubes, transistors, integrated circuits and the "
          "microprocessor. Each step made machines smaller, faster and cheaper, and brought "
          "them from laboratories into offices, homes and finally pockets around the world.")


def prompts_for(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens (distinct so no prefix cache helps)."""
    base = tokenizer.encode(PROMPT)
    while len(base) < length:
        base = base + base
    return [[1000 + i] + base[: length - 1] for i in range(n)]


def bench_tandem(args, prompt_len: int) -> dict:
    from cluster import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False, max_num_seqs=16, max_num_batched_tokens=2048)
    engine = llm.engine
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def run(prompts: list[list[int]]) -> tuple[float, float, int]:
        """(time to all first tokens, decode time after that, decode tokens)"""
        for i, p in enumerate(prompts):
            engine.add_request(f"b{time.perf_counter_ns()}-{i}", p, params)
        t0 = time.perf_counter()
        firsts = 0
        while firsts < len(prompts):
            firsts += len(engine.step())
        t1 = time.perf_counter()
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += len(engine.step())
        return t1 - t0, time.perf_counter() - t1, tokens

    run(prompts_for(tok, 1, prompt_len))  # warm-up
    prefill, single, multi = [], [], []
    for r in range(args.repeats):
        ttft, dec, n = run(prompts_for(tok, 1, prompt_len))
        prefill.append(prompt_len / ttft)
        single.append(dec / n * 1000)
        _, dec, n = run(prompts_for(tok, 16, 32))
        multi.append(n / dec)
    return _summary(prefill, single, multi)


def bench_hf(args, model_path, prompt_len: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=tok.eos_token_id)
        return time.perf_counter() - t0

    generate(prompts_for(tok, 1, prompt_len), 2)  # warm-up
    prefill, single, multi = [], [], []
    for _ in range(args.repeats):
        p = prompts_for(tok, 1, prompt_len)
        ttft = generate(p, 1)
        prefill.append(prompt_len / ttft)
        total = generate(p, args.new_tokens)
        single.append((total - ttft) / (args.new_tokens - 1) * 1000)
        p16 = prompts_for(tok, 16, 32)
        first16 = generate(p16, 1)
        total16 = generate(p16, args.new_tokens)
        multi.append(16 * (args.new_tokens - 1) / (total16 - first16))
    return _summary(prefill, single, multi)


def _summary(prefill: list[float], single: list[float], multi: list[float]) -> dict:
    return {
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "single_stream_ms_token": round(statistics.median(single), 2),
        "stream16_tok_s": round(statistics.median(multi), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--malloc-hugetlb", type=int, choices=(0, 1), default=1)
    args = parser.parse_args()
    want = "glibc.malloc.hugetlb=1" if args.malloc_hugetlb else None
    if os.environ.get("GLIBC_TUNABLES") != want:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | ({"GLIBC_TUNABLES": want} if want else {})
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    torch.set_num_threads(args.threads)

    from cluster.models.default_model import ensure_default_model

    model_path = ensure_default_model(progress=False)
    result = {
        "bench": "engine",
        "model": model_path.name,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "torch": torch.__version__,
        "threads": args.threads,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "tandem": bench_tandem(args, args.prompt_tokens),
    }
    if not args.skip_hf:
        result["hf_transformers"] = bench_hf(args, model_path, args.prompt_tokens)
    result["targets"] = {"single_stream_ms_token_max": 40, "prefill_tok_s_min": 105,
                         "stream16_tok_s_min": 75}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
