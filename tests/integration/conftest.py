"""The OpenAI layer over real engines in one process (no Ray), shared by the OpenAI and gRPC
tests: a disaggregated server (TCP connector over loopback) and a colocated one."""

from __future__ import annotations

import pytest

from openai_helpers import serving_stack


@pytest.fixture(scope="module")
def stack(tiny_model_paths):
    with serving_stack(str(tiny_model_paths["llama"]), {"num_blocks": 64, "max_num_seqs": 8}) as s:
        yield s
