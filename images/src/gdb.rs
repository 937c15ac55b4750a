//! A debugger for the guest: Debian's `gdb-minimal` (gdb without Python, pinned in
//! `pins.rs`), whose `gdb` is extracted to `images/out/gdb-minimal/gdb`, and an initramfs
//! overlay that runs one gdb script against one program inside the guest
//! (tests/linux_gdb_in_guest.rs). The overlay carries the host's copies of gdb's shared
//! libraries, as the host's dynamic loader resolves them: the host is the same Debian
//! release the package is built for, so the one binary runs natively on the host and in
//! the guest, and the two transcripts can be compared line by line.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cache::io_error;
use crate::pins::GDB_MINIMAL;
use crate::{command, ImagesError};

/// Printed on the guest's console before gdb's transcript.
pub const GDB_BEGIN: &str = "KPIN-GDB-BEGIN";
/// Printed after it, followed by gdb's exit status.
pub const GDB_END: &str = "KPIN-GDB-END";

/// The overlay's `/init`: gdb in batch mode on `/prog` with `/gdb.cmd`, between the two
/// markers, then a reset (the VMM boots Linux with `reboot=k` and treats the i8042 reset
/// as a clean exit).
const INIT: &str = "#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs dev /dev
cd /
echo KPIN-GDB-BEGIN
SHELL=/bin/sh /usr/bin/gdb -nx -batch -x /gdb.cmd /prog 2>&1
echo KPIN-GDB-END $?
/bin/busybox reboot -f
";

/// Makes sure `out_dir/gdb-minimal/gdb` is extracted from the pinned, verified package;
/// returns its path.
pub fn ensure_gdb(out_dir: &Path, progress: &mut dyn FnMut(&str)) -> Result<PathBuf, ImagesError> {
    crate::overlay::ensure_member(
        out_dir,
        &GDB_MINIMAL,
        "./usr/bin/gdb",
        "gdb-minimal",
        "gdb",
        progress,
    )
}

/// The shared libraries `binary` loads, and the dynamic loader, as the host resolves them
/// (`ldd`); absolute paths.
fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>, ImagesError> {
    let mut cmd = Command::new("ldd");
    cmd.arg(binary);
    let out = command::run_captured(&mut cmd).map_err(|source| ImagesError::GdbLibraries {
        command: command::describe(&cmd),
        source,
    })?;
    let text = String::from_utf8_lossy(&out.stdout);
    let missing: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("not found"))
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    if !missing.is_empty() {
        return Err(ImagesError::GdbMissingLibraries {
            missing: missing.join(", "),
        });
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        // `libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)` or
        // `/lib64/ld-linux-x86-64.so.2 (0x…)`; the vDSO has no path.
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    Ok(libs)
}

/// glibc's character-set converters on the host (Debian's multiarch path): gdb converts
/// names to UTF-32 through them, and warns on every name without them.
const GCONV_DIR: &str = "/usr/lib/x86_64-linux-gnu/gconv";

/// The core converters `GCONV_DIR/gconv-modules` names (UTF-16, UTF-32, UTF-7, …) and the
/// file itself, when the host has them: the overlay then converts as the host does.
fn gconv_files() -> Vec<PathBuf> {
    let dir = Path::new(GCONV_DIR);
    let Ok(config) = std::fs::read_to_string(dir.join("gconv-modules")) else {
        return Vec::new();
    };
    let mut files = vec![dir.join("gconv-modules")];
    for line in config.lines() {
        // `module FROM TO FILE [COST]`
        let mut words = line.split_whitespace();
        if words.next() != Some("module") {
            continue;
        }
        if let Some(file) = words.nth(2) {
            let so = dir.join(format!("{file}.so"));
            if so.is_file() && !files.contains(&so) {
                files.push(so);
            }
        }
    }
    files
}

/// An initramfs overlay (a newc archive to append to the busybox initramfs) whose `/init`
/// runs `gdb` (with its shared libraries and glibc's core character-set converters at
/// their host paths) in batch mode with `script`
/// on `program`, printing [`GDB_BEGIN`], the transcript and [`GDB_END`] with gdb's exit
/// status on the console.
pub fn gdb_overlay(gdb: &Path, program: &Path, script: &str) -> Result<Vec<u8>, ImagesError> {
    let read = |p: &Path| std::fs::read(p).map_err(io_error("read", p));
    let mut libs = Vec::new();
    for lib in shared_libraries(gdb)?.into_iter().chain(gconv_files()) {
        let data = read(&lib)?;
        libs.push((
            lib.to_string_lossy().trim_start_matches('/').to_owned(),
            data,
        ));
    }
    let (gdb, program) = (read(gdb)?, read(program)?);
    let mut files: Vec<(&str, &[u8], u32)> = libs
        .iter()
        .map(|(path, data)| (path.as_str(), data.as_slice(), 0o755))
        .collect();
    files.extend([
        ("usr/bin/gdb", gdb.as_slice(), 0o755),
        ("prog", program.as_slice(), 0o755),
        ("gdb.cmd", script.as_bytes(), 0o644),
        ("init", INIT.as_bytes(), 0o755),
    ]);
    crate::overlay::overlay(&files)
}
