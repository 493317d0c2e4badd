"""The static schedule of the TPU kernels for a TPU v5e (or v6e), no chip:
each build of an op (its examples and realistic calls, tests/tpu_builds.py)
compiled with libtpu's compile-only client and its LLO dumps on, and for
each kernel the largest straight-line regions of its final VLIW bundles.

A bundle issues in one cycle (v5e: 4 MXUs of 128 x 128 at 197 TFLOP/s,
about 1.5 GHz), so a region's bundles are the cycles of one pass through
it when nothing stalls (no DMA wait, no result latency the scheduler could
not hide): a kernel's block body (the pipelined attention's key block, a
matmul's k step) is one of its largest regions. Where no chip is lent it is
the measure of a change to a kernel's inner loop, never its time: a change
that takes bundles out of the block body takes cycles out of every block.
The regions are numbered by libtpu; compare a kernel's before and after by
their sizes. The dumps are libtpu's debug output (its `xla_jf_dump_*`
flags, libtpu 0.0.42.1), whose format a later libtpu may change.

    python bench/tpu_bundles.py --ops attention [--tier default|exhaustive|all]
        [--case window] [--dtype bfloat16] [--chip v5e] [--regions 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

_ADDRESS = re.compile(r"\s*0x([0-9a-f]+)")
_REGION = re.compile(r"(Start|End) region (\d+)")
# A Pallas kernel's program ends in its custom call (XLA's fusions in theirs).
_KERNEL = re.compile(r"exit bundle: %(\S+) = custom-call\(")


def regions(final_bundles: str) -> list[tuple[int, str]]:
    """(bundles, region) of every region of a final-bundles dump, largest
    first: from the bundle that starts it to the one that ends it."""
    starts, sizes = {}, []
    for line in final_bundles.splitlines():
        address = _ADDRESS.match(line)
        if not address:
            continue
        at = int(address.group(1), 16)
        for kind, region in _REGION.findall(line):
            if kind == "Start":
                starts[region] = at
            elif region in starts:
                sizes.append((at - starts.pop(region) + 1, region))
    return sorted(sizes, reverse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", required=True, help="comma-separated op names")
    parser.add_argument("--tier", default="all", help="default, exhaustive or all")
    parser.add_argument("--case", default="", help="only the cases whose name holds this")
    parser.add_argument("--dtype", default="", help="only the builds of this dtype")
    parser.add_argument("--chip", default="v5e")
    parser.add_argument("--regions", type=int, default=3, help="largest regions shown")
    args = parser.parse_args(argv)
    dumps = pathlib.Path(tempfile.mkdtemp(prefix="tpu_bundles_"))
    # Before JAX starts libtpu: its settings are read once.
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(filter(None, [
        os.environ.get("LIBTPU_INIT_ARGS", ""), f"--xla_jf_dump_to={dumps}",
        "--xla_jf_dump_llo_text=true"]))
    import tpu_builds  # noqa: E402  (tests/, put on the path above)

    if not tpu_builds.libtpu_installed():
        print("libtpu not installed: nothing to compile with")
        return 1
    device = tpu_builds.abstract_device(args.chip)
    for op in args.ops.split(","):
        builds, errors = tpu_builds.record(op, args.tier)
        for error in errors:
            print(f"{op} {error['case']} {error['dtype']}: {error['error']}")
        for build in builds:
            cases = "; ".join(build.cases)
            if args.case not in cases or (args.dtype and args.dtype != build.dtype):
                continue
            before = set(dumps.glob("*final_bundles.txt"))
            result = tpu_builds.compile_build(build, device)
            print(f"{op} [{cases}, {build.dtype}] {build.describe()}: {result['status']}"
                  + (f" {result['error']}" if result["status"] != "ok" else ""))
            for path in sorted(set(dumps.glob("*final_bundles.txt")) - before):
                text = path.read_text()
                kernel = _KERNEL.search(text)
                if kernel is None:  # XLA's own (the operands' padding, slices)
                    continue
                shown = ", ".join(f"{n} (region {r})" for n, r in regions(text)[:args.regions])
                print(f"    {kernel.group(1)}: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
