//! Default kernel command lines of kpin's built-in guests, shared by the `kpin` command
//! and the tests so that both boot the guests the same way.

/// Command line of the Debian guest: the serial console plus what stays for a measured
/// reason (issue #10 dropped `reboot=k`, `nokaslr`, `noxsave`, `8250.nr_uarts=1` and
/// `mitigations=off`: the VMM's ACPI tables give poweroff and reboot, a vmlinux boot skips
/// the decompressor that randomizes, the CPUID table already hides XSAVE, probing the
/// absent COM2–4 costs nothing measurable, and the default mitigations run on the virtual
/// speculation controls at no measurable cost — 14.92 s against 14.78 s to the workload's
/// end, medians of three, `tests/bench/side_by_side.py --configs null --cmdline …` with and
/// without `mitigations=off`). Each remaining option, measured on the AMD host under
/// `--tool null`:
/// - `earlyprintk=serial,ttyS0,115200`: the first 0.5 s of boot messages, before the
///   console driver, reach the console (a debugging aid, not a workaround);
/// - `panic=-1`: a panic resets at once (the console watch has already flagged it as a
///   crash) instead of hanging until the timeout.
///
/// Gone since the VMM models them (issue #25): `pci=off` (the VMM answers PCI
/// configuration mechanism 1 with a host bridge, `devices/pci.rs`, so the kernel no longer
/// prints `PCI: Fatal: No config space access function found`) and `i8042.noaux
/// i8042.nomux i8042.dumbkbd` (the i8042 model answers every probe step,
/// `devices/i8042.rs`: the kernel no longer polls the controller 20 000 times).
///
/// The distribution's own line is [`LINUX_612_CMDLINE`]; the tests boot both kernels with
/// it too.
pub const LINUX_CMDLINE: &str = "console=ttyS0 earlyprintk=serial,ttyS0,115200 panic=-1";

/// The distribution command line of Debian's kernels, the second pinned kernel's default
/// (`kpin_images::GuestKernel::Debian612`) and the line the tests also boot the first one
/// with: the distribution's own behaviour, as issue #10 asks. Debian's cloud images boot with `console=tty0 console=ttyS0,115200
/// earlyprintk=ttyS0,115200 consoleblank=0 root=…`; with an initramfs and only a serial
/// port, the serial console is all that remains, plus `panic=-1` so that a panic ends the
/// run at once. Nothing else: KASLR (when booted as bzImage), the default mitigations,
/// PCI and i8042 probing stay as the distribution has them (the CPU features are the
/// VMM's CPUID table's, as for every guest).
pub const LINUX_612_CMDLINE: &str = "console=ttyS0 panic=-1";

/// Command line of the Debian bookworm guest (`--guest debian`, issue #26): its root file
/// system is the first virtio disk, read-write (each run boots its own copy), the serial
/// console, and `panic=-1` so that a panic ends the run at once. The VMM declares the
/// virtio-mmio devices itself; the image's initrd loads virtio_mmio and virtio_blk.
pub const DEBIAN_CMDLINE: &str = "root=/dev/vda rw console=ttyS0 panic=-1";

/// Command line of a native mini-kernel run: skip the steps this KVM cannot run natively
/// (the mini-kernel knows which they are).
pub const MINIKERNEL_NATIVE_CMDLINE: &str = "kpin.skip=native-unsafe";

/// Default command line of a kernel the user brings with `--kernel` (no `--cmdline`): the
/// kernel's own defaults plus the serial console, so that its messages reach kpin's console
/// (an empty command line leaves a distribution kernel silent).
pub const USER_KERNEL_CMDLINE: &str = "console=ttyS0";
