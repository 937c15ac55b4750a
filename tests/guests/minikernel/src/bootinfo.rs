//! What the kernel reads from the Linux `boot_params` ("zero page"): the command line and the
//! e820 memory map. Both are read once, right after boot, while the VMM's identity map of
//! the first 4 GiB is still live, and the command line is copied into the kernel.

use crate::global::Global;

/// `boot_params.e820_entries` (u8).
const BP_E820_ENTRIES: u64 = 0x1e8;
/// `boot_params.hdr.cmd_line_ptr` (u32).
const BP_CMD_LINE_PTR: u64 = 0x228;
/// `boot_params.e820_table` (20-byte entries: addr u64, size u64, type u32).
const BP_E820_TABLE: u64 = 0x2d0;
/// Bytes per e820 entry.
const E820_ENTRY_BYTES: u64 = 20;
/// Capacity of `boot_params.e820_table`.
const E820_MAX_ENTRIES: u8 = 128;
/// e820 type of usable RAM.
const E820_RAM: u32 = 1;
/// Bytes of the command line the kernel keeps.
pub const CMDLINE_MAX: usize = 512;

static CMDLINE: Global<[u8; CMDLINE_MAX]> = Global::new([0; CMDLINE_MAX]);
static CMDLINE_LEN: Global<usize> = Global::new(0);
static RAM_COVERS_KERNEL: Global<bool> = Global::new(false);

fn read_u8(pa: u64) -> u8 {
    // SAFETY: boot_params and the command line lie in low RAM, identity mapped by the VMM.
    unsafe { (pa as *const u8).read_volatile() }
}

fn read_u32(pa: u64) -> u32 {
    // SAFETY: as in `read_u8`; unaligned reads are fine on x86.
    unsafe { (pa as *const u32).read_unaligned() }
}

fn read_u64(pa: u64) -> u64 {
    // SAFETY: as in `read_u32`.
    unsafe { (pa as *const u64).read_unaligned() }
}

/// Reads the command line and checks that e820 RAM covers `start..end`.
pub fn init(boot_params: u64, start: u64, end: u64) {
    if boot_params == 0 {
        return;
    }
    let cmdline = u64::from(read_u32(boot_params + BP_CMD_LINE_PTR));
    if cmdline != 0 {
        let dst = CMDLINE.as_ptr().cast::<u8>();
        let mut len = 0;
        while len < CMDLINE_MAX {
            let b = read_u8(cmdline + len as u64);
            if b == 0 {
                break;
            }
            // SAFETY: `len < CMDLINE_MAX`, inside the static buffer; nothing else accesses it
            // before `CMDLINE_LEN` is set below.
            unsafe { dst.add(len).write(b) };
            len += 1;
        }
        CMDLINE_LEN.set(len);
    }
    let entries = read_u8(boot_params + BP_E820_ENTRIES).min(E820_MAX_ENTRIES);
    for i in 0..u64::from(entries) {
        let e = boot_params + BP_E820_TABLE + i * E820_ENTRY_BYTES;
        let (addr, size, kind) = (read_u64(e), read_u64(e + 8), read_u32(e + 16));
        if kind == E820_RAM && addr <= start && addr.saturating_add(size) >= end {
            RAM_COVERS_KERNEL.set(true);
        }
    }
}

/// Whether one e820 RAM entry covers the range given to [`init`].
pub fn ram_covers_kernel() -> bool {
    RAM_COVERS_KERNEL.get()
}

/// The value of the first `key=value` word on the command line (`key` includes the `=`).
pub fn option(key: &str) -> Option<&'static [u8]> {
    // SAFETY: the buffer is written only by `init`, before any caller reads it, and the
    // first `CMDLINE_LEN` bytes are initialized.
    let line =
        unsafe { core::slice::from_raw_parts(CMDLINE.as_ptr().cast::<u8>(), CMDLINE_LEN.get()) };
    line.split(|&b| b == b' ')
        .find_map(|word| word.strip_prefix(key.as_bytes()))
}

/// Whether `kpin.skip=` lists `name`, or lists `native-unsafe` and `native_unsafe` is set.
pub fn skip_requested(name: &str, native_unsafe: bool) -> bool {
    let Some(list) = option("kpin.skip=") else {
        return false;
    };
    list.split(|&b| b == b',')
        .any(|item| item == name.as_bytes() || (native_unsafe && item == b"native-unsafe"))
}
