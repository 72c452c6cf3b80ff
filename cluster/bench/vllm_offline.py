"""vLLM's offline ``LLM.generate`` on a workload file: the peer system of ``cluster bench
throughput --systems vllm``.

Run by path in the interpreter that has vLLM (its own venv: ``--vllm-python``), so it imports
nothing from this project, only the standard library and vLLM::

    PYTHON cluster/bench/vllm_offline.py WORKLOAD.json RESULT.json

``WORKLOAD.json`` holds the model directory, dtype, engine limits, the prompts' token ids and
each request's output length. Like the engine's run: a 2-request warm-up that is not timed,
then every request at once, temperature 1.0, ``ignore_eos``, the text detokenized (vLLM's
default). ``RESULT.json`` gets ``wall_s``, ``output_tokens``, ``kv_cache_tokens`` (its cache's
capacity) and ``vllm`` (its version); a file, since vLLM's own logging shares stdout.
"""

from __future__ import annotations

import json
import sys
import time


def main(path: str, result_path: str) -> None:
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        seed=spec["seed"],
        enforce_eager=spec.get("enforce_eager", False),
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n)
        for n in spec["output_lens"]
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    with open(result_path, "w", encoding="utf-8") as f:
        cache = llm.llm_engine.vllm_config.cache_config
        result = {
            "wall_s": wall,
            "output_tokens": produced,
            "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
            "vllm": vllm.__version__,
        }
        json.dump(result, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} WORKLOAD.json RESULT.json")
    main(sys.argv[1], sys.argv[2])
