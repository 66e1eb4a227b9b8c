"""The OpenAI layer over real engines in one process (no Ray), shared by the OpenAI and gRPC
tests: a disaggregated server (TCP connector over loopback) and a colocated one."""

from __future__ import annotations

import pytest

SERVED_MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tiny_model_paths):
    from cluster.config import AppConfig
    from cluster.decode.server import DecodeServer
    from cluster.engine.tokenizer import Tokenizer
    from cluster.prefill.server import LocalPrefillClient, PrefillServer
    from cluster.router.openai_server import OpenAIServer

    path = str(tiny_model_paths["llama"])
    args = {"model": path, "engine": {"num_blocks": 64, "max_num_seqs": 8}, "kv_transfer": {"connector": "tcp"}}
    prefill = PrefillServer(AppConfig.from_args(args))
    decode = DecodeServer(AppConfig.from_args(args))
    colocated = DecodeServer(AppConfig.from_args({**args, "mode": "colocated"}))
    tok = Tokenizer(path)
    client = LocalPrefillClient(prefill)

    def server(dec, pre):
        return OpenAIServer(SERVED_MODEL, tok, 1024, lambda rid, ids, p: dec.generate(rid, ids, p, pre))

    yield {"disagg": server(decode, client), "colocated": server(colocated, None),
           "decode": decode, "prefill": prefill, "colocated_server": colocated}
    for s in (prefill, decode, colocated):
        s.close()
