"""A/B of two trees with the printing benchmarks step_cases.py and copy_loop.py: runs alternate
(A B, B A, A B, ...) in one session, so drift on a shared machine hits both. A case regresses
in B when B's median over the runs is more than 5% above A's.

    python bench/ab_layout.py --a OLD_TREE [--b NEW_TREE] [--runs 5]

Each tree must hold its built extension (flashrt/_C*.so in trees from before the layout
change, flashrt/native/_C*.so after) or find an installed one. Writes bench/results/ab-layout.json.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# "loading thread           median   295.5 ms  [...]" and "TREE: restore 12.34 us/call (...)"
STEP = re.compile(r"^(.+?)\s+median\s+([\d.]+) ms")
COPY = re.compile(r": (restore|snapshot\(into\)) ([\d.]+) us/call")


def run(tree: Path, py: str, size: str) -> dict:
    out = {}
    res = subprocess.run([py, str(tree / "bench/step_cases.py"), "--size", size, "--no-progress"],
                         capture_output=True, text=True, check=True, cwd=tree)
    for line in res.stdout.splitlines():
        m = STEP.match(line.strip())
        if m:
            out[f"step_cases: {m.group(1).strip()} (ms)"] = float(m.group(2))
    res = subprocess.run([py, str(ROOT / "bench/copy_loop.py"), str(tree)], capture_output=True,
                         text=True, check=True, cwd=tree)
    for line in res.stdout.splitlines():
        m = COPY.search(line)
        if m:
            out[f"copy_loop: {m.group(1)} (us/call)"] = float(m.group(2))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="the old tree")
    p.add_argument("--b", default=str(ROOT), help="the new tree (default: this one)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--size", default="real")
    args = p.parse_args(argv)
    trees = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    got = {"A": [], "B": []}
    for i in range(args.runs):
        for k in ("AB" if i % 2 == 0 else "BA"):
            got[k].append(run(trees[k], args.python, args.size))
            print(f"run {i + 1}/{args.runs} {k}: {got[k][-1]}", flush=True)
    table, worse = [], []
    for case in got["A"][0]:
        a = statistics.median(r[case] for r in got["A"])
        b = statistics.median(r[case] for r in got["B"])
        table.append({"case": case, "a_median": a, "b_median": b, "b_over_a": b / a})
        if b > 1.05 * a:
            worse.append(case)
        print(f"{case:48s} A {a:9.2f}  B {b:9.2f}  B/A {b / a:5.3f}")
    print("regressions (B median > 1.05 x A):", worse or "none")
    out = ROOT / "bench/results/ab-layout.json"
    commit = {k: subprocess.run(["git", "-C", str(v), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "?" for k, v in trees.items()}
    out.write_text(json.dumps({"trees": commit, "runs": got,
                               "table": table, "regressions": worse}, indent=1))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
