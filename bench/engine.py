"""Engine throughput on the default model: Tandem vs HF transformers `generate`, one JSON line.

    python bench/engine.py [--threads 1] [--new-tokens 64] [--repeats 3] [--skip-hf]
                           [--malloc-hugetlb 1] [--device auto] [--dtype auto] [--streams 16]
                           [--enforce-eager]

Both engines run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, as configs/ deploy the pools (the
script runs itself again with it: glibc reads it at start); --malloc-hugetlb 0 for glibc's default.

Figures (median of --repeats):
  prefill_tok_s          prompt tokens / time to first token, one ~100-token prompt
  prefill_scored_tok_s   the same prompt scored as lm-eval asks (prompt_logprobs=1, max_tokens 1;
                         Tandem only)
  single_stream_ms_token decode time per token of one request (after its first token)
  stream{N}_tok_s        decode tokens / s with N concurrent requests (after all first tokens),
                         for each N of --streams (default 16)

--device/--dtype as the engine takes them (auto: CUDA and bf16 where there is a GPU); HF runs
on the same device in the same dtype; --enforce-eager turns Tandem's CUDA graphs off. The
targets are the CPU issue's, for --device cpu.
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

    llm = LLM(enable_prefix_caching=False, max_num_seqs=max(args.streams),
              max_num_batched_tokens=max(2048, 32 * max(args.streams)), device=args.device,
              dtype=args.dtype, num_blocks=args.num_blocks, enforce_eager=args.enforce_eager)
    engine = llm.engine
    tok = engine.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)  # lm-eval's loglikelihood

    def run(prompts: list[list[int]], params: SamplingParams = params) -> tuple[float, float, int]:
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
    prefill, single, multi, scoring = [], [], {s: [] for s in args.streams}, []
    for r in range(args.repeats):
        ttft, dec, n = run(prompts_for(tok, 1, prompt_len))
        prefill.append(prompt_len / ttft)
        scoring.append(prompt_len / run(prompts_for(tok, 1, prompt_len), scored)[0])
        single.append(dec / n * 1000)
        for streams in args.streams:
            _, dec, n = run(prompts_for(tok, streams, 32))
            multi[streams].append(n / dec)
    return {**_summary(prefill, single, multi), "prefill_scored_tok_s": round(statistics.median(scoring), 1)}


def bench_hf(args, model_path, prompt_len: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cluster.engine.model_runner import pick_device, pick_dtype

    device = pick_device(args.device)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=pick_dtype(args.dtype, device)).to(device).eval()

    def generate(prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts, device=device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=tok.eos_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    generate(prompts_for(tok, 1, prompt_len), 2)  # warm-up
    prefill, single, multi = [], [], {s: [] for s in args.streams}
    for _ in range(args.repeats):
        p = prompts_for(tok, 1, prompt_len)
        ttft = generate(p, 1)
        prefill.append(prompt_len / ttft)
        total = generate(p, args.new_tokens)
        single.append((total - ttft) / (args.new_tokens - 1) * 1000)
        for streams in args.streams:
            batch = prompts_for(tok, streams, 32)
            first = generate(batch, 1)
            total = generate(batch, args.new_tokens)
            multi[streams].append(streams * (args.new_tokens - 1) / (total - first))
    return _summary(prefill, single, multi)


def _summary(prefill: list[float], single: list[float], multi: dict[int, list[float]]) -> dict:
    return {
        "prefill_tok_s": round(statistics.median(prefill), 1),
        "single_stream_ms_token": round(statistics.median(single), 2),
        **{f"stream{s}_tok_s": round(statistics.median(v), 1) for s, v in multi.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--malloc-hugetlb", type=int, choices=(0, 1), default=1)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--streams", type=lambda v: [int(x) for x in v.split(",")], default=[16],
                        help="comma-separated concurrencies for the stream{N}_tok_s figures")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="on CUDA, no CUDA graphs for decode steps")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks (default: the engine's sizing)")
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
        "device": str(_device_name(args.device)),
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
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


def _device_name(name: str) -> str:
    from cluster.engine.model_runner import pick_device

    device = pick_device(name)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
