//! `kpin run`'s inputs checked before anything is loaded or booted: the command line
//! ([`UsageError`], exit status 2) and the kernel and initrd files (plain errors, exit
//! status 1). Nothing here blocks (a FIFO is refused by `stat` before any `open`, and
//! opens use `O_NONBLOCK`), reads a file whole, or trusts a size from a header without
//! checking it against the file's length.

use std::fs::File;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::layout::{HIMEM_START, MIN_MEM_MIB};

const MIB: u64 = 1 << 20;

/// A command-line mistake: `kpin` says so and exits with status 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The tools the engine image offers and the `--tool-option` keys each understands (the
/// registry, `tools/registry`: each tool crate's `SPEC`), for the host to refuse an unknown
/// `--tool` or key before booting.
pub use kpin_tool_registry::TOOLS;

/// The option keys the engine itself understands with every tool
/// (`guest-engine/image/src/run/bringup.rs`, `parse_options`).
pub const ENGINE_OPTIONS: &[&str] = &[
    "bringup.checks",
    "bringup.gates",
    "bringup.probe",
    "bringup.ticks",
    "bringup.crash",
];

/// Checks `--tool NAME` and its `--tool-option KEY=VALUE`s against [`TOOLS`] and
/// [`ENGINE_OPTIONS`], and the values as the tool's host part checks them
/// ([`engine_options`]).
pub fn check_tool(name: &str, options: &[String]) -> Result<(), UsageError> {
    let tool = kpin_tool_registry::find(name).ok_or_else(|| {
        UsageError(format!(
            "unknown tool {name:?}: the tools are {}",
            kpin_tool_registry::Names
        ))
    })?;
    for key in option_keys(options)? {
        if !ENGINE_OPTIONS.contains(&key) && tool.option(key).is_none() {
            let known: Vec<&str> = ENGINE_OPTIONS
                .iter()
                .copied()
                .chain(tool.options.iter().map(|o| o.key))
                .collect();
            return Err(UsageError(format!(
                "unknown --tool-option key {key:?} for tool {name}: the known keys are {}",
                known.join(", ")
            )));
        }
    }
    // The values (a cache geometry, a config_file), checked here as the engine will: a
    // usage error before boot.
    engine_options(name, options).map(drop)
}

/// The keys of `--tool-option KEY=VALUE` words; a usage error for a word that is not
/// `KEY=VALUE` without spaces. (An out-of-tree tool's options get only this check
/// before boot: the tool checks them in the engine.)
pub fn option_keys(options: &[String]) -> Result<Vec<&str>, UsageError> {
    options
        .iter()
        .map(|o| {
            o.split_once('=')
                .filter(|_| !o.contains(char::is_whitespace))
                .map(|(key, _)| key)
                .ok_or_else(|| {
                    UsageError(format!(
                        "bad --tool-option {o:?}: expected KEY=VALUE without spaces"
                    ))
                })
        })
        .collect()
}

/// Host files an option names, read as the VMM reads its other inputs.
struct OptionFiles;

impl kpin_tool::host_side::OptionFiles for OptionFiles {
    fn len(&mut self, path: &str, what: &str) -> Result<u64, String> {
        regular_file(Path::new(path), what).map_err(|e| e.to_string())
    }

    fn read(&mut self, path: &str) -> Result<String, String> {
        std::fs::read_to_string(path).map_err(|e| e.to_string())
    }
}

/// The option string the engine gets for `--tool name --tool-option …`: as given, unless
/// the tool's host part checks the values and hands over words of its own (cachesim: one
/// canonical form with a `config_file` expanded, since the engine cannot read host
/// files), which then follow the engine's own words. A value the host part refuses, or
/// words too long for the engine's option block, are a usage error.
pub fn engine_options(name: &str, options: &[String]) -> Result<String, UsageError> {
    let given = options.join(" ");
    let Some(host) = kpin_tool_registry::host::find(name) else {
        return Ok(given);
    };
    let bad = |e: &dyn std::fmt::Display| UsageError(format!("bad {name} options: {e}"));
    let Some(own) = host
        .engine_options(&given, &mut OptionFiles)
        .map_err(|e| bad(&e))?
    else {
        return Ok(given);
    };
    let mut words: Vec<String> = options
        .iter()
        .filter(|w| ENGINE_OPTIONS.contains(&w.split_once('=').map_or(w.as_str(), |(k, _)| k)))
        .cloned()
        .collect();
    if !own.is_empty() {
        words.push(own);
    }
    let text = words.join(" ");
    let max = kpin_abi::attach::TOOL_OPTIONS_BYTES - 1;
    if text.len() > max {
        return Err(bad(&format_args!(
            "the engine takes at most {max} bytes of options and these come to {} ({text}): use shorter cache names or fewer caches",
            text.len()
        )));
    }
    Ok(text)
}

/// Checks that `path` names a regular file (following symlinks: the operator chose it),
/// without opening it: a FIFO, a device, a directory or a socket is refused. Returns its
/// length.
pub fn regular_file(path: &Path, what: &str) -> anyhow::Result<u64> {
    let meta = std::fs::metadata(path)
        .map_err(|e| anyhow::anyhow!("cannot read {} ({what}): {e}", path.display()))?;
    let ft = meta.file_type();
    let kind = if ft.is_file() {
        return Ok(meta.len());
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    };
    anyhow::bail!("{what} {} is {kind}, not a regular file", path.display())
}

/// Opens a file [`regular_file`] accepted, without blocking, and checks again that what
/// was opened is a regular file (the name may have changed in between).
pub fn open_regular(path: &Path, what: &str) -> anyhow::Result<(File, u64)> {
    regular_file(path, what)?;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| anyhow::anyhow!("cannot read {} ({what}): {e}", path.display()))?;
    let meta = f.metadata()?;
    if !meta.file_type().is_file() {
        anyhow::bail!("{what} {} is not a regular file", path.display());
    }
    Ok((f, meta.len()))
}

/// Checks an initrd: a regular file no larger than guest RAM (the boot loader refines
/// this with the room left above the kernel).
pub fn check_initrd(path: &Path, mem_mib: u64) -> anyhow::Result<()> {
    let len = regular_file(path, "initrd")?;
    let ram = mem_mib.saturating_mul(MIB);
    if len > ram {
        anyhow::bail!(
            "initrd {} of {len} bytes does not fit in guest RAM ({mem_mib} MiB); raise --mem",
            path.display()
        );
    }
    Ok(())
}

/// What [`check_kernel`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelCheck {
    /// Whether it is an ELF (else a bzImage).
    pub elf: bool,
    /// Guest memory the kernel needs to be loaded (and, for a bzImage, decompressed).
    pub min_mem_mib: u64,
}

fn le(b: &[u8], off: usize, n: usize) -> u64 {
    b[off..off + n]
        .iter()
        .rev()
        .fold(0, |v, &x| v << 8 | u64::from(x))
}

fn read_at(f: &File, off: u64, len: usize) -> anyhow::Result<Vec<u8>> {
    let mut b = vec![0; len];
    f.read_exact_at(&mut b, off)?;
    Ok(b)
}

/// Checks a kernel's headers against the file and the guest memory size: an ELF64
/// x86-64 executable whose program headers and segments lie inside the file, or a bzImage
/// with a valid setup header (boot flag, "HdrS", protocol 2.06 or later, a 64-bit entry
/// point when the protocol can say so) whose setup and protected-mode parts lie inside
/// the file; either must fit in `mem_mib` MiB.
pub fn check_kernel(path: &Path, mem_mib: u64) -> anyhow::Result<KernelCheck> {
    let (f, len) = open_regular(path, "kernel")?;
    let name = path.display();
    let bad = |why: String| anyhow::anyhow!("kernel {name} is not a loadable kernel: {why}");
    let head = read_at(&f, 0, len.min(0x1000) as usize)?;
    let check = if head.starts_with(b"\x7fELF") {
        check_elf(&f, len, &head).map_err(bad)?
    } else if head.len() >= 0x206 && head[0x202..0x206] == *b"HdrS" {
        check_bzimage(len, &head).map_err(bad)?
    } else {
        anyhow::bail!("{name} is not a kernel: neither an ELF64 executable nor a bzImage");
    };
    if check.min_mem_mib > mem_mib {
        anyhow::bail!(
            "kernel {name} needs at least {} MiB of guest memory to load; --mem is {mem_mib}",
            check.min_mem_mib
        );
    }
    Ok(check)
}

fn check_elf(f: &File, len: u64, head: &[u8]) -> Result<KernelCheck, String> {
    const EM_X86_64: u64 = 62;
    const PT_LOAD: u64 = 1;
    const PHENT: u64 = 56;
    if head.len() < 64 {
        return Err(format!("{len} bytes, shorter than an ELF64 header"));
    }
    if head[4] != 2 {
        return Err("not ELFCLASS64 (a 32-bit ELF)".into());
    }
    if head[5] != 1 {
        return Err("not little-endian".into());
    }
    let machine = le(head, 0x12, 2);
    if machine != EM_X86_64 {
        return Err(format!("e_machine is {machine}, not x86-64 ({EM_X86_64})"));
    }
    let (phoff, phentsize, phnum) = (le(head, 0x20, 8), le(head, 0x36, 2), le(head, 0x38, 2));
    if phentsize != PHENT || phnum == 0 {
        return Err(format!(
            "{phnum} program headers of {phentsize} bytes (want 1 or more of {PHENT})"
        ));
    }
    let table = phentsize * phnum;
    if phoff.checked_add(table).is_none_or(|end| end > len) {
        return Err(format!(
            "its program headers ({table} bytes at {phoff:#x}) lie past the end of the {len}-byte file (truncated?)"
        ));
    }
    let ph = read_at(f, phoff, table as usize).map_err(|e| e.to_string())?;
    let mut end = 0u64;
    for p in ph.chunks_exact(PHENT as usize) {
        if le(p, 0, 4) != PT_LOAD {
            continue;
        }
        let (offset, paddr, filesz, memsz) =
            (le(p, 8, 8), le(p, 0x18, 8), le(p, 0x20, 8), le(p, 0x28, 8));
        if offset.checked_add(filesz).is_none_or(|e| e > len) {
            return Err(format!(
                "a segment ({filesz} bytes at file offset {offset:#x}) lies past the end of the {len}-byte file (truncated?)"
            ));
        }
        if filesz > memsz {
            return Err(format!(
                "a segment's file size {filesz} exceeds its memory size {memsz}"
            ));
        }
        let seg_end = paddr
            .checked_add(memsz)
            .ok_or_else(|| format!("a segment at {paddr:#x} of {memsz} bytes wraps"))?;
        end = end.max(seg_end);
    }
    if end == 0 {
        return Err("no loadable segment".into());
    }
    Ok(KernelCheck {
        elf: true,
        min_mem_mib: end.div_ceil(MIB).max(MIN_MEM_MIB),
    })
}

fn check_bzimage(len: u64, head: &[u8]) -> Result<KernelCheck, String> {
    const MIN_PROTOCOL: u64 = 0x206;
    const XLF_KERNEL_64: u64 = 1;
    const LOADED_HIGH: u64 = 1;
    if head.len() < 0x268 {
        return Err(format!("{len} bytes, shorter than a setup header"));
    }
    if le(head, 0x1fe, 2) != 0xaa55 {
        return Err("no boot flag 0xaa55 at 0x1fe".into());
    }
    let version = le(head, 0x206, 2);
    if version < MIN_PROTOCOL {
        return Err(format!(
            "boot protocol {}.{:02}; 2.06 or later is required",
            version >> 8,
            version & 0xff
        ));
    }
    if le(head, 0x211, 1) & LOADED_HIGH == 0 {
        return Err("a zImage (not loaded high); only bzImages boot".into());
    }
    if version >= 0x20c && le(head, 0x236, 2) & XLF_KERNEL_64 == 0 {
        return Err("no 64-bit entry point (xloadflags)".into());
    }
    let setup_sects = match le(head, 0x1f1, 1) {
        0 => 4,
        n => n,
    };
    let setup_bytes = (setup_sects + 1) * 512;
    let sys_bytes = le(head, 0x1f4, 4) * 16;
    if setup_bytes + sys_bytes > len {
        return Err(format!(
            "its header promises {setup_bytes} setup bytes and {sys_bytes} kernel bytes, but the file has {len} (truncated?)"
        ));
    }
    // The decompressor runs at pref_address and needs init_size bytes there (2.10+).
    let mut end = HIMEM_START + sys_bytes;
    if version >= 0x20a {
        let pref = le(head, 0x258, 8);
        let init_size = le(head, 0x260, 4);
        end = end.max(pref.saturating_add(init_size));
    }
    Ok(KernelCheck {
        elf: false,
        min_mem_mib: end.div_ceil(MIB).max(MIN_MEM_MIB),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("kpin-input-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// An ELF64 header and one PT_LOAD of `code` at 0x100000.
    fn elf(code: &[u8], machine: u16) -> Vec<u8> {
        let mut e = vec![0u8; 64 + 56];
        e[..6].copy_from_slice(b"\x7fELF\x02\x01");
        e[0x10..0x12].copy_from_slice(&2u16.to_le_bytes());
        e[0x12..0x14].copy_from_slice(&machine.to_le_bytes());
        e[0x18..0x20].copy_from_slice(&0x10_0000u64.to_le_bytes());
        e[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        e[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        e[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let p = 64;
        e[p..p + 4].copy_from_slice(&1u32.to_le_bytes());
        e[p + 8..p + 16].copy_from_slice(&120u64.to_le_bytes());
        e[p + 0x18..p + 0x20].copy_from_slice(&0x10_0000u64.to_le_bytes());
        e[p + 0x20..p + 0x28].copy_from_slice(&(code.len() as u64).to_le_bytes());
        e[p + 0x28..p + 0x30].copy_from_slice(&(code.len() as u64).to_le_bytes());
        e.extend_from_slice(code);
        e
    }

    fn bzimage(sys_bytes: u32, file_len: usize) -> Vec<u8> {
        let mut b = vec![0u8; file_len];
        b[0x1f1] = 3;
        b[0x1f4..0x1f8].copy_from_slice(&(sys_bytes / 16).to_le_bytes());
        b[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
        b[0x202..0x206].copy_from_slice(b"HdrS");
        b[0x206..0x208].copy_from_slice(&0x20fu16.to_le_bytes());
        b[0x211] = 1;
        b[0x236..0x238].copy_from_slice(&0x7fu16.to_le_bytes());
        b[0x258..0x260].copy_from_slice(&0x100_0000u64.to_le_bytes());
        b[0x260..0x264].copy_from_slice(&0x300_0000u32.to_le_bytes());
        b
    }

    fn err(path: &Path, mem: u64) -> String {
        format!("{:#}", check_kernel(path, mem).unwrap_err())
    }

    #[test]
    fn test_elf_kernels_are_checked_against_the_file_and_the_machine() {
        let d = scratch("elf");
        let k = d.join("k");
        std::fs::write(&k, elf(&[0xf4; 16], 62)).unwrap();
        assert_eq!(
            check_kernel(&k, 16).unwrap(),
            KernelCheck {
                elf: true,
                min_mem_mib: 16
            }
        );
        std::fs::write(&k, elf(&[0xf4; 16], 183)).unwrap();
        assert!(err(&k, 16).contains("e_machine is 183, not x86-64"));
        let mut e = elf(&[0xf4; 16], 62);
        e.truncate(e.len() - 8);
        std::fs::write(&k, &e).unwrap();
        assert!(err(&k, 16).contains("past the end"), "{}", err(&k, 16));
        std::fs::write(&k, &elf(&[0xf4; 16], 62)[..100]).unwrap();
        assert!(err(&k, 16).contains("program headers"), "{}", err(&k, 16));
        let mut e = elf(&[0xf4; 16], 62);
        e[4] = 1;
        std::fs::write(&k, &e).unwrap();
        assert!(err(&k, 16).contains("ELFCLASS64"));
        // A segment ending at 40 MiB needs 40 MiB.
        let mut e = elf(&[0xf4; 16], 62);
        e[64 + 0x28..64 + 0x30].copy_from_slice(&(39u64 << 20).to_le_bytes());
        std::fs::write(&k, &e).unwrap();
        assert!(err(&k, 32).contains("needs at least 40 MiB of guest memory to load; --mem is 32"));
        assert_eq!(check_kernel(&k, 40).unwrap().min_mem_mib, 40);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn test_bzimages_are_checked_against_the_file_and_guest_memory() {
        let d = scratch("bz");
        let k = d.join("bz");
        std::fs::write(&k, bzimage(0x1000, 2048 + 0x1000)).unwrap();
        assert_eq!(
            check_kernel(&k, 64).unwrap(),
            KernelCheck {
                elf: false,
                min_mem_mib: 64
            }
        );
        assert!(
            err(&k, 16).contains("needs at least 64 MiB"),
            "{}",
            err(&k, 16)
        );
        // The 100 KB truncated bzImage of the report.
        std::fs::write(&k, bzimage(0x100_0000, 100_000)).unwrap();
        assert!(err(&k, 256).contains("(truncated?)"), "{}", err(&k, 256));
        let mut b = bzimage(0x1000, 2048 + 0x1000);
        b[0x206..0x208].copy_from_slice(&0x204u16.to_le_bytes());
        std::fs::write(&k, &b).unwrap();
        assert!(err(&k, 256).contains("boot protocol 2.04"));
        let mut b = bzimage(0x1000, 2048 + 0x1000);
        b[0x1fe] = 0;
        std::fs::write(&k, &b).unwrap();
        assert!(err(&k, 256).contains("boot flag"));
        let mut b = bzimage(0x1000, 2048 + 0x1000);
        b[0x236] = 0;
        std::fs::write(&k, &b).unwrap();
        assert!(err(&k, 256).contains("64-bit entry"));
        std::fs::write(&k, b"HdrS but far too short").unwrap();
        assert!(err(&k, 256).contains("neither an ELF64"));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn test_special_files_are_refused_without_opening_them() {
        let d = scratch("special");
        let fifo = d.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
        let e = format!("{:#}", check_kernel(&fifo, 256).unwrap_err());
        assert!(e.contains("is a FIFO, not a regular file"), "{e}");
        let e = format!(
            "{:#}",
            check_initrd(Path::new("/dev/zero"), 256).unwrap_err()
        );
        assert!(e.contains("is a character device"), "{e}");
        let e = format!("{:#}", check_initrd(&d, 256).unwrap_err());
        assert!(e.contains("is a directory"), "{e}");
        let big = d.join("big");
        File::create(&big).unwrap().set_len(33 << 20).unwrap();
        let e = format!("{:#}", check_initrd(&big, 32).unwrap_err());
        assert!(e.contains("does not fit in guest RAM (32 MiB)"), "{e}");
        check_initrd(&big, 64).unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn test_unknown_tools_and_option_keys_are_usage_errors_naming_the_known_ones() {
        check_tool("null", &[]).unwrap();
        check_tool("bbcount", &["bringup.crash=pf".into()]).unwrap();
        let e = check_tool("nosuch", &[]).unwrap_err().to_string();
        assert_eq!(
            e,
            "unknown tool \"nosuch\": the tools are null, bbcount, cachesim, insmix, memtrace"
        );
        let e = check_tool("null", &["colour=red".into()])
            .unwrap_err()
            .to_string();
        assert_eq!(e, "unknown --tool-option key \"colour\" for tool null: the known keys are bringup.checks, bringup.gates, bringup.probe, bringup.ticks, bringup.crash");
        // Only cachesim's keys are also accepted with their tool's name as a prefix.
        check_tool("memtrace", &["memtrace.cpl=3".into()]).unwrap_err();
        let e = check_tool("null", &["novalue".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("expected KEY=VALUE"), "{e}");
    }

    #[test]
    fn test_cachesim_options_are_checked_with_the_geometry_rules_before_boot() {
        check_tool(
            "cachesim",
            &["L1D_size=16K".into(), "cachesim.LL_assoc=16".into()],
        )
        .unwrap();
        check_tool("insmix", &[]).unwrap();
        let e = check_tool("cachesim", &["L1D_size=3K".into()])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("bad cachesim options: "), "{e}");
        let e = check_tool("cachesim", &["L1D_sise=16K".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown --tool-option key \"L1D_sise\""), "{e}");
    }

    #[test]
    fn test_memtrace_options_are_checked_before_boot() {
        check_tool("memtrace", &["cpl=3".into(), "limit=100".into()]).unwrap();
        let e = check_tool("memtrace", &["cpl=2".into()])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("bad memtrace options: "), "{e}");
        let e = check_tool("memtrace", &["limt=5".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown --tool-option key \"limt\""), "{e}");
    }

    /// The engine image offers what the registry lists (and, in an image built with a tool
    /// crate, that crate's tool): it builds the chosen tool from the registry's entries
    /// and names no tool crate of its own, nor does its manifest; each engine key is a
    /// `"key" =>` arm of `parse_options` (keys without their `bringup.` prefix).
    #[test]
    fn test_tool_and_option_lists_match_the_engine_image_sources() {
        let image = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-engine/image");
        let root = image.join("src/run");
        let tools = std::fs::read_to_string(root.join("tools.rs")).unwrap();
        assert!(tools.contains("kpin_tool_registry::entry(name)"));
        assert!(tools.contains("kpin_extra_tool::new_tool"));
        let manifest = std::fs::read_to_string(image.join("Cargo.toml")).unwrap();
        for t in TOOLS {
            let krate = format!("kpin_tool_{}", t.name);
            assert!(!tools.contains(&krate), "tools.rs names {krate}");
            assert!(
                !tools.contains(&format!("\"{}\"", t.name)),
                "tools.rs names {}",
                t.name
            );
            let dep = format!("kpin-tool-{}", t.name);
            assert!(!manifest.contains(&dep), "the image's manifest names {dep}");
        }
        let bringup = std::fs::read_to_string(root.join("bringup.rs")).unwrap();
        for k in ENGINE_OPTIONS {
            let key = k.strip_prefix("bringup.").unwrap();
            assert!(bringup.contains(&format!("\"{key}\" =>")), "{k}");
        }
    }

    /// The VMM names no tool crate: the host parts come from the registry
    /// (`kpin_tool_registry::host::HOST_TOOLS`), in `TOOLS`' order.
    #[test]
    fn test_the_vmm_gets_its_tools_from_the_registry_only() {
        let manifest =
            std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
                .unwrap();
        for t in TOOLS {
            let dep = format!("kpin-tool-{} ", t.name);
            assert!(!manifest.contains(&dep), "vmm/Cargo.toml names {dep}");
        }
        let host: Vec<&str> = kpin_tool_registry::host::HOST_TOOLS
            .iter()
            .map(|h| h.spec().name)
            .collect();
        let names: Vec<&str> = TOOLS.iter().map(|t| t.name).collect();
        assert_eq!(host, names);
    }
}
