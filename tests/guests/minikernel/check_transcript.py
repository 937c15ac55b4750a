#!/usr/bin/env python3
"""Compares a mini-kernel run with expected.txt.

    check_transcript.py ACTUAL --vendor V --max-basic-leaf N [--skip LIST] [--expected PATH]

V and N are what the guest's CPUID reports on this host (leaf 0: the vendor string and
EAX); expected.txt holds them as {vendor} and {max_basic_leaf}.

ACTUAL is the run's console output (`kpin run` stdout or <out>/console.log); lines before
`MINIKERNEL-START` and after `MINIKERNEL-DONE` (the VMM's own messages) are ignored.
LIST is what was passed as `kpin.skip=` (comma-separated step names, `native-unsafe` meaning
every step marked `native_unsafe: true` in src/steps/mod.rs); default: nothing skipped.

The run passes iff
1. it has a START line, a DONE line and no MINIKERNEL-PANIC line;
2. its DONE checksum is the FNV-1a 64 of exactly the bytes printed between the two lines;
3. those lines equal expected.txt's with each skipped step's line replaced by
   `step NN name: SKIPPED` (the expected checksum is recomputed over the result).
Exit status 0 on a pass, 1 on a failure (with a diff), 2 on bad usage.
"""
import argparse
import difflib
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
M64 = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    x = 0xCBF29CE484222325
    for b in data:
        x = ((x ^ b) * 0x100000001B3) & M64
    return x


def native_unsafe_steps():
    with open(os.path.join(HERE, "src", "steps", "mod.rs")) as f:
        src = f.read()
    return set(re.findall(r'name: "([^"]+)",\s*native_unsafe: true', src))


def split_transcript(text):
    """(body lines, checksum string) or raises ValueError."""
    lines = text.splitlines()
    try:
        start = lines.index("MINIKERNEL-START")
    except ValueError:
        raise ValueError("no MINIKERNEL-START line")
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("MINIKERNEL-PANIC"):
            raise ValueError(f"kernel panic: {lines[i]}")
        if lines[i].startswith("MINIKERNEL-DONE "):
            return lines[start + 1:i], lines[i][len("MINIKERNEL-DONE "):]
    raise ValueError("no MINIKERNEL-DONE line")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("actual")
    ap.add_argument("--skip", default="")
    ap.add_argument("--expected", default=os.path.join(HERE, "expected.txt"))
    ap.add_argument("--vendor", required=True, help="the guest's CPUID vendor, e.g. AuthenticAMD")
    ap.add_argument("--max-basic-leaf", required=True, help="the guest's CPUID max basic leaf, e.g. 0x10")
    args = ap.parse_args()

    skipped = set()
    for item in filter(None, args.skip.split(",")):
        skipped |= native_unsafe_steps() if item == "native-unsafe" else {item}

    with open(args.expected) as f:
        template = f.read().replace("{vendor}", args.vendor)
        exp_body, _ = split_transcript(template.replace("{max_basic_leaf}", args.max_basic_leaf))
    with open(args.actual, errors="replace") as f:
        try:
            act_body, act_sum = split_transcript(f.read())
        except ValueError as e:
            print(f"check_transcript: FAIL: {e}")
            return 1

    want = []
    for line in exp_body:
        m = re.match(r"(step \d\d ([^:]+)): ", line)
        want.append(f"{m.group(1)}: SKIPPED" if m and m.group(2) in skipped else line)

    ok = True
    recomputed = fnv1a64("".join(l + "\n" for l in act_body).encode())
    if act_sum != f"{recomputed:016x}":
        print(f"check_transcript: FAIL: DONE checksum {act_sum} != {recomputed:016x} over the printed lines")
        ok = False
    if act_body != want:
        print("check_transcript: FAIL: transcript differs from expected (- expected, + actual):")
        for d in difflib.unified_diff(want, act_body, "expected", "actual", lineterm="", n=0):
            print("  " + d)
        ok = False
    if ok:
        want_sum = fnv1a64("".join(l + "\n" for l in want).encode())
        n_skipped = sum(1 for line in want if line.endswith(": SKIPPED"))
        print(f"check_transcript: ok ({len(act_body)} lines, {n_skipped} skipped, checksum {want_sum:016x})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
