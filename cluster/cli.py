"""`tandem` command line: chat, convert-model."""

from __future__ import annotations

import argparse
import sys

from cluster.models.default_model import CACHE_ENV


def _chat(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams

    llm = LLM(args.model, cache_dir=args.cache_dir, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
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
    chat.set_defaults(func=_chat)

    convert = sub.add_parser("convert-model", help="convert the default model into an HF folder (once)")
    convert.add_argument("--cache-dir", default=None, help=cache_help)
    convert.add_argument("--force", action="store_true", help="convert again even if cached")
    convert.set_defaults(func=_convert)
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
