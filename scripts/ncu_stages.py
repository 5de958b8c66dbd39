"""Where a warp-specialized kernel's time goes, from Nsight Compute's per-instruction source page.

ncu --clock-control none --kernel-name K --launch-skip 2 --launch-count 1 --section SourceCounters \\
    --section WarpStateStats --import-source no -o rep python script.py
ncu --import rep.ncu-rep --page source --csv --print-source sass > rep.csv
python scripts/ncu_stages.py rep.csv [--top 8]

Reads the SASS rows (address, instruction, warp-state samples, instructions executed, ``stall_*`` columns) and splits
the kernel into its partitions where ``USETMAXREG.TRY_ALLOC`` sets a partition's registers (Gluon's
``warp_specialize``: the default partition and each worker), and each partition into stages at its mbarrier arrives
(``SYNCS.ARRIVE``: in tfla's Gluon kernels a consumer arrives when it releases a group of buffers, so the stages are
the spans between releases). Per partition: its samples and instructions, the stall reasons' shares, the opcodes
with the most samples, and per stage its share of the partition's samples and instructions with its first tensor-core
instruction for orientation. Samples are taken per warp, so a partition of idle warps (a worker's padding warps
waiting at a barrier) shows as samples without instructions.
"""
from __future__ import annotations

import argparse
import csv
import re
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _int(x: str) -> int:
    try:
        return int(float(x.replace(",", "")))
    except ValueError:
        return 0


def read(path: str) -> list[dict]:
    """The SASS rows of one kernel's source page: ``{"addr", "sass", "samples", "executed", "stalls": {reason: n}}``.
    Raises ValueError for a file without the source page's columns."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if SAMPLES in r and "Source" in r), None)
    if head is None:
        raise ValueError(f"{path}: no '{SAMPLES}' column (export with --page source --csv --print-source sass)")
    hdr = rows[head]
    ix = {h: i for i, h in enumerate(hdr)}
    stall = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    out = []
    for r in rows[head + 1:]:
        if len(r) < len(hdr):
            continue
        out.append({"addr": r[ix["Address"]], "sass": r[ix["Source"]].strip(), "samples": _int(r[ix[SAMPLES]]),
                    "executed": _int(r[ix[EXECUTED]]) if EXECUTED in ix else 0,
                    "stalls": {h[6:]: _int(r[ix[h]]) for h in stall if _int(r[ix[h]])}})
    return out


def _opcode(sass: str) -> str:
    parts = sass.split()
    if not parts:
        return ""
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    return op if op.startswith("WARPGROUP") else op.split(".")[0]


def partitions(rows: list[dict]) -> list[tuple[int, list[dict]]]:
    """``(registers, rows)`` per partition: from each ``USETMAXREG.TRY_ALLOC`` to the next register change (the
    rows before the first: the kernel's prologue, registers 0)."""
    parts, regs, cur = [], 0, []
    for r in rows:
        m = re.search(r"USETMAXREG\.TRY_ALLOC\S*\s+\S+,\s*(0x[0-9a-f]+|\d+)", r["sass"])
        if m:
            if cur:
                parts.append((regs, cur))
            regs, cur = int(m.group(1), 0), []
        cur.append(r)
    if cur:
        parts.append((regs, cur))
    return parts


def stages(rows: list[dict]) -> list[list[dict]]:
    """The rows cut after each mbarrier arrive (``SYNCS.ARRIVE``)."""
    out, cur = [], []
    for r in rows:
        cur.append(r)
        if "SYNCS.ARRIVE" in r["sass"]:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def report(rows: list[dict], top: int = 8) -> str:
    total = sum(r["samples"] for r in rows) or 1
    lines = [f"{len(rows)} instructions, {total} samples"]
    for regs, part in partitions(rows):
        s = sum(r["samples"] for r in part)
        ex = sum(r["executed"] for r in part)
        if not s and not ex:
            continue
        lines.append(f"\n## partition at {part[0]['addr']} ({regs} registers): {s / total:.1%} of the samples, "
                     f"{ex} warp instructions")
        if not s:
            continue
        st = Counter()
        ops = Counter()
        for r in part:
            st.update(r["stalls"])
            ops[_opcode(r["sass"])] += r["samples"]
        lines.append("stalls: " + ", ".join(f"{k} {v / s:.1%}" for k, v in st.most_common(top)))
        lines.append("opcodes by samples: " + ", ".join(f"{k} {v / s:.1%}" for k, v in ops.most_common(top)))
        cut = stages(part)
        if len(cut) > 1:
            lines.append("stage (ends at an mbarrier arrive) | samples | instructions | first tensor-core op")
            for i, seg in enumerate(cut):
                ss = sum(r["samples"] for r in seg)
                se = sum(r["executed"] for r in seg)
                mma = next((r["sass"].split()[0] for r in seg if "GMMA" in r["sass"]), "-")
                lines.append(f"{i}: {seg[0]['addr']} .. {seg[-1]['addr']} | {ss / s:.1%} | {se / max(ex, 1):.1%} | "
                             f"{mma}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("--top", type=int, default=8, help="stall reasons and opcodes listed per partition")
    a = p.parse_args(argv)
    print(report(read(a.csv), a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
