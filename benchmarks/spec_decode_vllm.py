"""vLLM's CPU build on ``benchmarks/spec_decode.py``'s workload: greedy, concurrency c, with and
without n-gram speculation. Run by path in the peer's interpreter (it imports only the standard
library and vLLM)::

    $PEER_VENV/bin/python benchmarks/spec_decode_vllm.py MODEL_DIR WORKLOAD.json RESULT.json

``WORKLOAD.json`` (written by ``spec_decode.py --vllm-python``): {"prompts": {c: [[ids]]},
"max_tokens": n, "max_model_len": m, "speculative_config": {...}}. Concurrency c runs the
prompts in waves of c (one ``generate`` per wave: offline vLLM has no closed loop);
``RESULT.json`` gets output tok/s and wall time per (c, off | ngram) and the outputs, or the
error vLLM raised for a condition it refuses.
"""

from __future__ import annotations

import json
import sys
import time


def run(model: str, prompts: list[list[int]], c: int, workload: dict, spec: dict | None) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_tokens = workload["max_tokens"]
    llm = LLM(model=model, dtype="float32", max_model_len=workload["max_model_len"],
              max_num_seqs=max(c, 1),
              enforce_eager=True, speculative_config=spec)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)
    outs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), c):
        wave = [TokensPrompt(prompt_token_ids=p) for p in prompts[i : i + c]]
        outs += llm.generate(wave, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(len(t) for t in tokens)
    del llm
    return {"wall_s": wall, "output_tokens": produced, "output_tokens_per_s": produced / wall,
            "tokens": tokens}  # fmt: skip


def main(model: str, workload_path: str, result_path: str) -> None:
    import vllm

    with open(workload_path, encoding="utf-8") as f:
        workload = json.load(f)
    result: dict = {"vllm": vllm.__version__, "rows": {}}
    for c, prompts in workload["prompts"].items():
        row = {}
        for name, spec in (("off", None), ("ngram", workload["speculative_config"])):
            try:
                row[name] = run(model, prompts, int(c), workload, spec)
            except Exception as exc:  # report why, e.g. a method the CPU build refuses
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
        result["rows"][c] = row
        with open(result_path, "w", encoding="utf-8") as f:
            json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(f"usage: {sys.argv[0]} MODEL_DIR WORKLOAD.json RESULT.json")
    main(sys.argv[1], sys.argv[2], sys.argv[3])
