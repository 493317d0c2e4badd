"""Benchmark plumbing: every result records its provider, backend, dtype,
shape, device and versions; after the run each gets its ratio to torch (and
to the bare JAX call) from the medians of the same run, in the JSON and in a
table printed at the end."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import providers  # noqa: E402


def record(benchmark, provider, *, op, dtype, shape, work: float, unit: str):
    """Fills `extra_info` after `benchmark(...)` ran: throughput from the
    median, in `unit` (GFLOP/s or GB/s) for `work` (FLOPs or bytes)."""
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        op=op,
        provider=provider.name,
        backend=provider.backend or "torch",
        dtype=str(dtype).removeprefix("torch."),
        shape=list(shape),
        device=providers.device_name(),
        unit=unit,
        throughput=work / median / 1e9,
        **providers.versions(),
    )


def _ratios(benchmarks) -> None:
    by_group = defaultdict(list)
    for b in benchmarks:
        by_group[b["group"]].append(b)
    for group in by_group.values():
        medians = {b["extra_info"].get("provider"): b["stats"]["median"] for b in group}
        for b in group:
            info = b["extra_info"]
            if "torch" in medians:
                info["ratio_to_torch"] = medians["torch"] / b["stats"]["median"]
            jax_twin = f"jax[{info.get('backend')}]"
            if info.get("provider", "").startswith("pallas[") and jax_twin in medians:
                info["time_vs_jax"] = b["stats"]["median"] / medians[jax_twin]


def pytest_benchmark_update_json(config, benchmarks, output_json):
    _ratios(output_json["benchmarks"])


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    rows = [b.as_dict(include_data=False) for b in session.benchmarks if b.has_error is False]
    rows = [r for r in rows if r.get("stats")]
    _ratios(rows)
    terminalreporter.section("median time, throughput, ratio to torch (same run)")
    for r in sorted(rows, key=lambda r: (r["group"] or "", r["extra_info"].get("provider", ""))):
        info = r["extra_info"]
        line = (f"{r['group']:<34} {info.get('provider', '?'):<28} "
                f"{r['stats']['median'] * 1e6:12.1f} us {info.get('throughput', 0):10.3f} "
                f"{info.get('unit', ''):<8}")
        if info.get("ratio_to_torch") is not None:
            line += f" {info['ratio_to_torch']:6.2f}x torch"
        if info.get("time_vs_jax") is not None:
            line += f"  time {info['time_vs_jax']:.2f}x jax's"
        terminalreporter.write_line(line)
