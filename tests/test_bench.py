"""The benchmark suites, smoke-sized: every bench file runs one tiny case
per provider, the JSON carries what the README promises (the conditions of
the run included), the suite warns about conditions that mislead, plot.py
draws it all."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from torch_pallas.runtime import backends

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("omp_wait_policy", "torch_threads", "xla_flags", "cpu_count", "usable_cores",
              "load_average_1min_at_start")
FIELDS = ("op", "provider", "backend", "dtype", "shape", "device", "unit", "throughput",
          "ratio_to_torch", "torch", "jax", "jaxlib", "triton", *CONDITIONS)


def test_bench_suites_smoke_json_and_plots(tmp_path):
    out = tmp_path / "bench.json"
    # pytest-benchmark does not time under xdist, which the project's addopts
    # turn on, nor in a process that looks like an xdist worker (as this
    # test's may be).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["TORCH_PALLAS_BENCH_SMOKE"] = "1"
    env.pop("OMP_WAIT_POLICY", None)  # unset: the suite must say so on CPU
    no_xdist = ["-n", "0"] if importlib.util.find_spec("xdist") else []
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *no_xdist, "bench/",
         "--benchmark-only", f"--benchmark-json={out}", "--benchmark-min-rounds=1",
         "--benchmark-max-time=0.001", "--benchmark-warmup=off"],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = run.stdout.split("median time, throughput, ratio to torch")[-1]
    assert summary.count("conditions: OMP_WAIT_POLICY=unset") == 1
    if backends.default_device().type == "cpu":
        assert "BenchmarkConditionsWarning: OMP_WAIT_POLICY is unset" in run.stdout
        assert "WARNING: OMP_WAIT_POLICY is unset, not PASSIVE" in summary
    benchmarks = json.loads(out.read_text())["benchmarks"]
    ops = {b["extra_info"]["op"] for b in benchmarks}
    for suite in sorted((ROOT / "bench").glob("bench_*.py")):  # every suite ran and recorded
        name = suite.stem.removeprefix("bench_")
        prefix = "llama_" if name == "models" else name
        assert any(op.startswith(prefix) for op in ops), (suite.name, sorted(ops))
    assert {"matmul_gelu", "attention_fwd_bwd", "llama_train_step", "llama_lengths_first_process",
            "llama_generate"} <= ops
    for b in benchmarks:
        info = b["extra_info"]
        if b["group"].startswith("add-overhead"):
            assert "time_vs_jax" in info or info["provider"].startswith("jax")
            continue
        missing = [f for f in FIELDS if f not in info]
        assert not missing, (b["name"], missing)
        assert info["throughput"] > 0 and info["ratio_to_torch"] > 0
        assert info["omp_wait_policy"] == "unset"
        assert info["xla_flags"] == env.get("XLA_FLAGS", "unset")
        assert info["torch_threads"] >= 1
        assert 1 <= info["usable_cores"] <= info["cpu_count"] == os.cpu_count()
        assert info["load_average_1min_at_start"] >= 0
        if info["op"].startswith("llama") and info["provider"] != "torch":  # timed against torch
            partner = info["torch_rounds_interleaved"]
            assert len(partner) == len(b["stats"]["data"]) >= 1
            paired = sorted(t / c for t, c in zip(partner, b["stats"]["data"]))
            assert paired[0] <= info["ratio_to_torch_paired"] <= paired[-1]
    plots = tmp_path / "plots"
    subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), str(out), "--out", str(plots)],
                   check=True, capture_output=True)
    # a chart per op and dtype the suites measured
    charts = {f"{b['extra_info']['op']}_{b['extra_info']['dtype']}.png" for b in benchmarks}
    assert sorted(p.name for p in plots.glob("*.png")) == sorted(charts)
    assert {"add_float32.png", "matmul_float32.png", "llama_train_step_bfloat16.png"} <= charts


def load_plot_module():
    spec = importlib.util.spec_from_file_location("plot", ROOT / "bench" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plots_label_sizes_in_human_units_and_keep_providers_apart():
    plot = load_plot_module()
    assert plot.size_label("add", [2**20], "float32") == "$2^{20}$ (4 MiB)"
    assert plot.size_label("fill", [1000], "float32") == "1,000 (3.91 KiB)"
    assert plot.size_label("iota", [2**24], "int32") == "$2^{24}$ (64 MiB)"
    assert plot.size_label("matmul", [1024, 1024, 1024], "float32") == "1024³"
    assert plot.size_label("matmul_gelu", [16, 4096, 14336], "bfloat16") == "16x4096x14336"
    names = ["torch", "pallas[interpret]", "jax[interpret]", "pallas[tpu_interpret]", "triton"]
    styles = plot.provider_styles(names)
    looks = {(s["color"], s["linestyle"], s["marker"], s["markerfacecolor"]) for s in styles.values()}
    assert len(looks) == len(names)
    assert len({s["marker"] for s in styles.values()}) == len(names)
    jax_style, pallas_style = styles["jax[interpret]"], styles["pallas[interpret]"]
    assert jax_style["color"] == pallas_style["color"]  # one backend: one colour
    assert jax_style["linestyle"] != pallas_style["linestyle"]
    assert jax_style["markerfacecolor"] == "none" and pallas_style["alpha"] < 1


def test_gpu_check_without_a_gpu_says_so():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even on a GPU machine
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")],
                            capture_output=True, text=True, env=env)
    assert result.returncode == 2
    assert "needs an NVIDIA GPU" in result.stderr
