"""Which TPU kernel builds Mosaic compiles for a TPU v5e (or v6e), as a
table: every registered op's builds (its examples and realistic LLM-sized
calls, forward and backward, in every dtype it accepts; tests/tpu_builds.py)
compiled with libtpu's compile-only client on this CPU machine, no chip.

Prints one row per build (op, kernel, dtype, inputs and parameters, ok or
the error's first line), then the builds compiled of the total per dtype
and per chip, and each op's recording and compile times. One op at a time
(each in a subprocess of its own, since libtpu's settings must be made
before JAX starts).

    python bench/tpu_compile_report.py [--tier default|exhaustive|all]
        [--chips v5e,v6e] [--ops matmul,attention] [--json out.json]

tests/test_tpu_compile.py asserts the same builds compile.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import tpu_builds  # noqa: E402  (tests/, put on the path above)


# Long prefixes of the errors' first lines, and what the table shows instead.
SHORTER = (("MosaicError: INTERNAL: Mosaic failed to compile TPU kernel: ", "Mosaic: "),
           ("JaxRuntimeError: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:", "VMEM OOM:"))
WIDTH = 80  # characters of a result shown


def shown(result: dict) -> str:
    """A build's result as the table shows it: ok, or its error's first
    line, shortened."""
    if result["status"] == "ok":
        return "ok"
    text = result["error"]
    for prefix, short in SHORTER:
        text = text.replace(prefix, short)
    text = f"refused: {text}" if result["status"] == "refused" else text
    return text if len(text) <= WIDTH else text[:WIDTH - 3] + "..."


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=tpu_builds.TIERS, default="all")
    parser.add_argument("--chips", default="v5e", help="comma-separated, of: "
                        + ", ".join(tpu_builds.CHIPS))
    parser.add_argument("--ops", default="", help="comma-separated (default: every registered op)")
    parser.add_argument("--json", help="also write every op's report to this file")
    args = parser.parse_args(argv)
    if not tpu_builds.libtpu_installed():
        print("libtpu not installed: nothing to compile with")
        return 1
    from torch_pallas.runtime import registry

    ops = [o for o in args.ops.split(",") if o] or [info.name for info in registry.ops()]
    chips = [c for c in args.chips.split(",") if c]
    reports = []
    counts = collections.defaultdict(lambda: [0, 0])  # (chip, dtype) -> [compiled, total]
    print(f"{'op':<30} {'dtype':<9} {'chip':<4} {'result':<{WIDTH}} build")
    for op in ops:
        report = tpu_builds.run_subprocess(op, args.tier, chips)
        reports.append(report)
        for error in report["record_errors"]:
            print(f"{op:<30} {str(error['dtype']):<9} {'-':<4} "
                  f"{('NOT RECORDED: ' + error['error'])[:WIDTH]:<{WIDTH}} {error['case']}")
        for chip in chips:
            if "unavailable" in report["chips"][chip]:
                print(f"{op:<30} {'-':<9} {chip:<4} unavailable: "
                      f"{report['chips'][chip]['unavailable']}")
                continue
            for build in report["builds"]:
                result = build["results"][chip]
                if result["status"] != "refused":
                    counts[chip, build["dtype"]][0] += result["status"] == "ok"
                    counts[chip, build["dtype"]][1] += 1
                print(f"{op:<30} {build['dtype']:<9} {chip:<4} {shown(result):<{WIDTH}} "
                      f"{build['describe']}")
        sys.stdout.flush()
    print("\nbuilds compiled / total (refused calls not counted)")
    for (chip, dtype), (ok, total) in sorted(counts.items()):
        print(f"  {chip} {dtype:<9} {ok:>4} / {total}")
    print(f"\n{'op':<30} {'builds':>6} {'record s':>9} "
          + " ".join(f"{chip + ' s':>8}" for chip in chips))
    for report in reports:
        times = " ".join(f"{report['chips'][chip].get('seconds', float('nan')):>8.1f}"
                         for chip in chips)
        print(f"{report['op']:<30} {len(report['builds']):>6} "
              f"{report['record_seconds']:>9.1f} {times}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(reports, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
