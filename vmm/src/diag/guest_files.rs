//! The guest's files read on the host, by the path the guest saw (for naming user code,
//! `user_names.rs`): in the run's raw ext4 disks (`debugfs -R "cat PATH"`, read-only: no
//! mount, no root) and in its initramfs (newc cpio archives, each uncompressed or
//! gzip/zstd/xz/LZ4/bzip2-compressed, several concatenated as the kernel unpacks them; the
//! compressed ones decompressed by the host's tools, as `kpin images` does for a bzImage).
//!
//! Everything here is the guest's: a path is looked up only if it is plain text, archive
//! fields are bounds-checked, and no file, archive or tool output is read past its cap.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Largest guest file read (a libc is 2 MB, a big static binary tens of MB).
pub const MAX_FILE_BYTES: u64 = 256 << 20;
/// Largest initramfs read, and largest decompressed.
pub const MAX_INITRAMFS_BYTES: u64 = 1 << 30;
/// Symbolic links followed in one lookup (the kernel's own limit).
const MAX_LINKS: usize = 40;
/// Magic of a newc archive entry (`070702`: the same with a checksum).
const NEWC: &[u8] = b"07070";
/// A newc header: 6 magic + 13 fields of 8 hex digits.
const NEWC_HEADER: usize = 110;
const S_IFMT: u32 = 0o170_000;
const S_IFREG: u32 = 0o100_000;
const S_IFLNK: u32 = 0o120_000;

/// Decompresses data with the named host tool (`gzip`, `zstd`, …): the plain bytes.
pub type Decompress<'a> = &'a mut dyn FnMut(&'static str, &[u8]) -> Result<Vec<u8>, String>;

/// One entry of an unpacked initramfs: a regular file's bytes or a link's target.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CpioEntry {
    /// A regular file: its bytes.
    File(Vec<u8>),
    /// A symbolic link: its target.
    Link(String),
    /// Anything else (a directory, a device).
    Other,
}

/// What the kernel would unpack from `bytes`: path (without a leading `/` or `./`) →
/// entry, a later entry of a path replacing an earlier one. Compressed segments are
/// decompressed by `decompress` (the host's tools in [`GuestFiles`]). The error says
/// why nothing more could be read; the entries read before it are kept in `into`.
pub fn unpack_initramfs(
    bytes: &[u8],
    into: &mut HashMap<String, CpioEntry>,
    decompress: Decompress<'_>,
) -> Result<(), String> {
    let mut at = 0;
    loop {
        // Between archives: zero padding.
        while bytes.get(at) == Some(&0) {
            at += 1;
        }
        let rest = &bytes[at.min(bytes.len())..];
        if rest.is_empty() {
            return Ok(());
        }
        if rest.starts_with(NEWC) {
            at += read_newc(rest, into)?;
            continue;
        }
        let tool = compression(rest).ok_or_else(|| {
            format!("unknown data at byte {at} (neither cpio nor a known compression)")
        })?;
        // The tool reads to the end: a compressed segment is the archive's last, as the
        // kernel's own build makes it (microcode in cpio first, then the compressed rest).
        let plain = decompress(tool, rest)?;
        if plain.starts_with(NEWC) {
            return unpack_initramfs(&plain, into, &mut |t, _| {
                Err(format!("a {t} segment inside a compressed one"))
            });
        }
        return Err(format!(
            "the {tool} segment at byte {at} holds no cpio archive"
        ));
    }
}

/// The host tool that decompresses data starting with `data`'s magic, as the kernel knows
/// them for an initramfs.
fn compression(data: &[u8]) -> Option<&'static str> {
    Some(match data {
        [0x1f, 0x8b, ..] => "gzip",
        [0x28, 0xb5, 0x2f, 0xfd, ..] => "zstd",
        [0xfd, b'7', b'z', b'X', b'Z', 0, ..] => "xz",
        [0x02, 0x21, 0x4c, 0x18, ..] => "lz4",
        [b'B', b'Z', b'h', ..] => "bzip2",
        _ => return None,
    })
}

/// Reads one newc archive from the start of `data` up to its trailer into `into`; the
/// bytes it took (4-aligned).
fn read_newc(data: &[u8], into: &mut HashMap<String, CpioEntry>) -> Result<usize, String> {
    let mut at = 0usize;
    loop {
        let header = data
            .get(at..at + NEWC_HEADER)
            .filter(|h| h.starts_with(NEWC))
            .ok_or_else(|| format!("a cpio header expected at byte {at}"))?;
        let field = |i: usize| -> Result<u32, String> {
            let hex = &header[6 + 8 * i..14 + 8 * i];
            std::str::from_utf8(hex)
                .ok()
                .and_then(|h| u32::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("a cpio header field that is not hex at byte {at}"))
        };
        let (mode, size, namesize) = (field(1)?, field(6)? as usize, field(11)? as usize);
        let name_at = at + NEWC_HEADER;
        let name = data
            .get(name_at..name_at + namesize)
            .ok_or_else(|| format!("a cpio name past the end at byte {at}"))?;
        let name = String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned();
        let data_at = (name_at + namesize).next_multiple_of(4);
        let body = data
            .get(data_at..data_at + size)
            .ok_or_else(|| format!("cpio entry {name:?} runs past the end"))?;
        at = (data_at + size).next_multiple_of(4);
        if name == "TRAILER!!!" {
            return Ok(at.min(data.len()));
        }
        let entry = match mode & S_IFMT {
            S_IFREG => CpioEntry::File(body.to_vec()),
            S_IFLNK => CpioEntry::Link(String::from_utf8_lossy(body).into_owned()),
            _ => CpioEntry::Other,
        };
        into.insert(normal(&name), entry);
    }
}

/// `path` without leading `/` and `./`, and without empty or `.` components.
fn normal(path: &str) -> String {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect::<Vec<_>>()
        .join("/")
}

/// The regular file at `path` in an unpacked initramfs, following symbolic links in any
/// component (at most [`MAX_LINKS`]).
pub fn cpio_lookup<'a>(entries: &'a HashMap<String, CpioEntry>, path: &str) -> Option<&'a [u8]> {
    let mut parts: Vec<String> = normal(path).split('/').map(str::to_owned).collect();
    let mut links = 0;
    let mut i = 0;
    while i < parts.len() {
        if parts[i] == ".." {
            parts.remove(i);
            if i > 0 {
                i -= 1;
                parts.remove(i);
            }
            continue;
        }
        let prefix = parts[..=i].join("/");
        if let Some(CpioEntry::Link(target)) = entries.get(&prefix) {
            links += 1;
            if links > MAX_LINKS {
                return None;
            }
            let base = if target.starts_with('/') {
                String::new()
            } else {
                parts[..i].join("/")
            };
            let mut new: Vec<String> = normal(&format!("{base}/{target}"))
                .split('/')
                .filter(|c| !c.is_empty())
                .map(str::to_owned)
                .collect();
            new.extend(parts.drain(i + 1..));
            parts = new;
            i = 0;
            continue;
        }
        i += 1;
    }
    match entries.get(&parts.join("/")) {
        Some(CpioEntry::File(bytes)) => Some(bytes),
        _ => None,
    }
}

/// Where a file was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// Its bytes, and where they came from (the disk or initramfs's path).
    Bytes(Vec<u8>, PathBuf),
    /// Not in any of the run's file systems: why (one sentence).
    Missing(String),
}

/// The run's guest file systems, read on demand: the disks first (a Debian root), then
/// the initramfs (unpacked once, at the first lookup that needs it).
pub struct GuestFiles {
    disks: Vec<PathBuf>,
    /// Disks `debugfs` could not open (not ext2/3/4), and why.
    bad_disks: HashMap<PathBuf, String>,
    initrd: Option<PathBuf>,
    /// The unpacked initramfs, or why it could not be read.
    unpacked: Option<Result<HashMap<String, CpioEntry>, String>>,
}

impl GuestFiles {
    /// The file systems of a run: its raw disks in the guest's order and its initramfs.
    pub fn new(disks: Vec<PathBuf>, initrd: Option<PathBuf>) -> Self {
        GuestFiles {
            disks,
            bad_disks: HashMap::new(),
            initrd,
            unpacked: None,
        }
    }

    /// What the lookups read, for a report's source line.
    pub fn describe(&self) -> String {
        let mut parts: Vec<String> = self.disks.iter().map(|d| d.display().to_string()).collect();
        parts.extend(self.initrd.iter().map(|i| i.display().to_string()));
        if parts.is_empty() {
            "no guest file system".into()
        } else {
            parts.join(" and ")
        }
    }

    /// The file at the guest's `path` (absolute, from the root of its file system).
    pub fn read(&mut self, path: &str) -> Found {
        if !plain_path(path) {
            return Found::Missing(format!("{path:?} is not a path kpin looks up"));
        }
        for disk in self.disks.clone() {
            if self.bad_disks.contains_key(&disk) {
                continue;
            }
            match debugfs_cat(&disk, path) {
                Ok(Some(bytes)) => return Found::Bytes(bytes, disk),
                Ok(None) => {}
                Err(why) => {
                    self.bad_disks.insert(disk, why);
                }
            }
        }
        let initrd = self.initrd.clone();
        if let Some(initrd) = &initrd {
            match self.unpacked.get_or_insert_with(|| unpack_file(initrd)) {
                Ok(entries) => {
                    if let Some(bytes) = cpio_lookup(entries, path) {
                        return Found::Bytes(bytes.to_vec(), initrd.clone());
                    }
                }
                Err(why) => {
                    return Found::Missing(format!("{} unreadable: {why}", initrd.display()))
                }
            }
        }
        let mut why = format!("not in {}", self.describe());
        for (disk, e) in &self.bad_disks {
            why.push_str(&format!(" ({} unreadable: {e})", disk.display()));
        }
        Found::Missing(why)
    }
}

/// Whether `path` is one kpin hands to `debugfs`: absolute, printable, no quote or
/// backslash (its request parser's), not cut by the engine (`...`).
fn plain_path(path: &str) -> bool {
    path.starts_with('/')
        && path.len() < 4096
        && path
            .chars()
            .all(|c| !c.is_control() && c != '"' && c != '\\')
}

/// The initramfs file at `path`, unpacked.
fn unpack_file(path: &Path) -> Result<HashMap<String, CpioEntry>, String> {
    let bytes = read_capped(
        std::fs::File::open(path).map_err(|e| e.to_string())?,
        MAX_INITRAMFS_BYTES,
    )
    .map_err(|e| e.to_string())?
    .ok_or("larger than kpin reads")?;
    let mut entries = HashMap::new();
    let mut decompress = |tool: &'static str, data: &[u8]| host_decompress(tool, data);
    match unpack_initramfs(&bytes, &mut entries, &mut decompress) {
        Ok(()) => Ok(entries),
        // What came before a bad segment is still the guest's files.
        Err(_) if !entries.is_empty() => Ok(entries),
        Err(e) => Err(e),
    }
}

/// `tool -dc` over `data`: its output, as far as it went (a tool that stops at trailing
/// data it does not know still gave the archive).
fn host_decompress(tool: &str, data: &[u8]) -> Result<Vec<u8>, String> {
    let mut child = Command::new(tool)
        .args(["-dc"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run {tool} (the initramfs is {tool}-compressed): {e}"))?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let out = std::thread::scope(|s| {
        // Fed from another thread: the tool writes while it reads.
        s.spawn(move || {
            let _ = stdin.write_all(data);
        });
        read_capped(stdout, MAX_INITRAMFS_BYTES)
    });
    let _ = child.kill();
    let _ = child.wait();
    match out {
        Ok(Some(out)) if !out.is_empty() => Ok(out),
        Ok(Some(_)) => Err(format!("{tool} gave nothing")),
        Ok(None) => Err(format!("{tool}'s output is larger than kpin reads")),
        Err(e) => Err(format!("reading {tool}'s output: {e}")),
    }
}

/// The file at the guest's `path` on the ext2/3/4 image `disk` (`Ok(None)`: not there, or
/// empty); an error if `debugfs` cannot open the image at all.
fn debugfs_cat(disk: &Path, path: &str) -> Result<Option<Vec<u8>>, String> {
    let mut child = Command::new("debugfs")
        .arg("-R")
        .arg(format!("cat \"{path}\""))
        .arg(disk)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run debugfs (e2fsprogs): {e}"))?;
    let stdout = child.stdout.take().ok_or("no stdout")?;
    let mut stderr = child.stderr.take().ok_or("no stderr")?;
    let (out, err) = std::thread::scope(|s| {
        let err = s.spawn(move || {
            let mut e = Vec::new();
            let _ = (&mut stderr).take(64 << 10).read_to_end(&mut e);
            e
        });
        (
            read_capped(stdout, MAX_FILE_BYTES),
            err.join().unwrap_or_default(),
        )
    });
    let _ = child.kill();
    let _ = child.wait();
    let err = String::from_utf8_lossy(&err);
    if let Some(line) = err.lines().find(|l| l.contains("while trying to open")) {
        return Err(line.trim().to_string());
    }
    match out {
        Ok(Some(bytes)) if !bytes.is_empty() => Ok(Some(bytes)),
        Ok(_) => Ok(None),
        Err(e) => Err(format!("reading debugfs's output: {e}")),
    }
}

/// All of `r` if it is at most `cap` bytes (`None`: longer).
fn read_capped(r: impl Read, cap: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    r.take(cap + 1).read_to_end(&mut bytes)?;
    Ok((bytes.len() as u64 <= cap).then_some(bytes))
}

/// newc archives for tests (the host may have no `cpio`).
#[cfg(test)]
pub(crate) mod test_cpio {
    /// A newc entry as the kernel's `gen_init_cpio` writes it.
    pub(crate) fn entry(name: &str, mode: u32, data: &[u8]) -> Vec<u8> {
        let mut e = format!(
            "070701{:08x}{mode:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            1,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            0,
            0,
            name.len() + 1,
            0
        )
        .into_bytes();
        e.extend_from_slice(name.as_bytes());
        e.push(0);
        while e.len() % 4 != 0 {
            e.push(0);
        }
        e.extend_from_slice(data);
        while e.len() % 4 != 0 {
            e.push(0);
        }
        e
    }

    /// A newc archive of `(path, mode, bytes)` entries and its trailer.
    pub(crate) fn archive(entries: &[(&str, u32, &[u8])]) -> Vec<u8> {
        let mut a: Vec<u8> = entries
            .iter()
            .flat_map(|(n, m, d)| entry(n, *m, d))
            .collect();
        a.extend(entry("TRAILER!!!", 0, b""));
        a
    }
}

#[cfg(test)]
mod tests {
    use super::test_cpio::{archive, entry};
    use super::*;

    fn no_tools(tool: &'static str, _: &[u8]) -> Result<Vec<u8>, String> {
        Err(format!("no {tool} in this test"))
    }

    #[test]
    fn test_cpio_files_links_and_later_entries_replacing_earlier_ones() {
        let mut a = archive(&[
            ("bin", 0o040_755, b""),
            ("bin/busybox", 0o100_755, b"old"),
            ("./lib", 0o120_777, b"usr/lib"),
            ("usr/lib/libc.so.6", 0o100_644, b"libc"),
            ("usr/lib/ld.so", 0o120_777, b"/usr/lib/libc.so.6"),
        ]);
        // A second archive after zero padding, as microcode + main initramfs are.
        a.extend([0u8; 512]);
        a.extend(archive(&[("bin/busybox", 0o100_755, b"new busybox")]));
        let mut e = HashMap::new();
        unpack_initramfs(&a, &mut e, &mut no_tools).unwrap();
        assert_eq!(cpio_lookup(&e, "/bin/busybox"), Some(&b"new busybox"[..]));
        assert_eq!(
            cpio_lookup(&e, "/lib/libc.so.6"),
            Some(&b"libc"[..]),
            "a directory link"
        );
        assert_eq!(
            cpio_lookup(&e, "/lib/ld.so"),
            Some(&b"libc"[..]),
            "links in two components"
        );
        assert_eq!(
            cpio_lookup(&e, "/usr/lib/../lib/libc.so.6"),
            Some(&b"libc"[..])
        );
        assert_eq!(cpio_lookup(&e, "/bin"), None, "a directory is no file");
        assert_eq!(cpio_lookup(&e, "/nope"), None);
    }

    #[test]
    fn test_hostile_archives_are_errors_not_panics() {
        let good = archive(&[("a", 0o100_644, b"0123456789")]);
        for cut in 0..good.len() {
            let mut e = HashMap::new();
            let _ = unpack_initramfs(&good[..cut], &mut e, &mut no_tools);
        }
        // A size field far past the end.
        let mut bad = entry("a", 0o100_644, b"x");
        bad[54..62].copy_from_slice(b"ffffffff");
        let mut e = HashMap::new();
        assert!(unpack_initramfs(&bad, &mut e, &mut no_tools)
            .unwrap_err()
            .contains("runs past the end"));
        // A link loop ends.
        let a = archive(&[("x", 0o120_777, b"y"), ("y", 0o120_777, b"x")]);
        let mut e = HashMap::new();
        unpack_initramfs(&a, &mut e, &mut no_tools).unwrap();
        assert_eq!(cpio_lookup(&e, "/x"), None);
        let mut e = HashMap::new();
        assert!(unpack_initramfs(b"garbage", &mut e, &mut no_tools)
            .unwrap_err()
            .contains("unknown data at byte 0"));
    }

    #[test]
    fn test_compressed_segments_go_through_the_host_tools() {
        let dir = std::env::temp_dir().join(format!("kpin-guest-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = archive(&[("bin/prog", 0o100_755, b"\x7fELF prog")]);
        let microcode = archive(&[("kernel/x86/microcode/GenuineIntel.bin", 0o100_644, b"uc")]);
        for tool in ["gzip", "zstd", "xz", "lz4"] {
            let raw = dir.join("plain.cpio");
            std::fs::write(&raw, &plain).unwrap();
            let args: &[&str] = if tool == "lz4" {
                &["-l", "-c"]
            } else {
                &["-c"]
            };
            let out = Command::new(tool).args(args).arg(&raw).output();
            let Some(out) = out.ok().filter(|o| o.status.success()) else {
                eprintln!("skipped {tool}: not on this host");
                continue;
            };
            let mut image = microcode.clone();
            image.extend(out.stdout);
            let initrd = dir.join(format!("initrd.{tool}"));
            std::fs::write(&initrd, &image).unwrap();
            let mut files = GuestFiles::new(vec![], Some(initrd.clone()));
            assert_eq!(
                files.read("/bin/prog"),
                Found::Bytes(b"\x7fELF prog".to_vec(), initrd.clone()),
                "{tool}"
            );
            assert!(
                matches!(files.read("/bin/other"), Found::Missing(_)),
                "{tool}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn test_an_ext4_disk_through_debugfs_and_a_disk_that_is_not_one() {
        let dir = std::env::temp_dir().join(format!("kpin-guest-disk-{}", std::process::id()));
        let root = dir.join("root");
        std::fs::create_dir_all(root.join("usr/bin")).unwrap();
        std::fs::write(root.join("usr/bin/prog"), b"on the disk").unwrap();
        let disk = dir.join("disk.img");
        let made = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-d"])
            .arg(&root)
            .arg(&disk)
            .arg("4M")
            .output();
        if !made.is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: no mkfs.ext4 on this host");
            return;
        }
        let not_ext4 = dir.join("zeros.img");
        std::fs::write(&not_ext4, vec![0u8; 1 << 16]).unwrap();
        let initrd = dir.join("initrd");
        std::fs::write(
            &initrd,
            archive(&[
                ("usr/bin/prog", 0o100_755, b"in the initramfs"),
                ("init", 0o100_755, b"init"),
            ]),
        )
        .unwrap();
        let mut files = GuestFiles::new(vec![not_ext4.clone(), disk.clone()], Some(initrd.clone()));
        // The disk first, then the initramfs; the disk that is not ext4 skipped.
        assert_eq!(
            files.read("/usr/bin/prog"),
            Found::Bytes(b"on the disk".to_vec(), disk)
        );
        assert_eq!(files.read("/init"), Found::Bytes(b"init".to_vec(), initrd));
        let Found::Missing(why) = files.read("/nowhere") else {
            panic!()
        };
        assert!(why.contains("zeros.img unreadable"), "{why}");
        assert!(matches!(files.read("/a\"; rm -rf /"), Found::Missing(_)));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
