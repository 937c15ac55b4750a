//! Default kernel command lines of kpin's built-in guests, shared by the `kpin` command
//! and the tests so that both boot the guests the same way.

/// Command line of the Debian guest. `reboot=k` makes poweroff and reboot go through the
/// i8042 reset line, which kpin treats as the end of the run; `panic=-1` turns a panic
/// into a reset right away (the console watch has already flagged it as a crash);
/// `noxsave` and the CPUID table keep the kernel off instructions this host's KVM cannot
/// emulate at ring 0; `pci=off`, `8250.nr_uarts=1` and the i8042 options keep it from
/// probing hardware that is not there. `mitigations=off`: this is a test guest running
/// trusted code, and the speculative-execution mitigations cost an MSR write or a CR3
/// switch on every kernel entry — each a ring-0 gate round trip under the engine — while
/// on this host's CPU model the kernel otherwise picks retpolines and prints
/// `RETBleed: WARNING: … data leaks possible!`, a console WARNING line on every boot.
pub const LINUX_CMDLINE: &str = "console=ttyS0 earlyprintk=serial,ttyS0,115200 reboot=k \
     panic=-1 nokaslr noxsave pci=off 8250.nr_uarts=1 i8042.noaux i8042.nomux i8042.dumbkbd \
     mitigations=off";

/// Command line of the second pinned kernel, Debian's 6.12 cloud kernel
/// (`kpin_images::GuestKernel::Debian612`): the distribution's own behaviour, as issue #10
/// asks. Debian's cloud images boot with `console=tty0 console=ttyS0,115200
/// earlyprintk=ttyS0,115200 consoleblank=0 root=…`; with an initramfs and only a serial
/// port, the serial console is all that remains, plus `panic=-1` so that a panic ends the
/// run at once. Nothing else: KASLR (when booted as bzImage), the default mitigations,
/// PCI and i8042 probing stay as the distribution has them (the CPU features are the
/// VMM's CPUID table's, as for every guest).
pub const LINUX_612_CMDLINE: &str = "console=ttyS0 panic=-1";

/// Command line of a native mini-kernel run: skip the steps this KVM cannot run natively
/// (the mini-kernel knows which they are).
pub const MINIKERNEL_NATIVE_CMDLINE: &str = "kpin.skip=native-unsafe";
