"""One projection, `y = x @ W + b`, with W held the way the device multiplies it fastest.

  CPU, float32, oneDNN present: W prepacked into oneDNN's blocked layout once, at load
      (`torch.ops.mkldnn._reorder_linear_weight`), applied with `_linear_pointwise`. On this
      2-core AVX2 box, one thread, 30 distinct 576x3072 weights (so none stays in cache):
      16 rows 0.42 ms vs 1.14 ms for `x @ W`; 1 row 0.22 ms vs 0.30 ms.
  Anything else (GPU, half precision, no oneDNN): W kept [in, out] contiguous for `x @ W`.

The packed weight is opaque: code that needs W itself (a tied embedding) keeps its own copy.
"""

from __future__ import annotations

import torch


def _onednn_packing_works() -> bool:
    try:
        w = torch.randn(8, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        x = torch.randn(3, 4)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, x @ w.t(), atol=1e-5))
    except Exception:  # a torch built without oneDNN, or the private op changed
        return False


_PACKING: bool | None = None


def onednn_packing() -> bool:
    global _PACKING
    if _PACKING is None:
        _PACKING = torch.backends.mkldnn.is_available() and _onednn_packing_works()
    return _PACKING


class Linear:
    def __init__(self, weight_out_in: torch.Tensor, bias: torch.Tensor | None = None, *,
                 pack: bool | None = None, shared: bool = False) -> None:
        """`weight_out_in`: [out, in], as HF checkpoints store it. `pack`: None = when it helps.
        `shared`: the tensor is also used elsewhere (a tied embedding): unpacked, multiply by a
        transposed view of it instead of a copy."""
        w = weight_out_in
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.bias = bias
        if pack is None:
            pack = w.device.type == "cpu" and w.dtype == torch.float32 and onednn_packing()
        self.packed = pack
        if pack:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        else:
            self.weight = w.t() if shared else w.t().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → [T, out]."""
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
