//! Fetching, verifying and unpacking pinned Debian packages with the host's own tools.
//!
//! Invariants: a `.deb` is used only after its SHA-256 matched the pin ([`ensure_deb`]); a
//! `.deb` that fails the check is deleted. Members are extracted into a scratch directory and
//! renamed into their final place only once the extraction succeeded, so a destination is
//! never a partial file.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::cache::{self, io_error};
use crate::command::{self, CommandError};
use crate::pins::DebPin;
use crate::ImagesError;

/// Returns the path of the verified `.deb` of `pin` in `download_dir`, downloading it with
/// `apt-get download` unless a copy with the pinned hash is already there.
pub(crate) fn ensure_deb(
    pin: &DebPin,
    download_dir: &Path,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, ImagesError> {
    cache::create_dir_all(download_dir)?;
    let path = download_dir.join(pin.deb_file_name());
    match cache::sha256_file(&path) {
        Ok((sha256, _)) if sha256 == pin.sha256 => return Ok(path),
        Ok(_) => {
            progress(&format!(
                "cached {} has the wrong SHA-256; downloading it again",
                path.display()
            ));
            fs::remove_file(&path).map_err(io_error("remove", &path))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("read", &path)(e)),
    }

    progress(&format!(
        "downloading {} {} ({})",
        pin.package,
        pin.version,
        pin.size_for_humans()
    ));
    let mut cmd = Command::new("apt-get");
    cmd.arg("download")
        .arg(pin.apt_spec())
        .current_dir(download_dir);
    command::run_captured(&mut cmd).map_err(|source| ImagesError::Download {
        package: pin.package,
        version: pin.version,
        command: command::describe(&cmd),
        source,
    })?;

    let (sha256, _) = match cache::sha256_file(&path) {
        Ok(found) => found,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(ImagesError::DownloadMissing {
                package: pin.package,
                command: command::describe(&cmd),
                path,
            })
        }
        Err(e) => return Err(io_error("read", &path)(e)),
    };
    if sha256 != pin.sha256 {
        fs::remove_file(&path).map_err(io_error("remove", &path))?;
        return Err(ImagesError::Checksum {
            package: pin.package,
            version: pin.version,
            path,
            expected: pin.sha256,
            actual: sha256,
        });
    }
    Ok(path)
}

/// One archive member to extract and where to put it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Member<'a> {
    /// Path inside the data archive, as `dpkg-deb -c` lists it (`./boot/...`).
    pub name: &'a str,
    /// Final destination; its directory must exist and be on the same file system as the
    /// scratch directory.
    pub dest: &'a Path,
}

/// Extracts `members` from `deb` through `dpkg-deb --fsys-tarfile | tar -x`, using `scratch`
/// (created, and removed afterwards) as the extraction directory.
///
/// `tar --occurrence=1` stops reading as soon as every member was found: the `System.map` sits
/// near the start of the 283 MB debug package, so this takes well under a second instead of
/// decompressing the whole archive (~15 s). `dpkg-deb` then dies of `SIGPIPE`, which is
/// expected; only `tar`'s status decides success (the `.deb` was verified beforehand).
pub(crate) fn extract_members(
    deb: &Path,
    members: &[Member<'_>],
    scratch: &Path,
) -> Result<(), ImagesError> {
    remove_dir_if_present(scratch)?;
    cache::create_dir_all(scratch)?;

    let mut dpkg = Command::new("dpkg-deb");
    dpkg.arg("--fsys-tarfile").arg(deb);
    let mut tar = Command::new("tar");
    tar.arg("-x")
        .arg("-C")
        .arg(scratch)
        .arg("--occurrence=1")
        .args(members.iter().map(|m| m.name));
    let pipeline = format!("{} | {}", command::describe(&dpkg), command::describe(&tar));
    let extract_error = |source: CommandError| ImagesError::Extract {
        deb: deb.to_path_buf(),
        members: members
            .iter()
            .map(|m| m.name)
            .collect::<Vec<_>>()
            .join(", "),
        command: pipeline.clone(),
        source,
    };

    let mut dpkg_child = dpkg
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| extract_error(CommandError::Spawn(e)))?;
    let dpkg_stdout = dpkg_child
        .stdout
        .take()
        .expect("stdout was configured as piped");
    tar.stdin(dpkg_stdout)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let tar_spawned = tar.spawn();
    // The Command still owns our copy of the pipe's read end; drop it, or dpkg-deb would
    // block forever writing into a pipe nobody reads once tar has found its members.
    drop(tar);
    let tar_result = tar_spawned
        .map_err(CommandError::Spawn)
        .and_then(|child| child.wait_with_output().map_err(CommandError::Wait));
    // Always reap dpkg-deb; with tar gone it exits (SIGPIPE) on its next write.
    let dpkg_output = dpkg_child.wait_with_output();
    let tar_output = tar_result.map_err(extract_error)?;
    if !tar_output.status.success() {
        // Report both tools: when dpkg-deb failed first, its message is the useful one.
        let mut stderr = dpkg_output.map(|o| o.stderr).unwrap_or_default();
        stderr.extend_from_slice(&tar_output.stderr);
        return Err(extract_error(CommandError::Failed {
            status: tar_output.status,
            stderr_tail: command::stderr_tail(&stderr),
        }));
    }

    for member in members {
        let extracted = scratch.join(member.name);
        cache::install_file(&extracted, member.dest)?;
    }
    remove_dir_if_present(scratch)
}

/// Removes `dir` recursively if it exists.
pub(crate) fn remove_dir_if_present(dir: &Path) -> Result<(), ImagesError> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_error("remove directory", dir)(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::tests::ScratchDir;

    /// Builds a minimal `.deb` with `dpkg-deb --build`, or `None` if the tool is missing.
    fn build_test_deb(dir: &Path) -> Option<PathBuf> {
        let root = dir.join("pkg");
        fs::create_dir_all(root.join("DEBIAN")).expect("mkdir");
        fs::create_dir_all(root.join("boot")).expect("mkdir");
        fs::write(
            root.join("DEBIAN/control"),
            "Package: kpin-test\nVersion: 1.0\nArchitecture: amd64\n\
             Maintainer: kpin <kpin@invalid>\nDescription: test\n",
        )
        .expect("write control");
        fs::write(root.join("boot/a"), b"member a").expect("write");
        fs::write(root.join("boot/b"), b"member b").expect("write");
        let deb = dir.join("test.deb");
        let status = Command::new("dpkg-deb")
            .args(["--build", "--root-owner-group"])
            .arg(&root)
            .arg(&deb)
            .stdout(Stdio::null())
            .status()
            .ok()?;
        status.success().then_some(deb)
    }

    #[test]
    fn test_ensure_deb_reports_failed_download_with_command_and_hint() {
        let dir = ScratchDir::new("deb-download");
        let pin = DebPin {
            package: "kpin-no-such-package",
            version: "0.0-0",
            arch: "amd64",
            sha256: "0000000000000000000000000000000000000000000000000000000000000000",
            size_bytes: 1,
        };
        let mut lines = Vec::new();
        let err = ensure_deb(&pin, &dir.0, &mut |l| lines.push(l.to_owned()))
            .expect_err("the package does not exist");
        assert!(lines[0].starts_with("downloading kpin-no-such-package 0.0-0"));
        let ImagesError::Download { command, .. } = &err else {
            panic!("unexpected error {err:?}");
        };
        assert!(
            command.ends_with("apt-get download kpin-no-such-package=0.0-0"),
            "{command}"
        );
        assert!(err.to_string().contains("apt-get update"), "{err}");
    }

    #[test]
    fn test_extract_members_installs_requested_files() {
        let dir = ScratchDir::new("deb");
        let Some(deb) = build_test_deb(&dir.0) else {
            println!("SKIPPED: dpkg-deb is not available");
            return;
        };
        let dest = dir.0.join("b-out");
        extract_members(
            &deb,
            &[Member {
                name: "./boot/b",
                dest: &dest,
            }],
            &dir.0.join("scratch"),
        )
        .expect("extract");
        assert_eq!(fs::read(&dest).expect("read"), b"member b");
        assert!(!dir.0.join("scratch").exists());
    }

    #[test]
    fn test_extract_members_reports_missing_member() {
        let dir = ScratchDir::new("deb-missing");
        let Some(deb) = build_test_deb(&dir.0) else {
            println!("SKIPPED: dpkg-deb is not available");
            return;
        };
        let dest = dir.0.join("out");
        let err = extract_members(
            &deb,
            &[Member {
                name: "./boot/nope",
                dest: &dest,
            }],
            &dir.0.join("scratch"),
        )
        .expect_err("member is missing");
        let ImagesError::Extract {
            command, source, ..
        } = &err
        else {
            panic!("unexpected error {err:?}");
        };
        assert!(command.contains("tar -x"), "{command}");
        assert!(source.stderr_tail().contains("Not found"), "{source}");
        assert!(!dest.exists());
    }
}
