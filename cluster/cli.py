"""The ``cluster`` command line.

cluster make-model tiny-llama DIR     write a built-in tiny model (HF format) to DIR
cluster generate --model M PROMPT...  offline generation with the engine
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _make_model(args: argparse.Namespace) -> int:
    from engine.tiny_models import make_tiny_model

    path = make_tiny_model(args.name, args.out_dir, seed=args.seed)
    print(f"wrote {args.name} to {path}")
    return 0


def _parse_engine_args(pairs: Sequence[str]) -> dict[str, object]:
    """``--engine-arg key=value``: value parsed as JSON when it is JSON, else kept as a string."""
    engine_args: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg: expected key=value, got {pair!r}")
        try:
            engine_args[key] = json.loads(value)
        except json.JSONDecodeError:
            engine_args[key] = value
    return engine_args


def _generate(args: argparse.Namespace) -> int:
    from engine import LLM, ConfigError, InvalidRequestError, SamplingParams

    try:
        llm = LLM(args.model, **_parse_engine_args(args.engine_arg))
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ConfigError, InvalidRequestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, output in zip(args.prompts, outputs, strict=True):
        completion = output.outputs[0]
        print(
            f"prompt: {prompt!r}\ncompletion: {completion.text!r}  "
            f"({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cluster", description="llm-cluster: LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    make = sub.add_parser(
        "make-model", help="write a built-in tiny random-weight model in HF format"
    )
    make.add_argument("name", help="tiny-llama | tiny-mistral | tiny-qwen2")
    make.add_argument("out_dir")
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(func=_make_model)

    gen = sub.add_parser("generate", help="offline generation on this machine")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", default="builtin:tiny-llama", help="HF directory or builtin:<name>")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine argument with vLLM's name, e.g. max_model_len=1024 (repeatable)",
    )
    gen.set_defaults(func=_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
