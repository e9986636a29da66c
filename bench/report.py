"""Regenerate benchmark tables from bench/results/*.json (never type figures by hand).

Writes bench/results/README_tables.md with every table, and, where bench/README.md holds markers

    <!-- bench:NAME:start -->
    ...replaced...
    <!-- bench:NAME:end -->

(NAME: models, capsules, ttft, ablation, or any other bench whose JSON was written by
bench/common.py) replaces the text between them with NAME's tables. README.md holds short
headline blocks (<!-- bench:headline-NAME:start -->): NAME's first table, HEADLINE columns and
rows only.
Results of --quick runs (*.quick.json) are left out unless --include-quick.

    python bench/report.py
    python bench/report.py --readme README.md --include-quick
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import common as C  # noqa: E402

NAMES = ("state_sizes", "models", "capsules", "ttft", "ablation", "serve")
# headline blocks of README.md: bench -> (row filter on the first cell, column indices kept)
HEADLINE = {
    "ttft": ("Qwen3.5-0.8B", (1, 2, 3, 4, 5, 6)),     # prefix .. flashrt's same-16-tokens check
    "capsules": ("", (0, 2, 3, 4, 5, 6)),             # state, plain copy, snapshot(into), restore
    "serve": ("", (0, 2, 3, 6, 7, 8, 9)),             # turn, cached, flashrt, re-prefill, llama-cpp
    "agent": ("", (0, 1, 2, 3)),                      # the acceptance table: criterion .. met
    "voice": ("", (0, 1, 2, 3)),                      # the acceptance table: line .. holds
    "decode": ("", (0, 1, 2, 3)),                     # the acceptance table: criterion .. met
}


def load_results(results: Path, include_quick: bool) -> dict:
    """{bench name: [payload, ...]} in a stable order (file name)."""
    out = {n: [] for n in NAMES}
    for f in sorted(results.glob("*.json")):
        if f.name.endswith(".quick.json") and not include_quick:
            continue
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            print(f"skipping {f.name}: {e}", file=sys.stderr)
            continue
        # any bench written through common.write_json (it has "bench" and "tables")
        if not isinstance(d, dict) or not isinstance(d.get("bench"), str) or "tables" not in d:
            continue
        out.setdefault(d["bench"], [])
        d["_file"] = f.name
        out[d["bench"]].append(d)
    for name, lst in out.items():   # the default run (<name>.json) first, then the variants
        lst.sort(key=lambda d: (d["_file"] != f"{name}.json", d["_file"]))
    return out


def _commit(machine: dict) -> str:
    """The measured tree: 12 hex digits, and -dirty when it had uncommitted changes."""
    c = str(machine.get("flashrt_commit") or "?")
    return c[:12] + ("-dirty" if c.endswith("-dirty") else "")


def section(payloads: list) -> str:
    """Markdown for one bench: for each result file, its machine line, command and tables."""
    parts = []
    for d in payloads:
        m = d.get("machine", {})
        # the CPU kernels chosen depend on these (bf16 on oneDNN needs avx512_bf16)
        flags = f" ({' '.join(m['cpu_flags'])})" if m.get("cpu_flags") else ""
        where = m.get("gpu") or f"{m.get('cpu')} x{m.get('cpu_count')}{flags}"
        parts.append(f"_{where}, {m.get('device')} {m.get('dtype')}, torch {m.get('torch')} "
                     f"({m.get('torch_threads')} threads), transformers {m.get('transformers')}, "
                     f"flashrt {_commit(m)}, {m.get('date')}; "
                     f"{d.get('note', C.RANDOM_NOTE)}. Command: `{d.get('command')}` "
                     f"(bench/results/{d['_file']})_")
        for t in d.get("tables", []):
            parts.append(C.Table.from_json(t).markdown())
    return "\n\n".join(parts)


def headline(name: str, payloads: list) -> str | None:
    """README's short block for a bench: its default result's first table, trimmed."""
    if name not in HEADLINE or not payloads or not payloads[0].get("tables"):
        return None
    d, (row_key, cols) = payloads[0], HEADLINE[name]
    t = C.Table.from_json(d["tables"][0])
    keep = [i for i in cols if i < len(t.headers)]
    rows = [[r[i] for i in keep] for r in t.rows if row_key in r[0]]
    out = C.Table(t.title, [t.headers[i] for i in keep], rows)
    m = d.get("machine", {})
    return (out.markdown() + f"\n\n_{m.get('cpu')} x{m.get('cpu_count')}, {m.get('device')} "
            f"{m.get('dtype')}, random weights; `{d.get('command')}`; all rows and columns in "
            f"bench/README.md_")


def replace_markers(text: str, name: str, body: str) -> tuple[str, bool]:
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    pat = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pat.search(text):
        return text, False
    return pat.sub(lambda _: f"{start}\n{body}\n{end}", text), True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench/report.py", description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(C.RESULTS), help="directory of result JSON files")
    p.add_argument("--out", default=None, help="markdown output (default <results>/README_tables.md)")
    p.add_argument("--readme", nargs="*", default=[str(C.ROOT / "bench" / "README.md"),
                                                   str(C.ROOT / "README.md")],
                   help="files whose bench markers are refreshed (bench/README.md, README.md)")
    p.add_argument("--no-readme", action="store_true", help="only write the markdown file")
    p.add_argument("--include-quick", action="store_true", help="also use *.quick.json results")
    a = p.parse_args(argv)
    results = Path(a.results)
    by_name = load_results(results, a.include_quick)
    doc = ["# FlashRT benchmark tables", "",
           "Generated by `python bench/report.py` from bench/results/*.json; do not edit by hand.", ""]
    bodies = {}
    for name in by_name:       # NAMES first, then other benches in file-name order
        if not by_name[name]:
            continue
        bodies[name] = section(by_name[name])
        doc += [f"## {name}", "", bodies[name], ""]
    heads = {f"headline-{n}": h for n in by_name if (h := headline(n, by_name[n])) is not None}
    if not bodies:
        print(f"no result files in {results}" + ("" if a.include_quick else
                                                 " (quick results are skipped; --include-quick)"))
    out = Path(a.out) if a.out else results / "README_tables.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(doc).rstrip() + "\n")
    print(f"wrote {out} ({', '.join(bodies) or 'no tables'})")
    for readme in map(Path, [] if a.no_readme else a.readme):
        if not readme.exists():
            continue
        text, changed = readme.read_text(), []
        for name, body in {**bodies, **heads}.items():
            text, hit = replace_markers(text, name, body)
            if hit:
                changed.append(name)
        if changed:
            readme.write_text(text)
            print(f"updated {readme}: {', '.join(changed)}")
        else:
            print(f"{readme}: no bench markers to update")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
