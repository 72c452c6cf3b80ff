"""``cluster bench throughput`` as a smoke test: it runs every system on a tiny model and
writes complete JSON with positive figures (timings are measurements, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys


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
