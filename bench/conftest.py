"""Benchmark plumbing: every result records its provider, backend, dtype,
shape, device and versions, and the conditions it ran under (see
`Conditions`); after the run each gets its ratio to torch (and to the bare
JAX call) from the medians of the same run, in the JSON and in a table
printed at the end. The suite warns when the conditions make its timings
misleading: a machine already busy when it started, or, on CPU, torch's
OpenMP workers left spinning (`OMP_WAIT_POLICY` not `PASSIVE`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

# Read before anything here runs (importing torch and JAX included): the
# load the suite found, not its own.
LOAD_AT_START = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

sys.path.insert(0, str(Path(__file__).parent))

import providers  # noqa: E402
import torch  # noqa: E402

# Busy: a 1-minute load average above half a runnable process per usable
# core, i.e. other work held half the cores on average over the last
# minute. A timing then measures a share of the machine.
BUSY_LOAD_PER_CORE = 0.5


class BenchmarkConditionsWarning(UserWarning):
    """The machine or the environment can make this run's timings mislead."""


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share,
    which os.cpu_count() does not see)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class Conditions:
    """What the timings depend on besides the code, recorded in every
    result's `extra_info` under these names."""

    omp_wait_policy: str  # "unset" if so; OpenMP reads it once, when torch loads
    torch_threads: int  # torch.get_num_threads(): torch's intra-op threads
    xla_flags: str  # XLA_FLAGS ("unset" if so): XLA's thread settings, if any
    cpu_count: int  # os.cpu_count()
    # The cores this process may run on: without flags, XLA's CPU client
    # sizes its thread pools by them.
    usable_cores: int
    load_average_1min_at_start: float | None  # None where the OS keeps none

    @classmethod
    def now(cls) -> Conditions:
        return cls(
            omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"),
            torch_threads=torch.get_num_threads(),
            xla_flags=os.environ.get("XLA_FLAGS", "unset"),
            cpu_count=os.cpu_count() or 1,
            usable_cores=usable_cores(),
            load_average_1min_at_start=LOAD_AT_START,
        )

    def problems(self) -> list[str]:
        """Why this run's timings may mislead (empty: no known reason)."""
        found = []
        load = self.load_average_1min_at_start
        if load is not None and load > BUSY_LOAD_PER_CORE * self.usable_cores:
            found.append(
                f"the machine was busy when the benchmarks started: 1-minute load "
                f"average {load:.2f} on {self.usable_cores} cores (above "
                f"{BUSY_LOAD_PER_CORE} per core); other work shares the cores being timed"
            )
        if providers.DEVICE.type == "cpu" and self.omp_wait_policy.upper() != "PASSIVE":
            found.append(
                f"OMP_WAIT_POLICY is {self.omp_wait_policy}, not PASSIVE: torch's OpenMP "
                "workers spin after each parallel torch op and take cores from the JAX "
                "kernels timed next; set OMP_WAIT_POLICY=PASSIVE before Python starts"
            )
        return found

    def summary(self) -> str:
        load = self.load_average_1min_at_start
        return (f"OMP_WAIT_POLICY={self.omp_wait_policy}, torch threads {self.torch_threads}, "
                f"XLA_FLAGS={self.xla_flags}, {self.cpu_count} CPUs "
                f"({self.usable_cores} usable), 1-minute load average at start "
                f"{'unknown' if load is None else f'{load:.2f}'}")


CONDITIONS = Conditions.now()


def pytest_configure(config):
    for problem in CONDITIONS.problems():
        config.issue_config_time_warning(BenchmarkConditionsWarning(problem), stacklevel=2)


def pytest_report_header(config):
    return [f"benchmark conditions: {CONDITIONS.summary()}"] + [
        f"WARNING: {problem}" for problem in CONDITIONS.problems()
    ]


UNITS = {"GFLOP/s": 1e9, "TFLOP/s": 1e12, "GB/s": 1e9, "tokens/s": 1.0, "calls/s": 1.0}


def record(benchmark, provider, *, op, dtype, shape, work: float, unit: str):
    """Fills `extra_info` after `benchmark(...)` ran: throughput from the
    median, in `unit` (GFLOP/s, TFLOP/s or GB/s) for `work` (FLOPs or
    bytes). Nothing to record where the run times nothing
    (`--benchmark-disable`: each case runs once, as a test)."""
    if benchmark.stats is None:
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        op=op,
        provider=provider.name,
        backend=provider.backend or "torch",
        dtype=str(dtype).removeprefix("torch."),
        shape=list(shape),
        device=providers.device_name(),
        unit=unit,
        throughput=work / median / UNITS[unit],
        **providers.versions(),
        **dataclasses.asdict(CONDITIONS),
    )


def _ratios(benchmarks) -> None:
    by_group = defaultdict(list)
    for b in benchmarks:
        by_group[b["group"]].append(b)
    for group in by_group.values():
        medians = {b["extra_info"].get("provider"): b["stats"]["median"] for b in group}
        peaks = {b["extra_info"].get("provider"): b["extra_info"].get("peak_bytes")
                 for b in group}
        for b in group:
            info = b["extra_info"]
            if "torch" in medians:
                info["ratio_to_torch"] = medians["torch"] / b["stats"]["median"]
            if "torch.compile" in medians:  # on a GPU
                info["ratio_to_compiled"] = medians["torch.compile"] / b["stats"]["median"]
            if "peak_bytes" in info and peaks.get("torch"):
                info["peak_vs_torch"] = info["peak_bytes"] / peaks["torch"]
            # Timed round by round against torch (bench_models.py's Partner):
            # the ratio of those rounds, which share the machine's load.
            if "torch_median_interleaved" in info:
                if "ratio_to_torch" in info:
                    info["ratio_to_torch_separate"] = info["ratio_to_torch"]
                info["ratio_to_torch"] = info["torch_median_interleaved"] / b["stats"]["median"]
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
    terminalreporter.write_line(f"conditions: {CONDITIONS.summary()}")
    for problem in CONDITIONS.problems():
        terminalreporter.write_line(f"WARNING: {problem}", yellow=True, bold=True)
    for r in sorted(rows, key=lambda r: (r["group"] or "", r["extra_info"].get("provider", ""))):
        info = r["extra_info"]
        line = (f"{r['group']:<34} {info.get('provider', '?'):<28} "
                f"{r['stats']['median'] * 1e6:12.1f} us {info.get('throughput', 0):10.3f} "
                f"{info.get('unit', ''):<8}")
        if info.get("ratio_to_torch") is not None:
            line += f" {info['ratio_to_torch']:6.2f}x torch"
            if "torch_median_interleaved" in info:
                line += " (interleaved)"
            if "ratio_to_torch_paired" in info:
                line += f", {info['ratio_to_torch_paired']:.2f}x round by round"
        if info.get("time_vs_jax") is not None:
            line += f"  time {info['time_vs_jax']:.2f}x jax's"
        terminalreporter.write_line(line)
