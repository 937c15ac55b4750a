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

/// Command line of a native mini-kernel run: skip the steps this KVM cannot run natively
/// (the mini-kernel knows which they are).
pub const MINIKERNEL_NATIVE_CMDLINE: &str = "kpin.skip=native-unsafe";

/// Default command line of a kernel the user brings with `--kernel` (no `--cmdline`): the
/// kernel's own defaults plus the serial console, so that its messages reach kpin's console
/// (an empty command line leaves a distribution kernel silent).
pub const USER_KERNEL_CMDLINE: &str = "console=ttyS0";
