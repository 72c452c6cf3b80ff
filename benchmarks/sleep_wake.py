"""Sleep mode against a cold start (``docs/sleep_mode.md``), on the bench checkpoint (a random
Llama written locally, as ``cluster bench`` writes it).

    python benchmarks/sleep_wake.py --model DIR [--dtype bfloat16] [--serve] [--json out.json]

- engine (one process): build the engine (weights, KV sizing and allocation: a lower bound on
  a replica's cold start), generate, then per level: sleep, the resident memory freed, the time
  to wake, and the same greedy tokens again.
- ``--serve`` (a local Ray and Serve): deploy the model twice under ``sleep_mode.max_awake_models:
  1`` (the second copy starts asleep, no engine), then per level put the first to sleep and wake
  it through the ingress (every replica, as ``cluster sleep`` / ``wake`` do), then wake the
  second (the first sleeps for it; its engine starts), then scale the first to two replicas and
  time the new replica's start: what waking replaces.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # not benchmarks/: its kernels.py would shadow the kernels package

from engine import LLM, SamplingParams  # noqa: E402

PROMPTS = [{"prompt_token_ids": [10 + (13 * i + j) % 900 for j in range(64)]} for i in range(8)]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def serve_report(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from cluster.ops.deploy import spare_port
    from cluster.serving.serve import INGRESS_NAME, build_app, runtime_env

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env=runtime_env() or None)  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": spare_port()})
    engine_kwargs: dict[str, Any] = {"device": "cpu", "dtype": args.dtype, "max_model_len": 1024}
    if args.num_kv_blocks is not None:
        engine_kwargs["num_kv_blocks"] = args.num_kv_blocks
    model = {"model_loading_config": {"model_id": "bench", "model_source": args.model},
             "engine_kwargs": engine_kwargs, "sleep_config": {},
             "deployment_config": {"num_replicas": 1}}  # fmt: skip
    asleep = {**model, "model_loading_config": {"model_id": "bench-asleep",
                                                "model_source": args.model}}  # fmt: skip
    config = {"models": [model, asleep], "app_name": "sleepbench",
              "sleep_mode": {"max_awake_models": 1}}  # fmt: skip
    report: dict[str, Any] = {}
    started = time.perf_counter()
    serve.run(build_app(config), name="sleepbench", route_prefix="/")
    report["deploy_s"] = round(time.perf_counter() - started, 2)
    ingress = serve.get_deployment_handle(INGRESS_NAME, "sleepbench")
    for level in (1, 2):
        started = time.perf_counter()
        state = ingress.sleep_model.remote("bench", level).result()
        sleep_s = time.perf_counter() - started
        started = time.perf_counter()
        woken = ingress.wake_model.remote("bench").result()
        report[f"level_{level}"] = {"sleep_s": round(sleep_s, 3),
                                    "wake_s": round(time.perf_counter() - started, 3),
                                    "slept": state["is_sleeping"],
                                    "woke": not woken["is_sleeping"]}  # fmt: skip
    time.sleep(2.5)  # past the awake set's grace for a model just used (awake_models.RECENT_S)
    started = time.perf_counter()
    woken = ingress.wake_model.remote("bench-asleep").result()
    report["started_asleep_first_wake_s"] = round(time.perf_counter() - started, 2)
    report["started_asleep_woke"] = not woken["is_sleeping"]
    model["deployment_config"] = {"num_replicas": 2}
    started = time.perf_counter()
    serve.run(build_app(config), name="sleepbench", route_prefix="/")
    report["new_replica_s"] = round(time.perf_counter() - started, 2)
    for level in (1, 2):
        report[f"level_{level}"]["new_replica_over_wake"] = round(
            report["new_replica_s"] / report[f"level_{level}"]["wake_s"], 1
        )
    serve.shutdown()
    ray.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--serve", action="store_true", help="also through Serve (local Ray)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kwargs: dict[str, Any] = {"dtype": args.dtype, "max_model_len": 1024}
    if args.num_kv_blocks is not None:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    start = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    cold_s = time.perf_counter() - start
    expected = tokens(llm)
    report: dict[str, Any] = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "model": args.model, "dtype": args.dtype, "engine_build_s": round(cold_s, 3),
        "levels": {},
    }  # fmt: skip
    for level in (1, 2):
        awake = rss_bytes()
        started = time.perf_counter()
        llm.sleep(level)
        sleep_s = time.perf_counter() - started
        freed = awake - rss_bytes()
        started = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - started
        same = tokens(llm) == expected
        report["levels"][level] = {
            "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3),
            "rss_freed_mib": round(freed / 2**20, 1), "tokens_equal": same,
            "cold_over_wake": round(cold_s / wake_s, 1),
        }  # fmt: skip
    del llm
    if args.serve:
        report["serve"] = serve_report(args)
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
