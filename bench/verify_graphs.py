"""Speculative verify steps on CUDA: eager against CUDA graph replays, one JSON object.

    python bench/verify_graphs.py [--model FOLDER] [--random-weights] [--streams 1,16,64]

Each system generates 256 greedy tokens per stream from 64-token random prompts, bf16 on
CUDA, ngram speculation with k = 3 and `adaptive: false` (every step that can draft, drafts):
verify steps eager (`enforce_eager`), verify steps replayed from the decode graphs, and no
speculation (graphs). Per system and stream count: output tok/s, graph replays, acceptance.

`--random-weights` builds a model of the given model's shape with random weights (for a
machine the weights cannot travel to; only its config and tokenizer are read). Such a model
repeats itself, so drafts are accepted nearly always: an upper bound, not a workload.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def random_copy(src: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    dst = Path(tempfile.mkdtemp(prefix="random-weights-"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local HF folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--streams", default="1,16,64")
    p.add_argument("--max-tokens", type=int, default=256)
    args = p.parse_args()

    from cluster import LLM, SamplingParams
    from cluster.models.default_model import ensure_default_model

    model = Path(args.model) if args.model else ensure_default_model()
    if args.random_weights:
        model = random_copy(model)
    ngram = {"method": "ngram", "adaptive": False, "prompt_lookup_min": 1, "num_speculative_tokens": 3}
    systems = {"verify eager": {"enforce_eager": True, "speculative_config": ngram},
               "verify graphs": {"speculative_config": ngram},
               "no speculation, graphs": {}}
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, dict] = {"device": torch.cuda.get_device_name(), "model": str(model),
                                "random_weights": args.random_weights, "runs": {}}
    for n in (int(s) for s in args.streams.split(",")):
        prompts = [torch.randint(100, 40000, (64,), generator=gen).tolist() for _ in range(n)]
        for name, engine_args in systems.items():
            llm = LLM(str(model), device="cuda", num_blocks=4096, max_num_seqs=64,
                      max_num_batched_tokens=1024, **engine_args)
            llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))  # warm
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            spec = llm.engine.speculator.stats() if llm.engine.speculator else {}
            results["runs"][f"{name}, {n} streams"] = {
                "tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, 1),
                "graph_steps": getattr(llm.engine.runner.graphs, "steps", 0),
                "acceptance": spec.get("spec_acceptance_rate")}
            del llm
            torch.cuda.empty_cache()
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
