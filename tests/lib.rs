//! Helpers shared by kpin's integration tests.
//!
//! Tests that need `/dev/kvm` call [`kvm_available`] first; when it is absent they print a
//! visible `SKIPPED: no /dev/kvm` line and return, so a run without KVM says what it did
//! not test instead of passing silently.

use std::path::PathBuf;

/// Whether `/dev/kvm` can be opened; prints `SKIPPED: no /dev/kvm (<test>)` if not.
pub fn kvm_available(test: &str) -> bool {
    match std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        Ok(_) => true,
        Err(e) => {
            println!("SKIPPED: no /dev/kvm ({test}): {e}");
            eprintln!("SKIPPED: no /dev/kvm ({test}): {e}");
            false
        }
    }
}

/// Load address of the tiny test guests.
pub const TINY_LOAD_ADDR: u64 = 0x10_0000;

/// Wraps `code` in a minimal ELF64 executable with one PT_LOAD segment at
/// [`TINY_LOAD_ADDR`] (p_paddr = p_vaddr), entered at its first byte.
pub fn tiny_elf(code: &[u8]) -> Vec<u8> {
    const EHDR: usize = 64;
    const PHDR: usize = 56;
    let mut e = Vec::new();
    e.extend_from_slice(b"\x7fELF\x02\x01\x01\x00");
    e.extend_from_slice(&[0; 8]);
    e.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e.extend_from_slice(&0x3eu16.to_le_bytes()); // EM_X86_64
    e.extend_from_slice(&1u32.to_le_bytes());
    e.extend_from_slice(&TINY_LOAD_ADDR.to_le_bytes()); // e_entry
    e.extend_from_slice(&(EHDR as u64).to_le_bytes()); // e_phoff
    e.extend_from_slice(&0u64.to_le_bytes()); // e_shoff
    e.extend_from_slice(&0u32.to_le_bytes()); // e_flags
    e.extend_from_slice(&(EHDR as u16).to_le_bytes());
    e.extend_from_slice(&(PHDR as u16).to_le_bytes());
    e.extend_from_slice(&1u16.to_le_bytes()); // e_phnum
    e.extend_from_slice(&[0; 6]); // shentsize, shnum, shstrndx
    assert_eq!(e.len(), EHDR);
    let off = (EHDR + PHDR) as u64;
    e.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    e.extend_from_slice(&7u32.to_le_bytes()); // RWX
    e.extend_from_slice(&off.to_le_bytes());
    e.extend_from_slice(&TINY_LOAD_ADDR.to_le_bytes());
    e.extend_from_slice(&TINY_LOAD_ADDR.to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&(code.len() as u64).to_le_bytes());
    e.extend_from_slice(&0x1000u64.to_le_bytes());
    e.extend_from_slice(code);
    e
}

/// A fresh scratch directory for one test.
pub fn scratch_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kpin-test-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("create scratch dir");
    d
}

/// Path of the built `kpin` binary (cargo sets this for integration tests of packages that
/// depend on the binary's package only when it is in the same package, so it is found
/// relative to the test executable instead).
pub fn kpin_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe.parent().and_then(|p| p.parent()).expect("target/<profile>/deps");
    dir.join("kpin")
}
