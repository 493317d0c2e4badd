"""The benchmark suites, smoke-sized: every bench file runs one tiny case
per provider, the JSON carries what the README promises, plot.py draws it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
FIELDS = ("op", "provider", "backend", "dtype", "shape", "device", "unit", "throughput",
          "ratio_to_torch", "torch", "jax", "jaxlib", "triton")


def test_bench_suites_smoke_json_and_plots(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, TORCH_PALLAS_BENCH_SMOKE="1")
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench/",
         "--benchmark-only", f"--benchmark-json={out}", "--benchmark-min-rounds=1",
         "--benchmark-max-time=0.001", "--benchmark-warmup=off"],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True,
    )
    benchmarks = json.loads(out.read_text())["benchmarks"]
    ops = {b["extra_info"]["op"] for b in benchmarks}
    assert ops == {"matmul", "matmul_gelu", "add", "fill", "iota"}
    for b in benchmarks:
        info = b["extra_info"]
        if b["group"].startswith("add-overhead"):
            assert "time_vs_jax" in info or info["provider"].startswith("jax")
            continue
        missing = [f for f in FIELDS if f not in info]
        assert not missing, (b["name"], missing)
        assert info["throughput"] > 0 and info["ratio_to_torch"] > 0
    plots = tmp_path / "plots"
    subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), str(out), "--out", str(plots)],
                   check=True, capture_output=True)
    assert sorted(p.name for p in plots.glob("*.png")) == [
        "add_float32.png", "fill_float32.png", "iota_int32.png", "matmul_float32.png",
        "matmul_gelu_float32.png",
    ]


def test_gpu_check_without_a_gpu_says_so():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a GPU machine
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 2
    assert "needs an NVIDIA GPU" in result.stderr
