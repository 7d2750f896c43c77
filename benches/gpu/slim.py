#!/usr/bin/env python3
"""Slims an unpacked wheel down to what a few ELF files need.

`slim.py DIR ROOT... [--keep PATH...]` walks the DT_NEEDED entries of each
ROOT (paths relative to DIR), resolving them through each file's RPATH /
RUNPATH ($ORIGIN expanded) and the folders of the files already kept, and
deletes every other file under DIR except the ROOTs, their closure and the
`--keep` paths (files or folders, relative to DIR). Libraries that are not
inside DIR (libc, libcuda, libibverbs, ...) are reported as "from the system".
Uses `readelf -d` (binutils). Prints what it kept and removed, with sizes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path


def dynamic(path: Path) -> tuple[list[str], list[str]]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    paths: list[str] = []
    for m in re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]*)\]", out):
        paths.extend(p for p in m.split(":") if p)
    return needed, [p.replace("$ORIGIN", str(path.parent)).replace("${ORIGIN}", str(path.parent)) for p in paths]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir", type=Path)
    ap.add_argument("roots", nargs="+")
    ap.add_argument("--keep", nargs="*", default=[])
    args = ap.parse_args()
    top = args.dir.resolve()
    keep: set[Path] = set()
    system: dict[str, str] = {}
    todo = [top / r for r in args.roots]
    for r in todo:
        if not r.is_file():
            print(f"slim: root {r} missing", file=sys.stderr)
            return 1
    while todo:
        f = todo.pop().resolve()
        if f in keep:
            continue
        keep.add(f)
        needed, rpaths = dynamic(f)
        for name in needed:
            hit = None
            for d in rpaths + [str(f.parent)]:
                c = Path(os.path.normpath(d)) / name
                if c.is_file() and top in c.resolve().parents:
                    hit = c
                    break
            if hit is None:
                system.setdefault(name, str(f.relative_to(top)))
            else:
                todo.append(hit)
    for k in args.keep:
        p = top / k
        if p.is_dir():
            keep.update(q.resolve() for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            keep.add(p.resolve())
        else:
            print(f"slim: --keep {k} missing", file=sys.stderr)
            return 1
    removed = 0
    for p in sorted(top.rglob("*")):
        if p.is_file() and p.resolve() not in keep:
            removed += p.stat().st_size
            p.unlink()
    for p in sorted(top.rglob("*"), key=lambda q: -len(q.parts)):
        if p.is_dir() and not any(p.iterdir()):
            p.rmdir()
    kept = sum(p.stat().st_size for p in keep)
    for p in sorted(keep):
        print(f"  kept {p.stat().st_size:>11,}  {p.relative_to(top)}")
    print(f"slim: kept {len(keep)} files, {kept / 2**20:.1f} MiB; removed {removed / 2**20:.1f} MiB")
    print("slim: from the system: " + ", ".join(sorted(system)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
