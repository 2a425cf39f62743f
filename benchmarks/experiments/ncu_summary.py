"""Summarise ncu's `--csv --page details` output of ncu_cases.py: a few lines per kernel.

    python benchmarks/experiments/ncu_summary.py FILE.csv [FILE.csv ...]

Per profiled kernel: its NVTX range (case.provider), name, grid and block, duration, DRAM and
SM throughput (% of peak), achieved occupancy, registers, issue-slot use, and the largest warp
stall reasons (cycles per issued instruction, from the smsp__average_warps_issue_stalled_*
metrics the command line asks for).
"""

from __future__ import annotations

import csv
import sys
from collections import OrderedDict

KEEP = (
    ("Duration", "dur"),
    ("DRAM Throughput", "dram%"),
    ("Memory Throughput", "mem%"),
    ("Compute (SM) Throughput", "sm%"),
    ("Achieved Occupancy", "occ%"),
    ("Registers Per Thread", "regs"),
    ("Issue Slots Busy", "issue%"),
    ("Warp Cycles Per Issued Instruction", "cyc/issue"),
    ("Eligible Warps Per Scheduler", "eligible"),
    ("Dynamic Shared Memory Per Block", "smem"),
    ("L2 Hit Rate", "L2hit%"),
    ("smsp__inst_executed.sum", "inst"),  # asked for with --metrics
)
STALL = "smsp__average_warps_issue_stalled_"


def rows_of(path: str):
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    return list(csv.DictReader(lines))


def main() -> int:
    for path in sys.argv[1:]:
        try:
            rows = rows_of(path)
        except Exception as e:  # noqa: BLE001 - a case that failed leaves no CSV
            print(f"{path}: {type(e).__name__}: {e}")
            continue
        kernels: "OrderedDict[str, dict]" = OrderedDict()
        for r in rows:
            kid = r.get("ID")
            if kid is None:
                continue
            k = kernels.setdefault(kid, {"name": r.get("Kernel Name", "")[:60], "grid": r.get("Grid Size"),
                                         "block": r.get("Block Size"), "nvtx": r.get("NVTX", ""), "m": {}, "stall": {}})
            name, unit, value = r.get("Metric Name", ""), r.get("Metric Unit", ""), r.get("Metric Value", "")
            if name.startswith(STALL):
                try:
                    k["stall"][name[len(STALL):].replace("_per_issue_active.ratio", "")] = float(value.replace(",", ""))
                except ValueError:
                    pass
            for metric, short in KEEP:
                if name == metric:
                    k["m"][short] = f"{value}{'' if unit in ('', '%') else ' ' + unit}"
        print(f"== {path}")
        for kid, k in kernels.items():
            print(f"[{kid}] {k['name']} grid={k['grid']} block={k['block']}")
            print("   " + "  ".join(f"{short}={k['m'][short]}" for _, short in KEEP if short in k["m"]))
            top = sorted(k["stall"].items(), key=lambda kv: -kv[1])[:6]
            if top:
                print("   stalls (cycles/issue): " + ", ".join(f"{n}={v:.2f}" for n, v in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
