"""Each Triton kernel against its torch reference on a CUDA device, one JSON line.

    python bench/triton_kernels.py [--repeats 100]

Shapes are the default model's (30 layers, 9 query heads over 3 KV heads, head_dim 64,
block 16); every case checks the kernel's output against the reference's on the same inputs
before timing either (`max_abs_err`: 0 for the copies, float rounding for attention), then
times both two ways:

  *_call_us    back-to-back calls from Python, launch and argument checks included: what the
               engine pays per call (the ratio of these is `speedup`)
  *_kernel_us  the same call replayed in a CUDA graph (triton.testing.do_bench_cudagraph): the
               GPU work alone; null where the call cannot be captured (it syncs)

  store_kv       one decode step of 64 tokens and one 2,048-token prefill, one layer
  paged_decode   1 sequence at 4,096 and 64 at 512 and 2,048 context tokens, bf16 and fp32
  pack_kv        a 256/1k/4k-token request's blocks of all 30 layers into one buffer, bf16,
                 with GB/s (bytes read + written, from kernel time) beside a plain device copy
  unpack_kv      the inverse scatter

Needs CUDA: on CPU the kernels run only through the Triton interpreter, which tests
correctness (tests/unit/test_kernels.py) and says nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton
from triton.testing import do_bench_cudagraph

from kernels import (pack_kv, paged_decode_attention, ref_pack_kv, ref_paged_decode_attention,
                     ref_store_kv, ref_unpack_kv, store_kv, unpack_kv)

LAYERS, HQ, HKV, D, BS = 30, 9, 3, 64, 16
NUM_BLOCKS = 8192  # 131,072 token slots per layer: 64 sequences x 2,048 tokens fit


def call_us(fn, repeats: int) -> float:
    """Mean microseconds per call over `repeats` back-to-back calls, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def kernel_us(fn, repeats: int) -> float | None:
    try:
        return round(1000 * do_bench_cudagraph(fn, rep=repeats, return_mode="median"), 1)
    except Exception:  # a sync inside (the references' data-dependent shapes) cannot be captured
        torch.cuda.synchronize()
        return None


def case(name: str, kernel, reference, check, repeats: int, **extra) -> dict:
    err = check()
    tri, ref = call_us(kernel, repeats), call_us(reference, repeats)
    return {"case": name, "max_abs_err": err, "triton_call_us": round(tri, 1),
            "reference_call_us": round(ref, 1), "speedup": round(ref / tri, 2),
            "triton_kernel_us": kernel_us(kernel, repeats), "reference_kernel_us": kernel_us(reference, repeats),
            **extra}


def store_cases(gen: torch.Generator, repeats: int) -> list[dict]:
    out = []
    for tokens in (64, 2048):
        k_cache = torch.zeros(NUM_BLOCKS, BS, HKV, D, device="cuda", dtype=torch.bfloat16)
        v_cache, k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(k_cache), torch.zeros_like(k_cache)
        key = torch.randn(tokens, HKV, D, generator=gen).to("cuda", torch.bfloat16)
        value = torch.randn(tokens, HKV, D, generator=gen).to("cuda", torch.bfloat16)
        slots = torch.randperm(NUM_BLOCKS * BS, generator=gen)[:tokens].cuda()

        def check() -> float:
            store_kv(key, value, k_cache, v_cache, slots)
            ref_store_kv(key, value, k2, v2, slots)
            return max((k_cache - k2).abs().max().item(), (v_cache - v2).abs().max().item())

        out.append(case(f"store_kv bf16 {tokens} tokens",
                        lambda: store_kv(key, value, k_cache, v_cache, slots),
                        lambda: ref_store_kv(key, value, k2, v2, slots), check, repeats))
    return out


def attention_cases(gen: torch.Generator, repeats: int) -> list[dict]:
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        k_cache = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen).to("cuda", dtype)
        v_cache = torch.randn(NUM_BLOCKS, BS, HKV, D, generator=gen).to("cuda", dtype)
        for batch, context in ((1, 4096), (64, 512), (64, 2048)):
            width = context // BS
            tables = torch.randperm(NUM_BLOCKS, generator=gen)[: batch * width].view(batch, width)
            tables, lens = tables.to("cuda", torch.int32), torch.full((batch,), context, dtype=torch.int32, device="cuda")
            lens[::2] -= BS // 2  # half the sequences end inside their last block
            query = torch.randn(batch, HQ, D, generator=gen).to("cuda", dtype)
            args = (query, k_cache, v_cache, tables, lens, D ** -0.5)

            def check() -> float:
                got, want = paged_decode_attention(*args), ref_paged_decode_attention(*args)
                return (got.float() - want.float()).abs().max().item()

            out.append(case(f"paged_decode {str(dtype).removeprefix('torch.')} {batch} x {context}",
                            lambda: paged_decode_attention(*args),
                            lambda: ref_paged_decode_attention(*args), check, repeats))
    return out


def pack_cases(gen: torch.Generator, repeats: int) -> list[dict]:
    out = []
    cache = torch.randn(LAYERS, 2, 1024, BS, HKV, D, generator=gen).to("cuda", torch.bfloat16)
    for tokens in (256, 1024, 4096):
        n = tokens // BS
        ids = torch.randperm(1024, generator=gen)[:n].cuda()
        packed = pack_kv(cache, ids)
        nbytes = packed.numel() * packed.element_size()
        src, dst = torch.empty_like(packed), torch.empty_like(packed)
        copy_us = kernel_us(lambda: dst.copy_(src), repeats)
        gbps = lambda us: us and round(2 * nbytes / us / 1e3, 1)  # noqa: E731 (read + write)
        target, target_ref = torch.zeros_like(cache), torch.zeros_like(cache)

        def check_pack() -> float:
            return (pack_kv(cache, ids).float() - ref_pack_kv(cache, ids).float()).abs().max().item()

        def check_unpack() -> float:
            unpack_kv(packed, target, ids)
            ref_unpack_kv(packed, target_ref, ids)
            return (target.float() - target_ref.float()).abs().max().item()

        for name, kernel, reference, check in (
                ("pack_kv", lambda: pack_kv(cache, ids), lambda: ref_pack_kv(cache, ids), check_pack),
                ("unpack_kv", lambda: unpack_kv(packed, target, ids),
                 lambda: ref_unpack_kv(packed, target_ref, ids), check_unpack)):
            row = case(f"{name} bf16 {tokens} tokens", kernel, reference, check, repeats,
                       mbytes=round(nbytes / 1e6, 2), device_copy_kernel_us=copy_us)
            row |= {"triton_gb_s": gbps(row["triton_kernel_us"]), "reference_gb_s": gbps(row["reference_kernel_us"]),
                    "device_copy_gb_s": gbps(copy_us)}
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=100, help="calls timed back to back; ms of graph replays")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/triton_kernels.py needs a CUDA device")
    gen = torch.Generator().manual_seed(0)
    rows = store_cases(gen, args.repeats) + attention_cases(gen, args.repeats) + pack_cases(gen, args.repeats)
    print(json.dumps({
        "bench": "kernels",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "median_speedup": statistics.median(r["speedup"] for r in rows),
        "cases": rows,
    }))


if __name__ == "__main__":
    main()
