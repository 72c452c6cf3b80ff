"""``cluster bench throughput`` as a smoke test: it runs every system on a tiny model and
writes complete JSON with positive figures (timings are measurements, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_throughput_writes_complete_json(tmp_path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "bench",
        "throughput",
        "--num-prompts",
        "6",
        "--input-len",
        "4:12",
        "--output-len",
        "3:8",
        "--hidden-size",
        "64",
        "--num-hidden-layers",
        "2",
        "--num-attention-heads",
        "4",
        "--num-key-value-heads",
        "2",
        "--intermediate-size",
        "128",
        "--vocab-size",
        "1024",
        "--hf-batch-size",
        "4",
        "--json",
        str(out),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"systems", "ratios", "roofline", "step_profile", "conditions"}
    assert set(report["systems"]) == {"engine", "hf_static", "hf_cb"}
    for figures in report["systems"].values():
        assert set(figures) == {
            "output_tokens_per_s",
            "total_tokens_per_s",
            "requests_per_s",
            "wall_s",
        }
        assert all(v > 0 for v in figures.values())
    assert set(report["ratios"]) == {"engine/hf_static", "engine/hf_cb"}
    assert report["roofline"]["gemm_flops_per_s"] > 0
    assert report["roofline"]["engine_fraction_of_gemm"] > 0
    assert report["step_profile"]["seconds"]["forward"] > 0
    assert report["conditions"]["workload"]["num_prompts"] == 6
    assert "ratio engine/hf_static" in result.stdout


def test_bench_serve_compare_writes_complete_json_and_plot(tmp_path) -> None:
    import yaml

    from tests.cluster.conftest import free_port

    config = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    config["http_options"]["port"] = free_port()
    config["grpc_options"]["port"] = free_port()
    config_path = tmp_path / "tiny.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    cmd = [
        sys.executable,
        "-m",
        "cluster.cli",
        "bench",
        "serve",
        "--compare",
        str(config_path),
        "--num-prompts",
        "6",
        "--input-len",
        "4:12",
        "--output-len",
        "3:8",
        "--request-rate",
        "20",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"in_process", "ray_serve"}
    for figures in report["results"].values():
        assert figures["completed"] == 6 and figures["failed"] == 0
        assert figures["output_token_throughput"] > 0
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(figures[metric]) == {"mean", "p50", "p90", "p99"}
            assert figures[metric]["p50"] > 0
    assert report["overhead"]["throughput_ratio_serve_vs_in_process"] > 0
    assert png.stat().st_size > 1000
