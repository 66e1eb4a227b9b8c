"""Float32 weights that are block-quantized values, kept as their blocks for few-row products.

A checkpoint converted from a quantized GGUF holds, in float32, weights that were 4-bit or 8-bit
blocks of 32: the default model's projections were Q4_1 (w = d * q + m, q in [0, 15]) and its
tied embedding Q8_0 (w = d * q, q in [-127, 127]), with d and m fp16. `pack_exact` finds those
blocks again from the float32 tensor (in C, one pass) and keeps them only if every weight comes
back bit for bit; anything else (a bf16 or fp32 checkpoint) gives None and stays as it was.

Why: a decode step is a product of a few rows against every weight, and on a CPU short of memory
bandwidth it waits on the weights' bytes. Kept as blocks they are 0.75 bytes a weight (4-bit,
with d and m as float32) or 1.125 (8-bit) instead of 4, and `BlockWeight.matmul` dequantizes them
in registers (kernels/cpu_block_matmul.c). The product is float32 arithmetic on the same float32
weights, so the engine's numbers are float32's, in another summation order. Past `MAX_ROWS` rows
(prefill chunks) oneDNN's packed fp32 GEMM is at least as fast: cluster/models/linear.py keeps
both and picks by rows.

Measured on the 2-core AVX2 EPYC, one thread, blocks shaped like the default model's
(docs/performance.md has the table): its 210 projections at 1 row 17 ms against 67 in packed
fp32, 16 rows 58 against 102-120, 32 rows 127-132 against 136-180, 64 rows 193-208 against
228-236; its 8-bit head at 16 rows 16 against 23-27 ms, 64 rows 49-54 against 56-57. On the
2-core AVX-512 Xeon the kernel's AVX-512 branch (eight rows of 16 floats a tile) against its AVX2
branch there: the projections at 16 rows 41.7 against 67.2 ms, 32 rows 90.4 against 129.5; the
head at 16 rows 11.4 against 17.9.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_paged_attention import available, built

BLOCK = 32
# rows up to which a product goes through the blocks, by bits (above: oneDNN's fp32 GEMM)
MAX_ROWS = {4: 64, 8: 64}
# the same beside a bf16 copy of the weights (a CPU engine computing in bf16): past it oneDNN's
# bf16 GEMM is faster. Zen 4 with AVX512-BF16, one thread, the default model's 120 projections:
# 1 row 10.7 ms through the blocks against 21.3 in packed bf16, 2 rows 12.4 / 23.6, 4 rows
# 17.5 / 17.8, 8 rows 27.2 / 20.2; its head (8-bit blocks / bf16 and refined) 1 row 2.2 / 4.5 ms,
# 3 rows 3.1 / 3.8, 4 rows 4.0 / 4.0
MAX_ROWS_BESIDE_BF16 = 3
_MAX_K = 8192  # the kernel dequantizes three weight rows into a stack buffer of 3 * K floats


@dataclass(frozen=True)
class BlockWeight:
    """W [out, in] as blocks of 32 along `in`: `bits` 4 (qs uint8 [out, in / 2], two per byte,
    byte j of a block q[j] | q[j + 16] << 4; w = d * q + m) or 8 (qs int8 [out, in]; w = d * q);
    d and m float32 [out, in / 32] (m empty for 8 bits)."""

    bits: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.d.shape[0], self.d.shape[1] * BLOCK

    @property
    def max_rows(self) -> int:
        """The most rows a product should read the blocks for (MAX_ROWS)."""
        return MAX_ROWS[self.bits]

    def rows_beside(self, dtype: torch.dtype) -> int:
        """The most rows a product should read the blocks for beside a copy of the weights in
        `dtype` that oneDNN multiplies (float32: max_rows; bfloat16: MAX_ROWS_BESIDE_BF16)."""
        return self.max_rows if dtype == torch.float32 else min(self.max_rows, MAX_ROWS_BESIDE_BF16)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x float32 [T, in] → float32 [T, out] = x @ W.T."""
        out_features, in_features = self.shape
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != in_features:
            raise ValueError(f"x must be a float32 CPU tensor [T, {in_features}], got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        if x.shape[0]:
            built().tandem_block_matmul(self.bits, x.data_ptr(), x.shape[0], in_features, self.qs.data_ptr(),
                                        self.d.data_ptr(), self.m.data_ptr(), out_features, y.data_ptr())
        return y

    def dequantize(self) -> torch.Tensor:
        """The float32 weights [out, in], as the checkpoint holds them."""
        out_features, in_features = self.shape
        w = torch.empty(out_features, in_features, dtype=torch.float32)
        built().tandem_block_dequant(self.bits, self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr(),
                                     out_features, in_features, w.data_ptr())
        return w


def pack_exact(w: torch.Tensor) -> BlockWeight | None:
    """W float32 [out, in] → its 4-bit blocks, else its 8-bit blocks, when they give back every
    weight exactly; None when neither does, or W is not a float32 CPU matrix the kernel takes
    (in a multiple of 32 up to 8,192) or the kernels are not built here."""
    if (w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 or w.shape[1] % BLOCK
            or w.shape[1] > _MAX_K or not w.numel() or not available()):
        return None
    rows, cols = w.shape
    w = w.detach().contiguous()  # (an inf or NaN is refused in C)
    for bits in (4, 8):
        qs = torch.empty(rows, cols // 2 if bits == 4 else cols, dtype=torch.uint8 if bits == 4 else torch.int8)
        d = torch.empty(rows, cols // BLOCK)
        m = torch.empty(rows, cols // BLOCK) if bits == 4 else torch.empty(0)
        if built().tandem_block_find(bits, w.data_ptr(), rows, cols, qs.data_ptr(), d.data_ptr(), m.data_ptr()):
            return BlockWeight(bits, qs, d, m)
    return None
