"""Image prefill: one image per request, this engine against vLLM's CPU build, offline, on the
same random-weight LLaVA checkpoint (written here: a CLIP ViT-B/16-sized tower on 224x224
images, 196 image tokens, and the bench Llama's shape as the language model).

    python benchmarks/image_prefill.py --write DIR                       # the checkpoint, once
    .venv/bin/python benchmarks/image_prefill.py --model DIR --system engine
    $PEER_VENV/bin/python benchmarks/image_prefill.py --model DIR --system vllm

Each system: TTFT of one request with one image (``max_tokens=1``, the median of 5 after a
warm-up), then ``--requests`` requests of one image each at once (different images): images and
prompt tokens per second of prefill. Prints JSON; run the two one after the other on a quiet
machine and compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not benchmarks/: its kernels.py would shadow the kernels package

PROMPT = "USER: <image>\nDescribe the picture in detail. ASSISTANT:"


def write_checkpoint(out: Path) -> None:
    from engine.builtin.tiny_vlm_models import make_tiny_llava

    vision = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
              "num_attention_heads": 12, "image_size": 224, "patch_size": 16,
              "projection_dim": 512}  # fmt: skip
    text = {"hidden_size": 768, "intermediate_size": 1536, "num_hidden_layers": 12,
            "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
            "max_position_embeddings": 4096}  # fmt: skip
    make_tiny_llava(out, seed=0, vision_overrides=vision, text_overrides=text)
    print(f"wrote {out}")


def images(n: int) -> list[Any]:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((224, 224, 3)) * 255).astype(np.uint8)) for _ in range(n)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {"dtype": args.dtype, "max_model_len": 1024}
    if args.system == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from engine import LLM, SamplingParams
    started = time.perf_counter()
    llm = LLM(str(args.model), **kwargs)
    build_s = time.perf_counter() - started
    params = SamplingParams(temperature=0, max_tokens=1)
    pictures = images(args.requests + 6)

    def prefill(batch: list[Any]) -> tuple[float, int]:
        prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in batch]
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - started, sum(len(o.prompt_token_ids) for o in outputs)

    prefill(pictures[:1])  # warm-up
    ttft = statistics.median(prefill([p])[0] for p in pictures[1:6])
    seconds, tokens = prefill(pictures[6:])
    return {
        "system": args.system, "model": str(args.model), "dtype": args.dtype,
        "build_s": round(build_s, 2), "ttft_one_image_s": round(ttft, 4),
        "requests": args.requests, "batch_s": round(seconds, 3),
        "images_per_s": round(args.requests / seconds, 2),
        "prompt_tokens_per_s": round(tokens / seconds, 1),
        "prompt_tokens_per_request": tokens // args.requests,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="write the checkpoint here and exit")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--system", choices=("engine", "vllm"), default="engine")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=16)
    args = parser.parse_args()
    if args.write is not None:
        write_checkpoint(args.write)
        return
    if args.model is None:
        parser.error("--model is required (or --write DIR)")
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
