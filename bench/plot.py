"""Turns a pytest-benchmark JSON (from the bench/ suites) into PNG charts:
per op and dtype, throughput against size for every provider, and each
provider's throughput as a ratio to torch's.

    python bench/plot.py out.json --out plots/
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def load(path: Path) -> dict:
    """{(op, dtype): {provider: [(size, label, throughput, ratio)]}}, plus
    the unit and device of each (op, dtype)."""
    data = json.loads(path.read_text())
    series: dict = defaultdict(lambda: defaultdict(list))
    meta: dict = {}
    for b in data["benchmarks"]:
        info = b["extra_info"]
        if "throughput" not in info or b["group"].startswith("add-overhead"):
            continue
        key = (info["op"], info["dtype"])
        shape = info["shape"]
        size = math.prod(shape)
        label = "x".join(map(str, shape))
        series[key][info["provider"]].append(
            (size, label, info["throughput"], info.get("ratio_to_torch"))
        )
        meta[key] = (info["unit"], info["device"])
    return series, meta


def plot(series, meta, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (op, dtype), by_provider in sorted(series.items()):
        unit, device = meta[(op, dtype)]
        fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(13, 5))
        labels = {}
        for provider, points in sorted(by_provider.items()):
            points.sort()
            sizes = [p[0] for p in points]
            labels.update({p[0]: p[1] for p in points})
            ax_t.plot(sizes, [p[2] for p in points], marker="o", label=provider)
            ratios = [(p[0], p[3]) for p in points if p[3] is not None]
            if ratios:
                ax_r.plot(*zip(*ratios), marker="o", label=provider)
        for ax in (ax_t, ax_r):
            ax.set_xscale("log")
            ticks = sorted(labels)
            ax.set_xticks(ticks, [labels[t] for t in ticks], rotation=30, ha="right")
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("shape (M x K x N)" if op == "matmul" else "elements")
            ax.legend(fontsize=8)
        ax_t.set_yscale("log")
        ax_t.set_ylabel(f"throughput ({unit}, median)")
        ax_t.set_title(f"{op} {dtype}: throughput")
        ax_r.set_yscale("log")  # simulators sit orders of magnitude below
        ax_r.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax_r.set_ylabel("throughput / torch's (same run)")
        ax_r.set_title(f"{op} {dtype}: ratio to torch")
        fig.suptitle(device)
        fig.tight_layout()
        path = out / f"{op}_{dtype}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, help="pytest-benchmark JSON file")
    parser.add_argument("--out", type=Path, default=Path("plots"), help="folder for the PNGs")
    args = parser.parse_args(argv)
    series, meta = load(args.json)
    if not series:
        parser.error(f"{args.json} holds no torch_pallas benchmark results")
    for path in plot(series, meta, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
