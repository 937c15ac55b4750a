//! The path of a file the guest kernel has open, read from its dentries: a task's
//! executable ([`read_exe`]) and the files its code is mapped from (`super::origins`).

use kpin_abi::attach::KernelTypes;

use super::KERNEL_HALF;

/// Bytes of an executable's path kept (a longer path keeps its end, after `...`).
pub const EXE_BYTES: usize = 96;
/// Path components read up from the executable's dentry: its name and 7 directories
/// (a deeper path starts with `...`).
pub const EXE_COMPONENTS: usize = 8;
/// Bytes of one path component read (a longer name is cut).
const COMPONENT_BYTES: usize = 64;
/// What marks a path that does not reach its file system's root.
const CUT: &[u8] = b"...";

/// The path of a file (a task's executable, a file code is mapped from) as far as
/// [`read_path`] walked it: `/bin/busybox`, or `.../lib/x` when cut, relative to the root
/// of the file system that holds it; or a name such as `[anon]` ([`ExePath::named`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct ExePath {
    bytes: [u8; EXE_BYTES],
    len: u8,
}

impl ExePath {
    /// A name that is no file's (`[anon]`, `[vdso]`), at most [`EXE_BYTES`] long.
    pub fn named(name: &[u8]) -> Self {
        let len = name.len().min(EXE_BYTES);
        let mut bytes = [0; EXE_BYTES];
        bytes[..len].copy_from_slice(&name[..len]);
        ExePath {
            bytes,
            len: len as u8,
        }
    }

    /// The path's bytes.
    pub fn path(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The file's own name: the path's last component.
    pub fn name(&self) -> &[u8] {
        let p = self.path();
        p.rsplit(|&b| b == b'/').next().unwrap_or(p)
    }
}

impl core::fmt::Debug for ExePath {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "ExePath({:?})", core::str::from_utf8(self.path()))
    }
}

/// A path built from its end: components are put in front.
struct PathFromEnd {
    buf: [u8; EXE_BYTES],
    start: usize,
}

impl PathFromEnd {
    fn new() -> Self {
        PathFromEnd {
            buf: [0; EXE_BYTES],
            start: EXE_BYTES,
        }
    }

    /// Puts `/name` in front, keeping room for [`CUT`]; false if it does not fit.
    fn push(&mut self, name: &[u8]) -> bool {
        if self.start < name.len() + 1 + CUT.len() {
            return false;
        }
        self.start -= name.len();
        self.buf[self.start..self.start + name.len()].copy_from_slice(name);
        self.start -= 1;
        self.buf[self.start] = b'/';
        true
    }

    /// The path; `cut`: it did not reach the root, so it starts with [`CUT`].
    fn finish(mut self, cut: bool) -> ExePath {
        if cut {
            self.start -= CUT.len();
            self.buf[self.start..self.start + CUT.len()].copy_from_slice(CUT);
        }
        let len = EXE_BYTES - self.start;
        let mut bytes = [0; EXE_BYTES];
        bytes[..len].copy_from_slice(&self.buf[self.start..]);
        ExePath {
            bytes,
            len: len as u8,
        }
    }
}

/// A read on the way to a file's path faulted, or a pointer was not a kernel address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unreadable;

/// The path of the executable of the task at `task` (`Ok(None)`: it has none: no `mm`, as
/// a kernel thread or an exiting task, or no `exe_file`; `Err`: a read faulted or a
/// pointer was not a kernel address). Reads `mm`, `exe_file` and its dentry, then the
/// path ([`read_path`]).
pub fn read_exe(
    t: &KernelTypes,
    task: u64,
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
) -> Result<Option<ExePath>, Unreadable> {
    let mm = word(read, task.wrapping_add(u64::from(t.task_mm)))?;
    if mm == 0 {
        return Ok(None);
    }
    let file = word(read, kernel(mm)?.wrapping_add(u64::from(t.mm_exe_file)))?;
    if file == 0 {
        return Ok(None);
    }
    read_path(t, file_dentry(t, file, read)?, read).map(Some)
}

/// The dentry of the open file at `file` (`file->f_path.dentry`).
pub fn file_dentry(
    t: &KernelTypes,
    file: u64,
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
) -> Result<u64, Unreadable> {
    kernel(word(
        read,
        kernel(file)?.wrapping_add(u64::from(t.file_dentry)),
    )?)
}

/// The path of the file whose dentry is at `dentry`: per component its name's length,
/// pointer and bytes and `d_parent`, up to [`EXE_COMPONENTS`] components or the root (the
/// dentry that is its own parent).
pub fn read_path(
    t: &KernelTypes,
    mut dentry: u64,
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
) -> Result<ExePath, Unreadable> {
    let mut path = PathFromEnd::new();
    let mut cut = true;
    for _ in 0..EXE_COMPONENTS {
        let parent = kernel(word(read, dentry.wrapping_add(u64::from(t.dentry_parent)))?)?;
        if parent == dentry && path.start < EXE_BYTES {
            // The root (its name is `/`), below the file itself.
            cut = false;
            break;
        }
        let mut four = [0u8; 4];
        if !read(dentry.wrapping_add(u64::from(t.dentry_name_len)), &mut four) {
            return Err(Unreadable);
        }
        let len = (u32::from_le_bytes(four) as usize).min(COMPONENT_BYTES);
        let at = kernel(word(read, dentry.wrapping_add(u64::from(t.dentry_name)))?)?;
        let mut name = [0u8; COMPONENT_BYTES];
        if !read(at, &mut name[..len]) {
            return Err(Unreadable);
        }
        if !path.push(&name[..len]) {
            break;
        }
        if parent == dentry {
            cut = false;
            break;
        }
        dentry = parent;
    }
    Ok(path.finish(cut))
}

/// The `u64` at `va`.
pub(super) fn word(
    read: &mut dyn FnMut(u64, &mut [u8]) -> bool,
    va: u64,
) -> Result<u64, Unreadable> {
    let mut b = [0u8; 8];
    if read(va, &mut b) {
        Ok(u64::from_le_bytes(b))
    } else {
        Err(Unreadable)
    }
}

/// `p` if it is a kernel address.
pub(super) fn kernel(p: u64) -> Result<u64, Unreadable> {
    if p >= KERNEL_HALF {
        Ok(p)
    } else {
        Err(Unreadable)
    }
}
