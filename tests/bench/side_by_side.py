#!/usr/bin/env python3
"""Side-by-side benchmark: Debian's Linux under QEMU TCG (plain and with plugins) and under kpin.

Not a test: numbers for notes and docs (docs/benchmarks.md). A configuration is a kernel, a
command line and a runner; every run boots the same busybox initramfs (images/out/
initramfs.cpio) with the same memory and its default workload, and is timed from its start
to the console's `KPIN-WORKLOAD-DONE <md5>` line. Every run must print the same md5, or the
benchmark fails. Each round runs every configuration once, in the opposite order to the
round before, so that drift in the machine's load is shared.

    tests/bench/side_by_side.py [--rounds N] [--kernels 6.1,6.12,6.12-generic]
                                [--lines distro,kpin | --cmdline "..."] [--workload NAME]
                                [--configs qemu,null,bbcount,...] [--mem MIB]
                                [--timeout S] [--json FILE]

Kernels (`--kernels`, default `6.1`). QEMU boots each kernel's bzImage as Debian ships it
(its decompressor, KASLR); kpin boots the vmlinux the images crate took out of the same
bzImage's payload (no decompressor, so no KASLR), with its System.map when there is one.
  6.1           the pinned 6.1 cloud kernel, `6.1.0-56-cloud-amd64` (`kpin images`)
  6.12          the pinned 6.12 cloud kernel, `6.12.117+deb12-cloud-amd64`
  6.12-generic  Debian's generic (non-cloud) 6.12 kernel, `6.12.117+deb12-amd64`: same source
                and version as the cloud one, the configuration a PC install gets
                (`kpin_images::ensure_linux_generic_612`; no System.map)
A kernel missing from images/out/ is fetched first through the images crate (`cargo run
--release -p kpin-images --example ensure_images -- --all-kernels | --only-generic-612`):
pinned Debian packages checked against their SHA-256, cached under images/out/.

Command lines (`--lines`, default `distro,kpin`; both are reported, `distro` first):
  distro  `console=ttyS0 panic=-1`, read from vmm/src/guests.rs (LINUX_612_CMDLINE): Debian's
          own line reduced to the serial console, which the workload needs, plus panic=-1 so a
          panic ends the run. Nothing else: PCI and i8042 probing and the default mitigations
          as a user's distribution has them. The headline configuration.
  kpin    kpin's own LINUX_CMDLINE (vmm/src/guests.rs: the distribution's line plus
          `earlyprintk`), what `kpin run --guest linux` boots with.
`--cmdline "..."` replaces them with one line named `custom`. `--workload NAME` appends
`kpin.workload=NAME` to every line (without it /init runs its `default` workload).

Runners (`--configs`, default `qemu,null,bbcount`):
  qemu           Debian's qemu-system-x86_64 (7.2), `-accel tcg`, no plugin
  qemu+bbcount   the same with the shared bbcount plugin (../shared/bench/qemu-plugins,
                 `mode=inline`: two inline adds per executed block): kpin bbcount's baseline
  qemu+cachesim  the same with the shared cachesim plugin, L1I and L1D 16 KiB 8-way, L2 2 MiB
                 16-way, 64 B lines, LRU (kpin cachesim's geometry, passed explicitly); data
                 by guest-physical address, fetches by `iaddr=haddr` (the host pointer into
                 guest RAM, whose offset is the physical address below 3 GiB: kpin tags both
                 by physical address). An access touches only the line of its first byte:
                 kpin cachesim's baseline
  qemu+pa_cache  the same QEMU with the in-tree tests/bench/qemu-cache-plugin/pa_cache.c
                 (`qemu-cache` is an alias), kept as a cross-check of what is simulated, not
                 of speed: like kpin cachesim, an access that crosses a line touches each
                 line, and fetches are tagged by physical address; built by
                 `tests/bench/build-qemu-plugins.sh --pa-cache`
  anything else  a kpin tool: `target/release/kpin run --tool NAME` (null, bbcount, cachesim,
                 insmix, ...; cachesim with the geometry above)
The shared plugins are built, if missing, by tests/bench/build-qemu-plugins.sh (cargo into
~/.cache/kpin-qemu-plugins, or $KPIN_QEMU_PLUGINS_TARGET). The old `qemu-bb` runner (QEMU's
own tests/plugin/bb.c on a QEMU compiled from source) is gone: the shared bbcount plugin
counts the same way on Debian's QEMU, which loads plugins.

Every run reports its wall time to `KPIN-WORKLOAD-DONE` (the number compared), its wall time
to exit, and its CPU time: user + system of the child's whole process tree, all its threads
and reaped descendants (`os.wait4`), from start to exit. So the CPU column includes what
happens after the workload: the poweroff, and for kpin the drain of the tool's records and its
result files (for cachesim, the simulator thread's backlog). Compare CPU time with the wall
time to exit. Ratios are taken round by round against the runs of the same kernel and line in
the same round, and their median printed, for wall and CPU alike: against `qemu`, and for kpin
bbcount and cachesim against their plugin baselines (`qemu+bbcount`, `qemu+cachesim`, and
`qemu+pa_cache` when it ran). Each run's line also shows the 1-minute load average at its start:
on a shared machine, numbers from a loaded hour are not final.

Needs: `qemu-system-x86_64` (Debian's qemu-system-x86; on machines with a newer qemu-utils
install it with `apt-get install --allow-downgrades --no-install-recommends qemu-system-x86
'qemu-utils=1:7.2*'`), the guest images (`kpin images`), cargo (for the plugins and images
above) and a release build of kpin (`cargo build --release -p vmm`).
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(ROOT, "images", "out")
DONE = re.compile(rb"KPIN-WORKLOAD-DONE ([0-9a-f]{32})")
USERSPACE = b"KPIN-USERSPACE-OK"
KPIN = os.path.join(ROOT, "target", "release", "kpin")

# name -> (the constant in images/src/pins.rs naming its release, ensure_images argument)
KERNELS = {
    "6.1": ("DEBIAN_6_1", []),
    "6.12": ("DEBIAN_6_12", ["--all-kernels"]),
    "6.12-generic": ("DEBIAN_6_12_GENERIC", ["--only-generic-612"]),
}
# name -> the constant in vmm/src/guests.rs
LINES = {"distro": "LINUX_612_CMDLINE", "kpin": "LINUX_CMDLINE"}

# The cache geometry every cache simulator runs with (issue #13's, kpin cachesim's).
CACHESIM_OPTIONS = ["L1I_size=16K", "L1D_size=16K", "LL_size=2M"]
SHARED_CACHESIM_ARGS = ("icachesize=16384,iassoc=8,iblksize=64,dcachesize=16384,dassoc=8,"
                        "dblksize=64,l2cachesize=2097152,l2assoc=16,l2blksize=64,iaddr=haddr")
TOOL_OPTIONS = {"cachesim": CACHESIM_OPTIONS}

PLUGIN_TARGET = os.environ.get("KPIN_QEMU_PLUGINS_TARGET",
                               os.path.join(os.path.expanduser("~"), ".cache", "kpin-qemu-plugins"))
SHARED_PLUGINS = {
    "qemu+bbcount": os.path.join(PLUGIN_TARGET, "release", "libbbcount.so"),
    "qemu+cachesim": os.path.join(PLUGIN_TARGET, "release", "libcachesim.so"),
}
PA_CACHE = os.path.join(OUT, "qemu-plugins", "plugins", "libpa_cache.so")
ALIASES = {"qemu-cache": "qemu+pa_cache"}
NAMES = {
    "qemu": "QEMU TCG",
    "qemu+bbcount": "QEMU TCG + bbcount plugin",
    "qemu+cachesim": "QEMU TCG + cachesim plugin",
    "qemu+pa_cache": "QEMU TCG + pa_cache plugin",
}
# kpin tool -> the QEMU runners it is measured against besides plain QEMU.
BASELINES = {"bbcount": ["qemu+bbcount"], "cachesim": ["qemu+cachesim", "qemu+pa_cache"]}


def rust_str_const(path, name):
    """The value of `pub const NAME: &str = "...";` in a Rust source file."""
    src = open(os.path.join(ROOT, path)).read()
    m = re.search(r'pub const ' + name + r': &str = "((?:[^"\\]|\\.|\\\n)*)";', src)
    if not m:
        sys.exit(f"side_by_side: cannot find {name} in {path}")
    # Rust string continuation: a backslash-newline skips the newline and leading spaces.
    return re.sub(r"\\\n\s*", "", m.group(1))


def kernel_release(name):
    """The release of kernel `name` (`uname -r`), from its pin in images/src/pins.rs."""
    const = KERNELS[name][0]
    src = open(os.path.join(ROOT, "images", "src", "pins.rs")).read()
    m = re.search(r"const " + const + r': \w+ = (?:\w+!? )?\{\s*release: "([^"]+)"', src)
    if not m:
        sys.exit(f"side_by_side: cannot find {const}'s release in images/src/pins.rs")
    return m.group(1)


def kernel_images(name):
    """The files of kernel `name`, fetched through the images crate if any is missing."""
    d = os.path.join(OUT, "linux-" + kernel_release(name))
    img = {
        "bzimage": os.path.join(d, "vmlinuz"),
        "vmlinux": os.path.join(d, "vmlinux"),
        "system_map": os.path.join(d, "System.map"),
        "initramfs": os.path.join(OUT, "initramfs.cpio"),
    }
    if not all(os.path.isfile(img[k]) for k in ("bzimage", "vmlinux", "initramfs")):
        argv = ["cargo", "run", "--release", "-q", "-p", "kpin-images", "--example",
                "ensure_images", "--"] + KERNELS[name][1]
        print(f"kernel {name}: fetching with `{' '.join(argv)}`", flush=True)
        if subprocess.run(argv, cwd=ROOT).returncode != 0:
            sys.exit(f"side_by_side: could not fetch kernel {name}")
    if not os.path.isfile(img["system_map"]):
        img["system_map"] = None
    return img


def timed_run(argv, timeout):
    """Runs argv in a session of its own, streaming its output. Returns the seconds from the
    start to `KPIN-USERSPACE-OK`, to `KPIN-WORKLOAD-DONE` and to exit, the CPU seconds (user,
    system) of its process tree, and the md5; exits on a timeout or a missing DONE line."""
    start = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    lock = threading.Lock()
    reaped = False

    def kill():
        with lock:
            if not reaped:
                os.killpg(p.pid, signal.SIGKILL)

    timer = threading.Timer(timeout, kill)
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
        # Wait without reaping, so that the timer can never signal a reused pid, then reap
        # with wait4 for the tree's CPU time (the child's threads and reaped descendants).
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
        exited = time.monotonic() - start
        with lock:
            reaped = True
        _, status, ru = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
    finally:
        timer.cancel()
        p.stdout.close()
        if p.returncode is None:
            with lock:
                if not reaped:
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if done is None:
        sys.exit(
            "side_by_side: no KPIN-WORKLOAD-DONE (exit status " + str(p.returncode) + ") from:\n  "
            + " ".join(argv) + "\n" + b"".join(tail).decode(errors="replace")
        )
    return {"userspace_s": user, "done_s": done, "exit_s": exited,
            "cpu_user_s": ru.ru_utime, "cpu_sys_s": ru.ru_stime,
            "cpu_s": ru.ru_utime + ru.ru_stime}, md5


def qemu_argv(img, cmdline, mem):
    return [
        "qemu-system-x86_64", "-accel", "tcg", "-m", str(mem), "-nographic", "-nodefaults",
        "-no-reboot", "-serial", "stdio", "-monitor", "none",
        "-kernel", img["bzimage"], "-initrd", img["initramfs"], "-append", cmdline,
    ]


def runner_argv(c, img, cmdline, mem, out):
    if c == "qemu":
        return qemu_argv(img, cmdline, mem)
    if c == "qemu+bbcount":
        return qemu_argv(img, cmdline, mem) + [
            "-plugin", f"{SHARED_PLUGINS[c]},mode=inline,out={out}"]
    if c == "qemu+cachesim":
        return qemu_argv(img, cmdline, mem) + [
            "-plugin", f"{SHARED_PLUGINS[c]},{SHARED_CACHESIM_ARGS},out={out}"]
    if c == "qemu+pa_cache":
        return qemu_argv(img, cmdline, mem) + ["-plugin", f"{PA_CACHE},ram={mem},out={out}"]
    argv = [KPIN, "run", "--kernel", img["vmlinux"], "--initrd", img["initramfs"],
            "--cmdline", cmdline, "--mem", str(mem), "--tool", c, "--out", out,
            "--timeout", "0"]
    if img["system_map"]:
        argv += ["--system-map", img["system_map"]]
    return argv + [a for o in TOOL_OPTIONS.get(c, []) for a in ("--tool-option", o)]


def simulated_refs(c, out):
    """References a cache-simulating run simulated (None for other runners)."""
    try:
        if c == "qemu+pa_cache":
            m = re.search(r"pa_cache refs=(\d+)", open(out).read())
            return int(m.group(1)) if m else None
        if c == "qemu+cachesim":
            t = open(out).read()
            a = [int(x) for x in re.findall(r"^cachesim: L1[ID]\s+(\d+)", t, re.M)]
            return sum(a) if len(a) == 2 else None
        if c == "cachesim":
            t = open(os.path.join(out, "cachesim-counters.txt")).read()
            m = re.search(r"^refs fetch_kernel=(\d+) fetch_user=(\d+) data_kernel=(\d+) data_user=(\d+)", t, re.M)
            return sum(int(x) for x in m.groups()) if m else None
    except OSError:
        return None
    return None


def ensure_shared_plugins(runners):
    if any(c in SHARED_PLUGINS and not os.path.isfile(SHARED_PLUGINS[c]) for c in runners):
        print("building the shared QEMU plugins: tests/bench/build-qemu-plugins.sh", flush=True)
        if subprocess.run(["bash", os.path.join(HERE, "build-qemu-plugins.sh")]).returncode != 0:
            sys.exit("side_by_side: could not build the shared QEMU plugins")
    if "qemu+pa_cache" in runners and not os.path.isfile(PA_CACHE):
        sys.exit("side_by_side: no pa_cache plugin: run tests/bench/build-qemu-plugins.sh --pa-cache")


def label(c):
    return NAMES.get(c, f"kpin --tool {c}")


def git_describe():
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + (" (work tree modified)" if dirty else "")
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mem", type=int, default=256)
    ap.add_argument("--kernels", default="6.1", help="comma-separated: " + ", ".join(KERNELS))
    ap.add_argument("--lines", default="distro,kpin",
                    help="comma-separated command lines: distro (console=ttyS0 panic=-1), "
                    "kpin (kpin's LINUX_CMDLINE)")
    ap.add_argument("--cmdline", default=None,
                    help="one command line of your own instead of --lines (named `custom`)")
    ap.add_argument("--workload", default=None, help="append kpin.workload=NAME to every line")
    ap.add_argument("--configs", default="qemu,null,bbcount",
                    help="comma-separated runners: qemu, qemu+bbcount, qemu+cachesim, "
                    "qemu+pa_cache, and kpin tools by name (null, bbcount, cachesim, ...)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", default=None, help="also write every run's numbers here")
    args = ap.parse_args()

    kernels = [k for k in args.kernels.split(",") if k]
    for k in kernels:
        if k not in KERNELS:
            sys.exit(f"side_by_side: unknown kernel {k!r} (known: {', '.join(KERNELS)})")
    if args.cmdline is not None:
        lines = {"custom": args.cmdline}
    else:
        lines = {}
        for name in [x for x in args.lines.split(",") if x]:
            if name not in LINES:
                sys.exit(f"side_by_side: unknown line {name!r} (known: {', '.join(LINES)})")
            lines[name] = rust_str_const(os.path.join("vmm", "src", "guests.rs"), LINES[name])
    if args.workload:
        lines = {n: f"{l} kpin.workload={args.workload}" for n, l in lines.items()}
    runners = []
    for c in [x for x in args.configs.split(",") if x]:
        if c == "qemu-bb":
            sys.exit("side_by_side: qemu-bb (QEMU's bb.c on a source-built QEMU) is gone: "
                     "use qemu+bbcount, the shared plugin on Debian's QEMU")
        c = ALIASES.get(c, c)
        if c.startswith("qemu") and c != "qemu" and c not in SHARED_PLUGINS and c != "qemu+pa_cache":
            sys.exit(f"side_by_side: unknown QEMU runner {c!r}")
        if c not in runners:
            runners.append(c)

    if any(c.startswith("qemu") for c in runners) and not shutil.which("qemu-system-x86_64"):
        sys.exit("side_by_side: qemu-system-x86_64 not found (see the docstring)")
    if any(not c.startswith("qemu") for c in runners) and not os.access(KPIN, os.X_OK):
        sys.exit("side_by_side: target/release/kpin not found: cargo build --release -p vmm")
    ensure_shared_plugins(runners)
    imgs = {k: kernel_images(k) for k in kernels}
    if any(not c.startswith("qemu") for c in runners):
        # `kpin run` rebuilds the engine image when the working tree changed it: build it
        # now, so that no round's time includes a compile (a first round of 12-13 s).
        if subprocess.run([KPIN, "images"], stdout=subprocess.DEVNULL).returncode != 0:
            sys.exit("side_by_side: `kpin images` failed (its message is above)")

    qemu_version = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                                  text=True).stdout.split("\n")[0] if shutil.which("qemu-system-x86_64") else "-"
    print(f"kpin: {git_describe()}; {qemu_version}")
    for k in kernels:
        print(f"kernel {k}: {kernel_release(k)}")
    for n, l in lines.items():
        print(f"line {n}: {l}")
    print(f"mem: {args.mem} MiB, rounds: {args.rounds}, runners: {runners}", flush=True)

    configs = [(k, n, c) for k in kernels for n in lines for c in runners]
    runs = {cfg: [] for cfg in configs}
    md5s = set()
    scratch = tempfile.mkdtemp(prefix="kpin-bench-")
    try:
        for r in range(args.rounds):
            # Alternate the order every round so that drift in the machine's load is shared.
            order = configs if r % 2 == 0 else list(reversed(configs))
            for i, (k, n, c) in enumerate(order):
                out = os.path.join(scratch, f"{r}-{i}")
                load = os.getloadavg()[0]
                argv = runner_argv(c, imgs[k], lines[n], args.mem, out)
                t, md5 = timed_run(argv, args.timeout)
                md5s.add(md5)
                t["load1"] = load
                refs = simulated_refs(c, out)
                extra = ""
                if refs:
                    t.update({"refs": refs, "refs_per_s": refs / t["exit_s"]})
                    extra = f", {refs / t['exit_s'] / 1e6:.1f} M refs/s simulated"
                runs[(k, n, c)].append(t)
                us = f"{t['userspace_s']:6.2f} s" if t["userspace_s"] is not None else "     - "
                print(f"round {r + 1} {k:>12} {n:>6} {c:>13}: userspace {us}, done {t['done_s']:6.2f} s, "
                      f"exit {t['exit_s']:6.2f} s, CPU {t['cpu_s']:6.2f} s "
                      f"(user {t['cpu_user_s']:.2f} + sys {t['cpu_sys_s']:.2f}), load {load:.1f}, "
                      f"md5 {md5}{extra}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if len(md5s) != 1:
        sys.exit(f"side_by_side: the runs disagree on the workload md5: {sorted(md5s)}")

    # Ratios are taken round by round (each run against the baseline's run of the same
    # kernel, line and round, which ran next to it) and their median printed: on a shared
    # machine the load moves whole rounds, and a ratio of medians would mix rounds.
    def ratio(k, n, c, base, key):
        if (k, n, base) not in runs or c == base:
            return None
        return statistics.median(t[key] / b[key] for t, b in zip(runs[(k, n, c)], runs[(k, n, base)]))

    def fmt_ratio(x):
        return "-" if x is None else f"{x:.2f}x"

    def baselines(k, n, c):
        return [b for b in BASELINES.get(c, []) if (k, n, b) in runs]

    for k in kernels:
        for n in lines:
            print(f"\n{k} ({kernel_release(k)}), line {n} (`{lines[n]}`): wall = start to "
                  "KPIN-WORKLOAD-DONE, CPU = user + sys, start to exit")
            print("| run | wall per round | wall median | CPU per round | CPU median "
                  "| wall / QEMU | CPU / QEMU | wall / plugin baseline | CPU / plugin baseline |")
            print("|---|---|---:|---|---:|---:|---:|---:|---:|")
            for c in runners:
                ts = runs[(k, n, c)]
                wall = [t["done_s"] for t in ts]
                cpu = [t["cpu_s"] for t in ts]
                bases = baselines(k, n, c)
                bw = ", ".join(f"{fmt_ratio(ratio(k, n, c, b, 'done_s'))} ({b})" for b in bases) or "-"
                bc = ", ".join(f"{fmt_ratio(ratio(k, n, c, b, 'cpu_s'))} ({b})" for b in bases) or "-"
                print(f"| {label(c)} | " + ", ".join(f"{x:.2f}" for x in wall)
                      + f" s | {statistics.median(wall):.2f} s | "
                      + ", ".join(f"{x:.2f}" for x in cpu) + f" s | {statistics.median(cpu):.2f} s | "
                      + f"{fmt_ratio(ratio(k, n, c, 'qemu', 'done_s'))} | "
                      + f"{fmt_ratio(ratio(k, n, c, 'qemu', 'cpu_s'))} | {bw} | {bc} |")
            for c in runners:
                rates = [t["refs_per_s"] for t in runs[(k, n, c)] if "refs_per_s" in t]
                if rates:
                    refs = statistics.median(t["refs"] for t in runs[(k, n, c)] if "refs" in t)
                    print(f"{c}: median {statistics.median(rates) / 1e6:.1f} M simulated refs/s "
                          f"to exit ({refs:,} refs)")

    # One summary: each kpin runner's wall (CPU) ratio to QEMU and to its plugin baseline,
    # per kernel and line.
    groups = [(k, n) for k in kernels for n in lines]
    kpin_runners = [c for c in runners if not c.startswith("qemu")]
    if "qemu" in runners and kpin_runners:
        print("\nSummary: median per-round ratio, wall (CPU)")
        print("| run | " + " | ".join(f"{k}, {n}" for k, n in groups) + " |")
        print("|---|" + "---:|" * len(groups))
        for c in kpin_runners:
            for base in ["qemu"] + BASELINES.get(c, []):
                if base not in runners:
                    continue
                cells = [f"{fmt_ratio(ratio(k, n, c, base, 'done_s'))} "
                         f"({fmt_ratio(ratio(k, n, c, base, 'cpu_s'))})" for k, n in groups]
                print(f"| {label(c)} / {label(base)} | " + " | ".join(cells) + " |")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "kpin": git_describe(), "qemu": qemu_version, "mem_mib": args.mem,
                "md5": next(iter(md5s)),
                "kernels": {k: kernel_release(k) for k in kernels}, "lines": lines,
                "runs": [{"kernel": k, "line": n, "runner": c, "rounds": runs[(k, n, c)]}
                         for (k, n, c) in configs],
            }, f, indent=2)


if __name__ == "__main__":
    main()
