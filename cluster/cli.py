"""`tandem` command line: chat, convert-model, up, down, bench."""

from __future__ import annotations

import argparse
import sys

from cluster.bench_cli import add_parser as add_bench_parser
from cluster.models.default_model import CACHE_ENV


def _chat(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams
    from cluster.structured_output import StructuredOutput

    structured = None  # a spec that is refused: a ValueError, before the model loads
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            structured = StructuredOutput("json_schema", f.read())
    elif args.grammar:
        with open(args.grammar, encoding="utf-8") as f:
            structured = StructuredOutput("grammar", f.read())
    elif args.json or args.regex is not None:
        structured = StructuredOutput("json_object") if args.json else StructuredOutput("regex", args.regex)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                            structured=structured)
    llm = LLM(args.model, cache_dir=args.cache_dir, max_model_len=args.max_model_len)
    prompt = llm.engine.tokenizer.encode_chat([{"role": "user", "content": args.question}])
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from cluster.models.default_model import convert_gguf, default_model_path, ensure_default_model, gguf_path

    if args.force:
        path = convert_gguf(gguf_path(), default_model_path(args.cache_dir))
    else:
        path = ensure_default_model(args.cache_dir)
    print(path)
    return 0


def _up(args: argparse.Namespace) -> int:
    """Start (or reuse) a local Ray head, deploy a Serve YAML, wait for /health, show how to call it."""
    import json
    import subprocess
    import time
    import urllib.request

    from cluster.models.default_model import ensure_default_model
    from cluster.serve_config import load_yaml, validate_serve_config

    config = load_yaml(args.config)
    apps = validate_serve_config(config)  # fail here, with the key named, not in a replica
    if any(a.engine.model.model is None for a in apps):
        ensure_default_model(args.cache_dir)  # convert once, before replicas race for it
    bindir = sys.executable.rsplit("/", 1)[0]
    env = _ray_env()
    subprocess.run([f"{bindir}/ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    if subprocess.run([f"{bindir}/ray", "status"], env=env, capture_output=True).returncode != 0:
        subprocess.run([f"{bindir}/ray", "start", "--head", "--dashboard-host=127.0.0.1",
                        "--disable-usage-stats"], env=env, check=True)
    subprocess.run([f"{bindir}/serve", "deploy", args.config], env=env, check=True)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                model = json.load(r)["data"][0]["id"]
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                break
        except Exception:
            if time.monotonic() > deadline:
                print(f"tandem: error: {url}/health did not answer within {args.timeout}s; see `serve status`",
                      file=sys.stderr)
                return 1
            time.sleep(2)
    print(f"""Tandem is serving {model} at {url}

  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi!'}}]).choices[0].message.content)"

Stop with `make stop`.""")
    grpc_port = (config.get("grpc_options") or {}).get("port")
    if grpc_port:
        print(f"""
gRPC (tandem.v1.Tandem/Generate, cluster/router/tandem.proto) on port {grpc_port}:

  python -c "import grpc; from cluster.router import tandem_pb2 as pb, tandem_pb2_grpc as rpc; \\
stub = rpc.TandemStub(grpc.insecure_channel('127.0.0.1:{grpc_port}')); \\
[print(m.text, end='', flush=True) for m in stub.Generate(pb.GenerateRequest(model='{model}', \\
chat=pb.Chat(messages=[pb.ChatMessage(role='user', content='Hi!')])))]; print()\"""")
    return 0


def _down(args: argparse.Namespace) -> int:
    import subprocess

    bindir = sys.executable.rsplit("/", 1)[0]
    env = _ray_env()
    subprocess.run([f"{bindir}/serve", "shutdown", "-y"], env=env, check=False)
    subprocess.run([f"{bindir}/ray", "stop"], env=env, check=False)
    return 0


def _ray_env() -> dict[str, str]:
    """Ray with token authentication (the token lives in ~/.ray/auth_token), and a bound on gRPC
    messages."""
    import os

    # Serve's gRPC proxy takes messages up to 2 GiB unless told otherwise (the router refuses
    # anything over max_request_bytes, but only after the proxy has read it): gRPC's own 4 MiB
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token"),
            "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": os.environ.get("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(4 << 20))}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    cache_help = f"where the default model is converted (default ${CACHE_ENV} or ~/.cache/tandem)"

    chat = sub.add_parser("chat", help="answer one question offline, streaming to the terminal")
    chat.add_argument("question")
    chat.add_argument("--model", default=None, help="local HF folder (default: SmolLM2-135M-Instruct)")
    chat.add_argument("--cache-dir", default=None, help=cache_help)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--max-model-len", type=int, default=None)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    shape = chat.add_mutually_exclusive_group()
    shape.add_argument("--json", action="store_true", help="JSON mode: the answer is one JSON object")
    shape.add_argument("--json-schema", metavar="FILE", default=None,
                       help="structured output: the answer is one value of the JSON Schema in FILE")
    shape.add_argument("--regex", metavar="PATTERN", default=None,
                       help="structured output: the whole answer matches PATTERN")
    shape.add_argument("--grammar", metavar="FILE", default=None,
                       help="structured output: the answer is a sentence of the EBNF grammar in FILE (start rule: root)")
    chat.set_defaults(func=_chat)

    convert = sub.add_parser("convert-model", help="convert the default model into an HF folder (once)")
    convert.add_argument("--cache-dir", default=None, help=cache_help)
    convert.add_argument("--force", action="store_true", help="convert again even if cached")
    convert.set_defaults(func=_convert)

    up = sub.add_parser("up", help="start a local Ray head (if none), deploy a Serve config, wait for it")
    up.add_argument("--config", default="configs/serve.yaml")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--timeout", type=float, default=600)
    up.add_argument("--cache-dir", default=None, help=cache_help)
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="shut the Serve apps down and stop the local Ray")
    down.set_defaults(func=_down)

    add_bench_parser(sub)  # cluster/bench_cli.py
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
