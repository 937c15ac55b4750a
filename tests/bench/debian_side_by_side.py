#!/usr/bin/env python3
"""Side-by-side benchmark of the Debian guest (issue #26): the bookworm disk image booted to
`multi-user.target`, its workload (python3, gcc, sqlite3, a disk read after a cache drop)
and `systemctl poweroff`, under QEMU TCG and under `kpin run --guest debian --tool …`.

Not a test: numbers for notes and docs (docs/benchmarks.md). Both sides get the same
kernel (the pinned 6.1 or 6.12 cloud kernel; QEMU its bzImage, kpin the vmlinux taken out
of it), the same initrd, a fresh sparse copy of the same disk image over virtio-blk on
virtio-mmio (QEMU's `microvm` machine; kpin's own virtio-mmio devices), a virtio-rng, the
same memory and the same command line: kpin's DEBIAN_CMDLINE (vmm/src/guests.rs) plus
`tsc_early_khz=2000000`, which QEMU's microvm needs (TCG offers it no way to calibrate the
TSC) and which kpin is given too so that both kernels skip the same calibration. Each round
runs every configuration once, in the opposite order to the round before.

    tests/bench/debian_side_by_side.py [--rounds N] [--kernel 6.1|6.12]
                                       [--configs qemu,null,...] [--mem MIB] [--json FILE]

Every run is timed from its start to the console's `KPIN-DEBIAN-MULTIUSER` and
`KPIN-WORKLOAD-DONE <md5>` lines and to its exit, with the CPU time of its process tree
(os.wait4). kpin copies the disk into its output directory itself (`debian-disk.img`),
inside its timed run; QEMU's copy is made before its clock starts, so the kpin times
include a cost QEMU's do not. Every run must print the image's expected md5, or the
benchmark fails. For each kpin run the engine's profile (`profile.txt`: where
its cycles went) is kept in the output directory and its first lines printed.

Needs the Debian image (`target/release/kpin images --debian`: root, mmdebstrap),
Debian's `qemu-system-x86_64` and a release build of kpin.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import side_by_side as sbs  # noqa: E402  (the shared runner and the kernel table)

DEBIAN = os.path.join(sbs.OUT, "debian-bookworm")
MULTIUSER = b"KPIN-DEBIAN-MULTIUSER"
TSC = "tsc_early_khz=2000000"


def debian_cmdline():
    return sbs.rust_str_const(os.path.join(sbs.ROOT, "vmm", "src", "guests.rs"),
                              "DEBIAN_CMDLINE") + " " + TSC


def fresh_disk(scratch):
    path = os.path.join(scratch, "disk.img")
    if os.path.exists(path):
        os.unlink(path)
    subprocess.run(["cp", "--sparse=always", "--reflink=auto",
                    os.path.join(DEBIAN, "disk.img"), path], check=True)
    return path


def qemu_argv(kernel, initrd, disk, cmdline, mem):
    return [
        "qemu-system-x86_64", "-accel", "tcg", "-M", "microvm,acpi=on,pit=on,pic=on,rtc=on",
        "-m", str(mem), "-smp", "1", "-nographic", "-no-reboot",
        "-kernel", kernel, "-initrd", initrd, "-append", cmdline,
        "-drive", "id=d0,file=" + disk + ",format=raw,if=none",
        "-device", "virtio-blk-device,drive=d0", "-device", "virtio-rng-device",
    ]


def kpin_argv(guest, tool, cmdline, mem, out):
    return [sbs.KPIN, "run", "--guest", guest, "--tool", tool, "--mem", str(mem),
            "--cmdline", cmdline, "--out", out]


def timed(argv, timeout):
    """sbs.timed_run, with the Debian guest's markers: the seconds to multi-user, to the
    workload's md5 and to exit, the tree's CPU seconds, and the md5."""
    saved = sbs.USERSPACE
    sbs.USERSPACE = MULTIUSER
    try:
        t, md5 = sbs.timed_run(argv, timeout)
    finally:
        sbs.USERSPACE = saved
    return t, md5


def profile_head(out, lines=8):
    try:
        with open(os.path.join(out, "profile.txt")) as f:
            return [line.rstrip("\n") for line in f][:lines]
    except OSError:
        return []


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", choices=["6.1", "6.12"], default="6.1")
    ap.add_argument("--configs", default="qemu,null")
    ap.add_argument("--mem", type=int, default=1024)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json")
    a = ap.parse_args()

    expected = open(os.path.join(DEBIAN, "expected-md5")).read().strip()
    img = sbs.kernel_images(a.kernel)
    release = sbs.kernel_release(a.kernel)
    initrd = os.path.join(DEBIAN, "initrd.img-" + release)
    guest = "debian" if a.kernel == "6.1" else "debian-6.12"
    cmdline = debian_cmdline()
    configs = a.configs.split(",")
    scratch = tempfile.mkdtemp(prefix="kpin-debian-sbs-")
    results = {c: [] for c in configs}
    print("kernel %s, %d MiB, line %r, %s" % (release, a.mem, cmdline, sbs.git_describe()))
    try:
        for r in range(a.rounds):
            order = configs if r % 2 == 0 else list(reversed(configs))
            for c in order:
                load = os.getloadavg()[0]
                if c == "qemu":
                    argv = qemu_argv(img["bzimage"], initrd, fresh_disk(scratch), cmdline, a.mem)
                    out = None
                else:
                    out = os.path.join(scratch, "%s-%d" % (c, r))
                    argv = kpin_argv(guest, c, cmdline, a.mem, out)
                t, md5 = timed(argv, a.timeout)
                if md5 != expected:
                    sys.exit("debian_side_by_side: %s printed md5 %s, expected %s"
                             % (c, md5, expected))
                t["load"] = load
                results[c].append(t)
                print("round %d %-8s multi-user %6.1f s  done %6.1f s  exit %6.1f s  "
                      "cpu %6.1f s  (load %.1f)" % (r + 1, c, t["userspace_s"] or float("nan"),
                                                   t["done_s"], t["exit_s"], t["cpu_s"], load))
                for line in profile_head(out) if out else []:
                    print("    " + line)
                if out:
                    # Keep the profile, not the 660 MB disk copy.
                    for name in os.listdir(out):
                        if name.endswith(".img"):
                            os.unlink(os.path.join(out, name))
    finally:
        disk = os.path.join(scratch, "disk.img")
        if os.path.exists(disk):
            os.unlink(disk)
    print()
    base = results.get("qemu")
    for c in configs:
        rows = results[c]
        line = "%-8s median done %6.1f s (exit %6.1f s, cpu %6.1f s)" % (
            c, statistics.median(t["done_s"] for t in rows),
            statistics.median(t["exit_s"] for t in rows),
            statistics.median(t["cpu_s"] for t in rows))
        if base and c != "qemu":
            wall = statistics.median(t["done_s"] / b["done_s"] for t, b in zip(rows, base))
            cpu = statistics.median(t["cpu_s"] / b["cpu_s"] for t, b in zip(rows, base))
            line += "  ratio to qemu: wall %.2fx, cpu %.2fx" % (wall, cpu)
        print(line)
    print("kpin output directories (profile.txt, counters.json) kept under " + scratch)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kernel": release, "mem_mib": a.mem, "cmdline": cmdline,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
