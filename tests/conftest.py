"""Test-wide setup. Must run before anything imports triton."""

from __future__ import annotations

import os
import shutil

# Without a GPU, run Triton kernels through the interpreter on CPU tensors.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
