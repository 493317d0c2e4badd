"""Turns a pytest-benchmark JSON (from the bench/ suites) into PNG charts:
per op and dtype, throughput against size for every provider, and each
provider's throughput as a ratio to torch's. Sizes read in human units
(1024³, 2²⁰ (4 MiB)); providers that coincide stay distinguishable.

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
        label = size_label(info["op"], shape, info["dtype"])
        series[key][info["provider"]].append(
            (size, label, info["throughput"], info.get("ratio_to_torch"))
        )
        meta[key] = (info["unit"], info["device"])
    return series, meta


BYTES_PER_ELEMENT = {"float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "int8": 1,
                     "uint8": 1, "bool": 1}


def size_label(op: str, shape, dtype: str) -> str:
    """An x tick in human units: M x K x N for matmul shapes (1024³ for a
    cube), else the element count, as a power of two where it is one, with
    the bytes of one array: "2²⁰ (4 MiB)"."""
    if op.startswith("matmul"):
        return f"{shape[0]}³" if len(set(shape)) == 1 else "x".join(map(str, shape))
    n = math.prod(shape)
    count = f"$2^{{{n.bit_length() - 1}}}$" if n > 1 and n & (n - 1) == 0 else f"{n:,}"
    size, unit = n * BYTES_PER_ELEMENT.get(dtype, 4), "B"
    for bigger in ("KiB", "MiB", "GiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{count} ({size:.3g} {unit})"


# Providers that coincide (a pallas[b] op and its bare jax[b] kernel often
# do) must not hide each other: colour by backend, line style by kind, a
# marker per provider, hollow markers for jax[...], and each provider's
# points shifted sideways, 8% from the next provider's.
LINESTYLES = {"torch": "-", "pallas": "-", "jax": "--", "triton": "-."}
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h"]
X_NUDGE = 1.08  # a factor per provider on the log x axis; ticks stay at the true sizes


def kind_and_backend(provider: str) -> tuple[str, str]:
    """("jax", "interpret") for "jax[interpret]"; ("torch", "torch") for "torch"."""
    kind, _, backend = provider.partition("[")
    return kind, backend.rstrip("]") or kind


def provider_styles(providers) -> dict[str, dict]:
    """matplotlib keyword arguments per provider, the same in every chart."""
    providers = sorted(providers)
    backends = sorted({kind_and_backend(name)[1] for name in providers} - {"torch"})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = {}
    for i, name in enumerate(providers):
        kind, backend = kind_and_backend(name)
        color = "black" if kind == "torch" else colors[backends.index(backend) % len(colors)]
        styles[name] = dict(
            color=color, linestyle=LINESTYLES.get(kind, ":"), marker=MARKERS[i % len(MARKERS)],
            markerfacecolor="none" if kind == "jax" else color, alpha=0.85, label=name,
        )
    return styles


def plot(series, meta, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    styles = provider_styles({p for by_provider in series.values() for p in by_provider})
    for (op, dtype), by_provider in sorted(series.items()):
        unit, device = meta[(op, dtype)]
        fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(13, 5))
        labels = {}
        names = sorted(by_provider)
        for rank, provider in enumerate(names):
            points = sorted(by_provider[provider])
            labels.update({p[0]: p[1] for p in points})
            nudge = X_NUDGE ** (rank - (len(names) - 1) / 2)
            ax_t.plot([p[0] * nudge for p in points], [p[2] for p in points], **styles[provider])
            ratios = [(p[0] * nudge, p[3]) for p in points if p[3] is not None]
            if ratios:
                ax_r.plot(*zip(*ratios), **styles[provider])
        for ax in (ax_t, ax_r):
            ax.set_xscale("log")
            ticks = sorted(labels)
            ax.set_xticks(ticks, [labels[t] for t in ticks], rotation=30, ha="right")
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.set_xlabel("shape (M x K x N)" if op.startswith("matmul")
                          else "elements (bytes of one array)")
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
