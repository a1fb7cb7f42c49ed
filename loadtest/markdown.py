"""docs/benchmarks.md from benchmark results (the JSON `kvfabric bench` writes), so the
figures in the docs are exactly the ones measured, with the command, date and machine.

    python -m loadtest.markdown RESULTS_DIR [--command "kvfabric bench all"] > docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from loadtest.results import format_number

HEADER = """# Benchmarks

The latest figures of every `kvfabric bench` benchmark, each ratio measured side by side with
its peer in one run. Regenerate: `kvfabric bench all --json DIR` (add `--peers` for the ones
that install vLLM or Dynamo), then `python -m loadtest.markdown DIR > docs/benchmarks.md`.
A ratio is ours / the peer's (for latencies, lower is better); "NOT met" marks a target
missed; the notes under a table, and docs/prefix-reuse.md and docs/engine-benchmarks.md for
the engine's, say why where it is known. A section marked (quick) ran
at the small sizes CI uses: its targets are the full-size ones (a 77K-token chat, an 8K
prompt, 10M indexed blocks) and say little at a tenth of the size; fixed per-request costs
weigh more there. Every figure here was measured on a shared 2-core VM: only the ratios,
each taken side by side in one run, mean anything.
"""


def render(results: list[dict[str, Any]], command: str) -> str:
    out = [HEADER]
    for result in results:
        machine = result["machine"]
        out.append(f"## {result['name']}{' (quick)' if result['quick'] else ''}\n")
        ran = result.get("command") or command
        out.append(
            f"`{ran}` on {result['started_at']}, {machine['cpu_count']} cores "
            f"({machine['platform']}, Python {machine['python']}), load average "
            f"{machine['load_average_1m']} at the end; {result['duration_s']:.0f} s.\n"
        )
        if result["ratios"]:
            out.append("| compared | ours | peer | unit | ratio | target |")
            out.append("|---|---|---|---|---|---|")
            for r in result["ratios"]:
                out.append(
                    f"| {r['name']} | {format_number(r['ours'])} | {r['peer_name']}: "
                    f"{format_number(r['peer'])} | {r['unit']} | {r['value']:.2f}x | {_target(r)} |"
                )
            out.append("")
        if result["figures"]:
            out.append("| figure | value | unit | target |")
            out.append("|---|---|---|---|")
            for f in result["figures"]:
                out.append(
                    f"| {f['name']} | {format_number(f['value'])} | {f['unit']} | {_target(f)} |"
                )
            out.append("")
        out.extend(f"- {note}" for note in result["notes"])
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _target(entry: dict[str, Any]) -> str:
    if entry.get("target") is None:
        return ""
    bound = "<=" if entry["lower_is_better"] else ">="
    return f"{bound} {format_number(entry['target'])}: {'met' if entry['met'] else '**NOT met**'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument(
        "--command", default="kvfabric bench all", help="for results that do not name theirs"
    )
    args = parser.parse_args()
    files = sorted(args.results_dir.glob("*.json"))
    if not files:
        raise SystemExit(f"no *.json results in {args.results_dir}")
    print(render([json.loads(p.read_text()) for p in files], args.command), end="")


if __name__ == "__main__":
    main()
