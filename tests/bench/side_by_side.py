#!/usr/bin/env python3
"""Side-by-side benchmark: the pinned Linux guest under QEMU TCG and under kpin.

Runs the same kernel (the pinned bzImage for QEMU, its vmlinux for kpin), the same busybox
initramfs, the same command line and the same memory under each configuration, alternating
configurations within every round, and prints each run's time from start to the console's
`KPIN-WORKLOAD-DONE <md5>` line, the medians and the ratios (median of per-round ratios) against QEMU TCG. Every run must
print the same workload md5, or the benchmark fails. Not a test: numbers for notes and docs.

    tests/bench/side_by_side.py [--rounds N] [--mem MIB] [--configs qemu,null,bbcount]
                                [--cmdline "..."] [--timeout S] [--json FILE]

Block counting side by side: `--configs qemu-bb,bbcount` runs the plugin-enabled QEMU with its
own tests/plugin/bb.c (`inline=on`: block and instruction totals added by inline TCG ops)
against kpin's per-block `--tool bbcount`.

Cache simulation side by side: `--configs qemu-cache,cachesim` runs QEMU (built with the
plugin API by tests/bench/build-qemu-plugins.sh) with our PA-tagged cache plugin
(tests/bench/qemu-cache-plugin/pa_cache.c) and kpin's `--tool cachesim`, both with L1I/L1D
16K 8-way, LL 2M 16-way, 64 B lines, LRU, and prints simulated references per second.

Needs: `qemu-system-x86_64` (Debian's qemu-system-x86; on machines with a newer qemu-utils
install it with `apt-get install --allow-downgrades --no-install-recommends qemu-system-x86
'qemu-utils=1:7.2*'`), the guest images (`kpin images`) and a release build of kpin
(`cargo build --release -p vmm`). The command line defaults to kpin's built-in
`LINUX_CMDLINE` (read from vmm/src/guests.rs), passed explicitly to both sides.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DONE = re.compile(rb"KPIN-WORKLOAD-DONE ([0-9a-f]{32})")
USERSPACE = b"KPIN-USERSPACE-OK"


def builtin_cmdline():
    """kpin's LINUX_CMDLINE, read from its one definition."""
    src = open(os.path.join(ROOT, "vmm", "src", "guests.rs")).read()
    m = re.search(r'pub const LINUX_CMDLINE: &str = "((?:[^"\\]|\\.|\\\n)*)";', src)
    if not m:
        sys.exit("side_by_side: cannot find LINUX_CMDLINE in vmm/src/guests.rs")
    # Rust string continuation: a backslash-newline skips the newline and leading spaces.
    return re.sub(r"\\\n\s*", "", m.group(1))


def images():
    d = os.path.join(ROOT, "images", "out")
    kdirs = sorted(x for x in os.listdir(d) if x.startswith("linux-")) if os.path.isdir(d) else []
    if not kdirs:
        sys.exit("side_by_side: no guest images in images/out: run `kpin images` first")
    k = os.path.join(d, kdirs[0])
    return {
        "bzimage": os.path.join(k, "vmlinuz"),
        "vmlinux": os.path.join(k, "vmlinux"),
        "initramfs": os.path.join(d, "initramfs.cpio"),
    }


def timed_run(argv, timeout):
    """Runs argv, streaming its output; returns (seconds to userspace, seconds to DONE,
    md5) measured from the start, or raises on timeout or a missing DONE line."""
    start = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    user = done = md5 = None
    tail = []
    try:
        for line in p.stdout:
            now = time.monotonic() - start
            tail = (tail + [line])[-20:]
            if user is None and USERSPACE in line:
                user = now
            m = DONE.search(line)
            if m and done is None:
                done, md5 = now, m.group(1).decode()
        p.wait()
    finally:
        timer.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
    if done is None:
        sys.exit(
            "side_by_side: no KPIN-WORKLOAD-DONE from:\n  " + " ".join(argv) + "\n"
            + b"".join(tail).decode(errors="replace")
        )
    return user, done, md5


def qemu_argv(img, cmdline, mem):
    return [
        "qemu-system-x86_64", "-accel", "tcg", "-m", str(mem), "-nographic", "-nodefaults",
        "-no-reboot", "-serial", "stdio", "-monitor", "none",
        "-kernel", img["bzimage"], "-initrd", img["initramfs"], "-append", cmdline,
    ]


def kpin_argv(img, cmdline, mem, tool, out):
    return [
        os.path.join(ROOT, "target", "release", "kpin"), "run",
        "--kernel", img["vmlinux"], "--initrd", img["initramfs"],
        "--cmdline", cmdline, "--mem", str(mem), "--tool", tool, "--out", out,
        "--timeout", "0",
    ] + [a for o in TOOL_OPTIONS.get(tool, []) for a in ("--tool-option", o)]


# The cache geometry both cache simulators run with (the issue's).
TOOL_OPTIONS = {"cachesim": ["L1I_size=16K", "L1D_size=16K", "LL_size=2M"]}
QEMU_PLUGINS = os.path.join(ROOT, "images", "out", "qemu-plugins")


def qemu_cache_argv(img, cmdline, mem, out):
    argv = qemu_argv(img, cmdline, mem)
    argv[0] = os.path.join(QEMU_PLUGINS, "bin", "qemu-system-x86_64")
    plugin = os.path.join(QEMU_PLUGINS, "plugins", "libpa_cache.so")
    return argv + ["-L", os.path.join(QEMU_PLUGINS, "pc-bios"),
                   "-plugin", f"{plugin},ram={mem},out={out}"]


def qemu_bb_argv(img, cmdline, mem):
    """QEMU (the plugin build) with its own tests/plugin/bb.c counting blocks and
    instructions inline: the counterpart of kpin's bbcount."""
    argv = qemu_argv(img, cmdline, mem)
    argv[0] = os.path.join(QEMU_PLUGINS, "bin", "qemu-system-x86_64")
    plugin = os.path.join(QEMU_PLUGINS, "plugins", "libbb.so")
    return argv + ["-L", os.path.join(QEMU_PLUGINS, "pc-bios"), "-plugin", f"{plugin},inline=on"]


def simulated_refs(c, out):
    """References a cache-simulating run simulated (None for other configs)."""
    try:
        if c == "qemu-cache":
            m = re.search(r"pa_cache refs=(\d+)", open(out).read())
            return int(m.group(1)) if m else None
        if c == "cachesim":
            t = open(os.path.join(out, "cachesim-counters.txt")).read()
            m = re.search(r"^refs fetch_kernel=(\d+) fetch_user=(\d+) data_kernel=(\d+) data_user=(\d+)", t, re.M)
            return sum(int(x) for x in m.groups()) if m else None
    except OSError:
        return None
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem", type=int, default=256)
    ap.add_argument("--configs", default="qemu,null,bbcount",
                    help="comma-separated: qemu (TCG, no plugin), qemu-bb (QEMU's bb plugin, "
                    "inline), qemu-cache (our PA cache plugin) and kpin tools by name")
    ap.add_argument("--cmdline", default=None)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None, help="also write the raw times here")
    args = ap.parse_args()

    cmdline = args.cmdline or builtin_cmdline()
    img = images()
    configs = [c for c in args.configs.split(",") if c]
    if {"qemu-cache", "qemu-bb"} & set(configs) and not os.access(qemu_cache_argv(img, "", 0, "")[0], os.X_OK):
        sys.exit("side_by_side: no QEMU with plugins: run tests/bench/build-qemu-plugins.sh")
    if "qemu" in configs and not shutil.which("qemu-system-x86_64"):
        sys.exit("side_by_side: qemu-system-x86_64 not found (see the docstring)")
    if any(not c.startswith("qemu") for c in configs) and not os.access(kpin_argv(img, "", 0, "", "")[0], os.X_OK):
        sys.exit("side_by_side: target/release/kpin not found: cargo build --release -p vmm")
    print(f"cmdline: {cmdline}\nmem: {args.mem} MiB, rounds: {args.rounds}, configs: {configs}")

    times = {c: [] for c in configs}
    md5s = set()
    scratch = tempfile.mkdtemp(prefix="kpin-bench-")
    for r in range(args.rounds):
        # Alternate the order every round so that drift in the machine's load is shared.
        order = configs if r % 2 == 0 else list(reversed(configs))
        for c in order:
            out = os.path.join(scratch, f"{c}-{r}")
            if c == "qemu":
                argv = qemu_argv(img, cmdline, args.mem)
            elif c == "qemu-cache":
                argv = qemu_cache_argv(img, cmdline, args.mem, out)
            elif c == "qemu-bb":
                argv = qemu_bb_argv(img, cmdline, args.mem)
            else:
                argv = kpin_argv(img, cmdline, args.mem, c, out)
            t0 = time.monotonic()
            user, done, md5 = timed_run(argv, args.timeout)
            wall = time.monotonic() - t0
            md5s.add(md5)
            times[c].append({"userspace_s": user, "done_s": done})
            refs = simulated_refs(c, out)
            extra = ""
            if refs:
                times[c][-1].update({"wall_s": wall, "refs": refs, "refs_per_s": refs / wall})
                extra = f", {refs:,} refs simulated in {wall:.2f} s: {refs / wall / 1e6:.1f} M refs/s"
            print(f"round {r + 1} {c:>8}: userspace {user:6.2f} s, workload done {done:6.2f} s, md5 {md5}{extra}")
            sys.stdout.flush()
    shutil.rmtree(scratch, ignore_errors=True)
    if len(md5s) != 1:
        sys.exit(f"side_by_side: the runs disagree on the workload md5: {sorted(md5s)}")

    # Ratios are taken round by round (each kpin run against the QEMU run of the same
    # round, which ran next to it) and their median printed: on a shared machine the load
    # moves whole rounds, and a ratio of medians would mix rounds.
    def ratio(c, base):
        if base not in times or c == base:
            return "-"
        r = [t["done_s"] / b["done_s"] for t, b in zip(times[c], times[base])]
        return f"{statistics.median(r):.2f}x"

    counterpart = {"bbcount": "qemu-bb", "cachesim": "qemu-cache"}
    print("\n| run | " + " | ".join(f"round {i + 1}" for i in range(args.rounds))
          + " | median | ratio to QEMU TCG | ratio to its QEMU plugin counterpart |")
    print("|---|" + "---:|" * (args.rounds + 3))
    for c in configs:
        d = [t["done_s"] for t in times[c]]
        med = statistics.median(d)
        name = {"qemu": "QEMU TCG", "qemu-cache": "QEMU TCG + pa_cache plugin",
                "qemu-bb": "QEMU TCG + bb plugin (inline)"}.get(c, f"kpin --tool {c}")
        other = ratio(c, counterpart[c]) if c in counterpart else "-"
        print(f"| {name} | " + " | ".join(f"{x:.2f} s" for x in d)
              + f" | {med:.2f} s | {ratio(c, 'qemu')} | {other} |")
    for c in configs:
        rates = [t["refs_per_s"] for t in times[c] if "refs_per_s" in t]
        if rates:
            print(f"{c}: median {statistics.median(rates) / 1e6:.1f} M simulated refs/s "
                  f"({statistics.median(t['refs'] for t in times[c] if 'refs' in t):,} refs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cmdline": cmdline, "mem_mib": args.mem, "md5": md5s.pop(), "times": times}, f, indent=2)


if __name__ == "__main__":
    main()
