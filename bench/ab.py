"""A/B two builds with one benchmark: runs alternate in one session (A B, B A, A B, ...), so
drift on a shared machine hits both; each timed cell is compared across the runs.

    python bench/ab.py --a OLD_TREE --a-python OLD_VENV/bin/python --runs 5 -- \
        bench/capsules.py --arch qwen3 --mib 1 4 16 64 --no-progress

A cell is one timing the benchmark recorded (a median_ms in its JSON data, at full resolution;
time: lower is better). It regresses in B when B's median over the runs is more than 5% above
A's and outside A's interquartile range. Ratios are not cells: each is two timings, compared
on their own. Prints every cell and writes bench/results/ab-<bench>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cells(payload: dict) -> dict:
    """{path in the JSON data: median ms} for every timing the bench recorded (Stats.to_json)."""
    out = {}

    def walk(node, path):
        if isinstance(node, dict):
            if "median_ms" in node and "samples_ms" in node:
                out[path] = float(node["median_ms"])
                return
            for k, v in node.items():
                walk(v, (*path, str(k)))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*path, str(i)))
    walk(payload.get("data", {}), ())
    return out


def quartiles(xs):
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/ab.py", description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="the baseline tree (e.g. a git worktree)")
    p.add_argument("--a-python", default=sys.executable)
    p.add_argument("--b", default=str(ROOT), help="the candidate tree (default: this one)")
    p.add_argument("--b-python", default=sys.executable)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--out", default=None)
    p.add_argument("--fixed-malloc", action="store_true",
                   help="fix glibc's mmap and trim thresholds in both builds' runs (32/64 MiB): "
                        "with the default dynamic threshold, whether a fresh buffer is page-"
                        "faulted in depends on what the process freed before")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- script.py [its arguments]")
    a = p.parse_args(argv)
    cmd = [x for x in a.bench if x != "--"]
    tmp = Path(tempfile.mkdtemp(prefix="ab-"))
    runs = {"A": [], "B": []}
    env = dict(os.environ)
    if a.fixed_malloc:      # glibc tunables, read at process start (not flashrt settings)
        env["GLIBC_TUNABLES"] = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864"
    sides = (("A", a.a, a.a_python), ("B", a.b, a.b_python))
    for i in range(a.runs):
        # counterbalanced (AB, BA, AB, ...): whatever a run leaves behind (page cache, dirty
        # pages, freed memory) falls on A and B alike
        for side, tree, py in (sides if i % 2 == 0 else sides[::-1]):
            out = tmp / f"{side}{i}.json"
            subprocess.run([py, str(Path(tree) / cmd[0]), *cmd[1:], "--out", str(out)], cwd=tree,
                           check=True, stdout=subprocess.DEVNULL, env=env)
            runs[side].append(cells(json.loads(out.read_text())))
            print(f"run {i + 1}/{a.runs} {side} done", flush=True)
    keys = [k for k in runs["A"][0] if all(k in r for r in runs["A"] + runs["B"])]
    rows, bad = [], []
    for k in keys:
        va, vb = [r[k] for r in runs["A"]], [r[k] for r in runs["B"]]
        ma, mb = statistics.median(va), statistics.median(vb)
        qa = quartiles(va)
        worse = mb > ma * 1.05 and mb > qa[1]
        rows.append({"cell": list(k), "A": va, "B": vb, "median_A": ma, "median_B": mb,
                     "iqr_A": qa, "iqr_B": quartiles(vb), "regression": worse})
        bad += [k] if worse else []
        print(f"{'REGRESSION' if worse else 'ok        '} {' / '.join(k)}: "
              f"A {ma:.4g} ms [{qa[0]:.4g}-{qa[1]:.4g}]  B {mb:.4g}  B/A {mb / ma:.2f}")
    name = Path(cmd[0]).stem
    out = Path(a.out or ROOT / "bench" / "results" / f"ab-{name}.json")
    out.write_text(json.dumps({"command": " ".join(["python bench/ab.py", *(argv or sys.argv[1:])]),
                               "a": a.a, "b": a.b, "runs": a.runs, "cells": rows,
                               "regressions": [list(k) for k in bad]}, indent=1))
    print(f"{len(bad)} regression(s) of {len(keys)} cells; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
