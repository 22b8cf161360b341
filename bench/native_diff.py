"""Machine code of two builds of the native library, function by function (addresses and symbol names normalised).

A reorganisation of engine/native that must not change a kernel shows up here as the same instructions: the
check covers the instruction-set forms a host cannot run (an AVX512 kernel on a CPU without AVX512), which the
bit-identity of outputs (bench/identity.py) can only test for the forms the host runs.

    python bench/native_diff.py OLD.so NEW.so [--rename old=new ...] [--out bench/results/native_diff.json]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path


def functions(so: Path) -> dict[str, list[str]]:
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                         check=True).stdout
    fs: dict[str, list[str]] = {}
    cur = None
    for line in out.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if m:
            cur = m.group(1)
            fs[cur] = []
        elif cur and "\t" in line:
            ins = re.sub(r"0x[0-9a-f]+|\b[0-9a-f]{4,}\b", "ADDR", line.split("\t", 1)[1])
            fs[cur].append(re.sub(r"<[^>]+>", "<SYM>", ins))
    return {n: b for n, b in fs.items() if not n.startswith(("_", "deregister", "register", "frame_dummy"))
            and "@plt" not in n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rename", nargs="*", default=[], help="old=new function names")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ren = dict(r.split("=", 1) for r in args.rename)
    a, b = functions(args.old), functions(args.new)
    same, different, missing = [], {}, []
    for name, body in sorted(a.items()):
        base, _, suffix = name.partition(".")
        new = ren.get(base, base) + ("." + suffix if suffix else "")
        if new not in b:
            missing.append(name)
        elif body == b[new]:
            same.append(name)
        else:
            different[name] = f"{len(body)} -> {len(b[new])} instructions"
    for n, d in different.items():
        print(f"different  {n}: {d}")
    for n in missing:
        print(f"not in new {n}")
    print(f"same {len(same)}, different {len(different)}, not in new {len(missing)}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["python", "bench/native_diff.py", *sys.argv[1:]]),
                                        "same": same, "different": different, "not_in_new": missing,
                                        "new_only": sorted(set(b) - {ren.get(n.partition(".")[0], n.partition(".")[0])
                                                                     + n[len(n.partition(".")[0]):] for n in a})},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
