"""What the light entry points load, in a fresh interpreter each: the CLI and the Serve entry
points never load matplotlib (only `tandem bench` plots), the router's modules run no
`import torch` of ours (a router replica holds no engine), a router tokenizes and renders
chats for the default model without torch loaded at all, and building the app loads no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ROUTER_MODULES = sorted(f"cluster.router.{p.stem}" for p in (REPO / "cluster" / "router").glob("*.py")
                        if not p.stem.startswith("tandem_pb2"))
ENTRY_POINTS = ["cluster.cli", "cluster.serve_config", "cluster.router.app", "cluster.prefill.deployment",
                "cluster.decode.deployment", "cluster.llm"]

# Third-party packages that import torch themselves, and the modules of ours allowed to load
# them in a router: transformers is the router's tokenizer and chat template (torch-free for a
# folder naming the generic fast tokenizer, as the default model's does; AutoTokenizer, which
# loads torch, for any other class); xgrammar compiles grammars in the engine only (the router's structured-output
# checks are plain Python, cluster/structured_output.py).
TORCH_BRINGERS = {"transformers": {"cluster.engine.tokenizer"}, "xgrammar": set()}


PROBE = r"""
import builtins, json, sys
watched = ("torch", "matplotlib") + tuple(json.loads(sys.argv[2]))
callers = {name: set() for name in watched}
real_import = builtins.__import__

def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    top = name.split(".")[0] if not level else ""
    caller = (globals or {}).get("__name__", "")
    if top in callers and caller.startswith("cluster"):
        callers[top].add(caller)
    return real_import(name, globals, locals, fromlist, level)

builtins.__import__ = recording_import
import importlib
for module in sys.argv[1].split(","):
    importlib.import_module(module)
print(json.dumps({"callers": {k: sorted(v) for k, v in callers.items()},
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in watched)}))
"""


def load(modules: list[str]) -> dict:
    """Import `modules` in a fresh interpreter: which of our modules import torch, matplotlib or
    a TORCH_BRINGERS package, and which of those are loaded at the end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE, ",".join(modules), json.dumps(list(TORCH_BRINGERS))],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_the_entry_points_do_not_load_matplotlib():
    """All of them in one interpreter: none of our modules imports matplotlib, and nothing
    they import brings it in."""
    got = load(ENTRY_POINTS)
    assert not got["callers"]["matplotlib"], got["callers"]["matplotlib"]
    assert "matplotlib" not in got["loaded"]


def test_the_router_modules_import_no_torch_of_their_own():
    """No module the router loads says `import torch`; torch comes in only through the
    packages in TORCH_BRINGERS, each loaded only by the module of ours allowed to."""
    got = load(ROUTER_MODULES)
    assert got["callers"]["torch"] == [], f"router-side modules importing torch: {got['callers']['torch']}"
    for package, allowed in TORCH_BRINGERS.items():
        extra = set(got["callers"][package]) - allowed
        assert not extra, f"{package} (which imports torch) loaded by {sorted(extra)}"


ROUTER_TOKENIZES = r"""
import importlib, json, sys
for module in sys.argv[1].split(","):
    importlib.import_module(module)
from cluster.engine.tokenizer import Tokenizer
tok = Tokenizer(sys.argv[2])
messages = [{"role": "user", "content": "What is the capital of France?"}]
print(json.dumps({"chat": tok.encode_chat(messages), "text": tok.encode("Paris, then Lyon."),
                  "decoded": tok.decode(tok.encode_chat(messages)), "eos": sorted(tok.eos_token_ids),
                  "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_a_router_tokenizes_the_default_models_chats_without_torch_as_autotokenizer_does(default_model_path):
    """A router replica loads the default model's tokenizer and chat template without torch
    (~2 s of CPU and ~0.2 GB less per router replica), and encodes what AutoTokenizer encodes."""
    from transformers import AutoTokenizer

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", ROUTER_TOKENIZES, ",".join(ROUTER_MODULES), str(default_model_path)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["torch"] == []
    hf = AutoTokenizer.from_pretrained(str(default_model_path))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert got["chat"] == hf.encode(expected, add_special_tokens=False)
    assert got["text"] == hf.encode("Paris, then Lyon.") and hf.eos_token_id in got["eos"]
    assert got["decoded"] == hf.decode(got["chat"], skip_special_tokens=True) and "France" in got["decoded"]


BUILDS = r"""
import json, sys
from cluster.router.app import build_app
from cluster.serve_config import load_yaml
app = build_app(load_yaml(sys.argv[1])["applications"][0]["args"])
print(json.dumps({"built": type(app).__name__, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
"""


def test_building_the_app_loads_no_torch(default_model_path):
    """`serve deploy` builds the app in a fresh process each time (Serve's build task): with the
    pools' servers imported in their replicas' constructors, that build loads no torch (~2 s
    of each deploy's wait on this machine)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", BUILDS, str(REPO / "configs" / "serve.yaml")],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got == {"built": "Application", "torch": []}


ENGINE_STREAMS = r"""
import json, sys
import torch
from cluster import SamplingParams
from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
engine = LLMEngine(EngineConfig.from_kwargs(sys.argv[1], cpu_kv_cache_bytes=1 << 24))
engine.add_request("r", [1, 504, 3156, 314, 2683, 42], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
streamed, ids = "", []
while engine.has_unfinished_requests():
    for out in engine.step():
        streamed += out.outputs[0].delta_text
        ids = out.outputs[0].token_ids
print(json.dumps({"ids": list(ids), "text": streamed, "transformers": "transformers" in sys.modules}))
"""


def test_an_engine_streams_text_without_loading_transformers(tiny_model_paths):
    """A pool replica's engine turns ids into text with the tokenizers library alone (~1 s of
    CPU less per replica start on a slow host): the text it streams is the one transformers
    decodes."""
    from transformers import AutoTokenizer

    model = str(tiny_model_paths["llama"])  # the default model's tokenizer
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", ENGINE_STREAMS, model], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["transformers"] is False
    assert len(got["ids"]) == 24 and got["text"] == AutoTokenizer.from_pretrained(model).decode(
        got["ids"], skip_special_tokens=True)
