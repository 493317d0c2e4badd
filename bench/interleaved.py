"""bench_attention.py's packed-sequence and sliding-window cases timed in
interleaved rounds: each round runs every case once, so a host whose
speed drifts for seconds at a time (a shared VM) slows both sides of a
ratio alike; pytest-benchmark times one provider's rounds, then the
other's. Prints medians, the ratios of the medians and the medians of the
per-round ratios.

    OMP_WAIT_POLICY=PASSIVE python bench/interleaved.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_attention  # noqa: E402  (bench/ is no package)


def steps() -> dict:
    """{(case, backward): a call timing one forward, or forward+backward}."""
    found = {}
    for backward in (False, True):
        for name in ("torch-padded", "pallas-packed"):
            found[name, backward] = bench_attention._packed_call(name, backward)
        for name in ("full-causal", "window"):
            found[name, backward] = bench_attention._window_call(name, backward)
    calls = {}
    for key, (forward, leaves) in found.items():
        if not key[1]:
            calls[key] = forward
            continue
        grad = torch.randn_like(forward())
        calls[key] = (lambda f=forward, ls=leaves, g=grad: torch.autograd.grad(f(), ls, g))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    rounds = parser.parse_args().rounds
    calls = steps()
    for call in calls.values():  # compile, warm
        call()
        call()
    times = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            times[key].append(time.perf_counter() - start)
    median = {key: 1e3 * statistics.median(t) for key, t in times.items()}
    for (name, backward), ms in median.items():
        spread = f"{1e3 * min(times[name, backward]):.1f}-{1e3 * max(times[name, backward]):.1f}"
        print(f"{name:14s} {'fwd+bwd' if backward else 'fwd':8s} {ms:8.1f} ms  ({spread})")
    for backward in (False, True):
        tag = "fwd+bwd" if backward else "fwd"
        for label, base, case in (("packed vs SDPA padded", "torch-padded", "pallas-packed"),
                                  ("window vs full causal", "full-causal", "window")):
            per_round = [a / b for a, b in zip(times[base, backward], times[case, backward])]
            print(f"{label} {tag}: {median[base, backward] / median[case, backward]:.2f}x "
                  f"(per round {statistics.median(per_round):.2f}x)")


if __name__ == "__main__":
    main()
