"""One projection, `y = x @ W + b`, with W held the way the device multiplies it fastest.

  CPU, float32, oneDNN present: W prepacked into oneDNN's blocked layout once, at load
      (`torch.ops.mkldnn._reorder_linear_weight`), applied with `_linear_pointwise`. On a
      2-core AVX2 box, one thread, 30 distinct 576x3072 weights (so none stays in cache):
      16 rows 0.42 ms vs 1.14 ms for `x @ W`; 1 row 0.22 ms vs 0.30 ms.
  CPU, bfloat16 W, oneDNN with native bf16 (AVX512-BF16 or AMX): packed the same way. The
      activations stay what they are (float32 on CPU): x goes in as bf16 and the product comes
      back in x's dtype, oneDNN accumulating in fp32. On a 2-core EPYC with AVX512-BF16, one
      thread, 30 distinct 1536x576 weights: 512 rows 1.87 ms vs 3.64 ms packed fp32, 16 rows
      0.11 vs 0.20 ms, 1 row 0.057 vs 0.097 ms.
  Anything else (GPU, no oneDNN): W kept [in, out] contiguous for `x @ W`.
  CPU, float32 W that is 4- or 8-bit blocks exactly (a checkpoint converted from a quantized
      GGUF, such as the default model): the blocks are kept too, and products of up to
      `block_weights.MAX_ROWS` rows (decode steps) read them instead, 0.75 or 1.125 bytes a
      weight instead of 4, in float32 arithmetic (kernels/block_weights.py). Beside a bf16 W
      (a CPU engine in bf16) they serve products of up to `MAX_ROWS_BESIDE_BF16` rows, where
      oneDNN's bf16 kernel for few rows is half their speed: one stream's decode steps.

The packed weight is opaque: code that needs W itself (a tied embedding) keeps its own copy.
"""

from __future__ import annotations

import torch

from kernels.block_weights import BlockWeight


def _cpu_identity() -> tuple[list[str], str]:
    """(/proc/cpuinfo's flags, its vendor_id); empty where there is no such file."""
    flags, vendor = [], ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags" and not flags:
                    flags = value.split()
                elif key.strip() == "vendor_id" and not vendor:
                    vendor = value.strip()
                if flags and vendor:
                    break
    except OSError:
        pass
    return flags, vendor


def _native_bf16() -> bool:
    """The CPU multiplies bf16 itself (x86: AVX512-BF16 or AMX; torch's own check also admits
    plain AVX-512, where oneDNN emulates it)."""
    flags, _ = _cpu_identity()
    if "avx512f" in flags or "avx2" in flags:  # x86 Linux: ask the CPU
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_beats_fp32() -> bool:
    """Whether a CPU engine computes faster in bf16 than in float32 here, so `dtype: auto` picks
    it: on AMX tiles (Intel Xeon from Sapphire Rapids), or with AVX512-BF16 on AMD (a Zen 5, one
    thread, 512 rows through 30 packed 1536x576 weights: 1.87 ms in bf16 against 3.64 in fp32).
    Not with AVX512-BF16 alone on an Intel core (Cooper Lake, or a Xeon whose VM hides AMX): the
    same product took 11.4 ms against 7.0 in fp32 on such a Xeon, oneDNN on its native bf16
    kernel, and the engine prefilled at 0.71x fp32's rate; its decode steps read the default
    model's 4-bit blocks in fp32, faster than bf16 at one stream (docs/performance.md). bf16
    still runs there when asked for (`onednn_packing`)."""
    flags, vendor = _cpu_identity()
    return "amx_bf16" in flags or ("avx512_bf16" in flags and vendor == "AuthenticAMD")


def _onednn_packing_works(dtype: torch.dtype) -> bool:
    try:
        if dtype == torch.bfloat16 and not _native_bf16():
            return False  # oneDNN would emulate it, or fall back to slower code than fp32's
        w = torch.randn(8, 4).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        x = torch.randn(3, 4).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        return bool(torch.allclose(y.float(), x.float() @ w.float().t(), atol=tol, rtol=tol))
    except Exception:  # a torch built without oneDNN, or the private op changed
        return False


_PACKING: dict[torch.dtype, bool] = {}


def onednn_packing(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN packs and multiplies `dtype` weights here (float32; bfloat16 where the CPU
    computes it natively)."""
    if dtype not in _PACKING:
        _PACKING[dtype] = torch.backends.mkldnn.is_available() and _onednn_packing_works(dtype)
    return _PACKING[dtype]


class Linear:
    def __init__(self, weight_out_in: torch.Tensor, bias: torch.Tensor | None = None, *,
                 pack: bool | None = None, shared: bool = False, blocks: BlockWeight | None = None) -> None:
        """`weight_out_in`: [out, in], as HF checkpoints store it. `pack`: None = when it helps.
        `shared`: the tensor is also used elsewhere (a tied embedding): unpacked, multiply by a
        transposed view of it instead of a copy. `blocks`: float32 weights as blocks
        (block_weights.pack_exact), for products of few rows: W's, or those W is the bf16
        rounding of (a CPU engine in bf16)."""
        w = weight_out_in
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.dtype = w.dtype  # what the product is computed in; x of another dtype is cast to it
        self.bias = bias
        if blocks is not None and (blocks.shape != tuple(w.shape) or w.dtype not in (torch.float32, torch.bfloat16)):
            raise ValueError(f"blocks {blocks.shape} do not hold this weight {tuple(w.shape)} {w.dtype}")
        self.blocks = blocks
        self.block_rows = 0 if blocks is None else blocks.rows_beside(w.dtype)  # products of up to
        #                                                                         this many rows read them
        if pack is None:
            pack = w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) and onednn_packing(w.dtype)
        self.packed = pack
        if pack:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        else:
            self.weight = w.t() if shared else w.t().contiguous()

    def reads_blocks(self, rows: int) -> bool:
        """Whether a product of `rows` rows goes through the blocks (float32 arithmetic, float32 weights)."""
        return self.blocks is not None and rows <= self.block_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → [T, out], in x's dtype."""
        if self.reads_blocks(x.shape[0]):
            y = self.blocks.matmul(x if x.dtype == torch.float32 else x.float())
            y = y if self.bias is None else y.add_(self.bias)
            return y if x.dtype == torch.float32 else y.to(x.dtype)
        if x.dtype != self.dtype:  # bf16 weights beside float32 activations (a CPU engine's bfloat16)
            return self(x.to(self.dtype)).to(x.dtype)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → float32 [T, out]. For half-precision x on CUDA the product leaves the
        fp32 accumulators unrounded (`torch.mm(..., out_dtype=float32)`): rounded to bf16, logits
        near 25 move in steps of 0.125, and the default model's first answer token to "What is
        the capital of France?" beats the runner-up by 0.08 in fp32."""
        if x.dtype == torch.float32 or self.packed or self.bias is not None or x.device.type != "cuda":
            return self(x).float()
        return torch.mm(x, self.weight, out_dtype=torch.float32)


class RefinedHead:
    """An LM head for bf16 projections on CPU: the product in bf16 (half the bytes of the largest
    weight a decode step reads), then each row's `refine` leading logits recomputed from the
    float32 weights. oneDNN's bf16 product comes out rounded to bf16 (steps of 0.125 near 25),
    which ties a first choice with its runner-up; recomputed, the argmax and the leading logprobs
    are float32's, and only the tail keeps bf16's rounding. On the 2-core AVX-512 host, 16 rows
    of the default model's head: 3.7 ms + 0.7 ms to refine, against 7.0 ms in packed fp32. With
    `blocks` of the float32 weights, a product of few rows reads those instead (Linear), its
    logits float32's throughout."""

    def __init__(self, weight_out_in: torch.Tensor, refine: int = 16, blocks: BlockWeight | None = None) -> None:
        """`weight_out_in`: float32 [V, H], kept as is (a tied embedding's table: shared)."""
        self.exact = weight_out_in
        self.fast = Linear(weight_out_in.to(torch.bfloat16), blocks=blocks)
        self.refine = min(refine, weight_out_in.shape[0])
        self.in_features, self.out_features = self.fast.in_features, self.fast.out_features

    def float_out(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [S, H] → float32 logits [S, V]."""
        logits = self.fast(x)
        if self.fast.reads_blocks(x.shape[0]):  # float32's already
            return logits
        top = leading(logits, self.refine)  # [S, k]
        return logits.scatter_(1, top, torch.einsum("sh,skh->sk", x, self.exact[top]))


def leading(logits: torch.Tensor, k: int, block: int = 256) -> torch.Tensor:
    """The indices of each row's k largest logits (ties in any order), as `topk(k).indices`: the
    k blocks of `block` whose maxima lead hold them all, so topk runs over k * block candidates.
    One pass of block maxima, then two small topk: 49,152 logits, k 16, one thread, 5 rows: 62
    against 181 us for topk over the whole row."""
    rows, vocab = logits.shape
    if vocab <= k * block:
        return logits.topk(k, dim=-1).indices
    pad = -vocab % block
    x = logits if not pad else torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    blocks = x.view(rows, -1, block).amax(-1).topk(k, dim=-1).indices  # [S, k]
    candidates = (blocks[:, :, None] * block + torch.arange(block, device=x.device)).view(rows, -1)
    return candidates.gather(1, x.gather(1, candidates).topk(k, dim=-1).indices)
