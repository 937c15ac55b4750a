//! Where a Linux guest keeps its running task, from the kernel's own types: its BTF (the
//! `.BTF` section of an ELF vmlinux, which Debian's kernels carry: `CONFIG_DEBUG_INFO_BTF`)
//! gives the offsets in `struct task_struct` of `pid`, `tgid` and `comm`, and where the
//! per-CPU pointer to the running task is: the per-CPU variable `current_task` (6.1) or
//! the member `current_task` of the per-CPU `struct pcpu_hot` (6.2 and later). The engine
//! reads them from the attach block ([`kpin_abi::attach::KernelTypes`]) and names the
//! processes it sees run (`docs/processes.md`). BTF also gives the way from a task to the
//! name of its executable file: `task->mm->exe_file->f_path.dentry->d_name` and the
//! dentry's `d_parent` (for a path); without those the tasks are still named by `comm`.
//! And it gives the way from a task to the VMA that maps a user address, for the file the
//! code there came from: `mm->mm_mt` (the maple tree of VMAs, its node layouts from
//! `struct maple_range_64` and `struct maple_arange_64`) and `vm_area_struct`'s
//! `vm_start`, `vm_end`, `vm_pgoff`, `vm_file` (and `mm->context.vdso`, to tell the vDSO);
//! without those the engine records no code origins.
//! A bzImage's BTF is in its compressed payload: the vmlinux is decompressed in memory
//! first (`kpin_images::vmlinux_from_bzimage`).
//!
//! The per-CPU variable's place comes from BTF too: the `.data..percpu` data section
//! lists each per-CPU variable with its offset, and on x86-64 that section is linked at 0,
//! so the offset is the variable's address relative to the kernel's per-CPU base (the GS
//! base at CPL 0). KASLR does not move it (the kernel does not relocate per-CPU
//! symbols), so no System.map or slide is needed; the tests check the offsets against
//! the pinned kernels' System.map.
//!
//! Invariants: [`from_kernel`] reads only the ELF headers and the `.BTF` section (of the
//! decompressed payload, for a bzImage); a kernel without BTF (a kernel built without it,
//! BTF without one of the types, a payload that does not decompress) is an error saying
//! why, never a guess: the engine then reports by address space.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use btfparse::{Offset, Readable, TypeInformation, TypeVariant};
use kpin_abi::attach::{KernelTypes, MapleLayout, MAX_COMM_BYTES};

/// Name of the data section that holds the per-CPU variables.
const PERCPU_SECTION: &str = ".data..percpu";
/// Largest `.BTF` section read (Debian's 6.12 kernels have 4.7 MB).
const MAX_BTF_BYTES: u64 = 64 << 20;

/// The running task's place and fields found in `kernel`'s BTF, with a note on where they
/// came from, or why there are none. `kernel` is an ELF vmlinux (its `.BTF` section is
/// read in place) or a bzImage (its payload is decompressed in memory first:
/// [`kpin_images::vmlinux_from_bzimage`], ~0.3 s for the pinned 6.12's zstd).
pub fn from_kernel(kernel: &Path) -> Result<(KernelTypes, String), String> {
    let (btf, source) = match elf_section(&FileBytes::open(kernel)?, ".BTF")? {
        Some(btf) => (btf, format!("BTF of {}", kernel.display())),
        None if is_bzimage(kernel) => {
            let elf = vmlinux_of(kernel)?;
            let btf = elf_section(&elf.as_slice(), ".BTF")?.ok_or_else(|| {
                format!(
                    "the vmlinux in {}'s payload has no .BTF section (kpin reads BTF from a kernel built with CONFIG_DEBUG_INFO_BTF)",
                    kernel.display()
                )
            })?;
            (btf, format!("BTF of {}'s payload", kernel.display()))
        }
        None => {
            return Err(format!(
                "{} has no .BTF section (kpin reads BTF from an ELF vmlinux or a bzImage built with CONFIG_DEBUG_INFO_BTF)",
                kernel.display()
            ))
        }
    };
    let (types, how) = from_btf(&btf)?;
    Ok((types, format!("{source} ({how})")))
}

/// Whether `path` starts like a bzImage (the setup header's `HdrS` at 0x202).
fn is_bzimage(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut magic, 0x202))
        .is_ok_and(|()| magic == *b"HdrS")
}

/// The vmlinux ELF inside the bzImage `kernel`, decompressed in a scratch directory of this
/// call's own (runs and tests may read one bzImage at the same time).
fn vmlinux_of(kernel: &Path) -> Result<Vec<u8>, String> {
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let scratch = std::env::temp_dir().join(format!("kpin-btf-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| format!("{}: {e}", scratch.display()))?;
    let elf = kpin_images::vmlinux_from_bzimage(kernel, &scratch)
        .map_err(|e| format!("the vmlinux in the bzImage {}: {e}", kernel.display()));
    let _ = std::fs::remove_dir_all(&scratch);
    elf
}

/// The running task's place and fields in raw BTF `btf` (a `.BTF` section), with how
/// `current` is found (`current_task` or `pcpu_hot.current_task`) and, if the executable's
/// offsets are not all there, why (the task is still named by `comm`), or if the VMAs'
/// are not, why (`no code origins: …`).
pub fn from_btf(btf: &[u8]) -> Result<(KernelTypes, String), String> {
    let info =
        TypeInformation::new(&Buffer(btf)).map_err(|e| format!("the BTF does not parse: {e:?}"))?;
    let task = struct_id(&info, "task_struct")?;
    let field = |name: &str| -> Result<(u32, u32), String> {
        match info.offset_of(task, name) {
            Ok((tid, Offset::ByteOffset(off))) => Ok((tid, off)),
            Ok(_) => Err(format!("task_struct.{name} is a bit field")),
            Err(e) => Err(format!("task_struct.{name}: {e:?}")),
        }
    };
    let (_, pid) = field("pid")?;
    let (_, tgid) = field("tgid")?;
    let (comm_type, comm) = field("comm")?;
    let comm_bytes = info
        .size_of(comm_type)
        .map_err(|e| format!("task_struct.comm's size: {e:?}"))?;
    let comm_bytes = u32::try_from(comm_bytes)
        .ok()
        .filter(|n| (1..=MAX_COMM_BYTES).contains(n))
        .ok_or_else(|| format!("task_struct.comm has {comm_bytes} bytes"))?;
    let (current_task, how) = match percpu_offset(&info, "pcpu_hot") {
        Some(hot) => {
            let s = struct_id(&info, "pcpu_hot")?;
            match info.offset_of(s, "current_task") {
                Ok((_, Offset::ByteOffset(off))) => (hot + u64::from(off), "pcpu_hot.current_task"),
                _ => return Err("pcpu_hot has no current_task".into()),
            }
        }
        None => match percpu_offset(&info, "current_task") {
            Some(off) => (off, "current_task"),
            None => {
                return Err(format!(
                    "neither pcpu_hot nor current_task is a per-CPU variable in {PERCPU_SECTION}"
                ))
            }
        },
    };
    let types = KernelTypes {
        current_task,
        task_pid: pid,
        task_tgid: tgid,
        task_comm: comm,
        comm_bytes,
        ..KernelTypes::UNKNOWN
    };
    if !types.is_known() {
        return Err(format!("implausible offsets {types:?}"));
    }
    match exe_offsets(&info, types) {
        Ok(with_exe) => match vma_offsets(&info, with_exe) {
            Ok(with_vmas) => Ok((with_vmas, how.to_owned())),
            Err(why) => Ok((with_exe, format!("{how}; {NO_CODE_ORIGINS}: {why}"))),
        },
        Err(why) => Ok((types, format!("{how}; no executables: {why}"))),
    }
}

/// Version of the cache file's format ([`from_kernel_cached`]).
const CACHE_FORMAT: &str = "kpin-kernel-types 1";

/// [`from_kernel`], remembered in `cache_dir` for the same kernel file: parsing a
/// distribution kernel's BTF takes ~0.1 s of CPU at every `kpin run`. An entry holds only
/// for the file it was made from — its path, size, modification time, device and inode —
/// and the kpin executable that made it (the same checks, of `/proc/self/exe`: a rebuilt
/// kpin reads the BTF again); anything else, or a cache that cannot be read or written, is
/// a plain [`from_kernel`]. Errors are not remembered.
pub fn from_kernel_cached(
    kernel: &Path,
    cache_dir: &Path,
) -> Result<(KernelTypes, String), String> {
    let Some(key) = cache_key(kernel) else {
        return from_kernel(kernel);
    };
    let file = cache_dir.join(format!("{:016x}", fnv1a(key.as_bytes())));
    if let Some(found) = std::fs::read_to_string(&file)
        .ok()
        .and_then(|text| parse_cached(&text, &key))
    {
        return Ok(found);
    }
    let (types, source) = from_kernel(kernel)?;
    // Best effort: written whole under a temporary name, then renamed into place.
    let tmp = file.with_extension(format!("tmp-{}", std::process::id()));
    let text = format!(
        "{CACHE_FORMAT}\n{key}\n{}\n{source}\n",
        types_fields(&types)
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    if std::fs::create_dir_all(cache_dir).is_ok() && std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, &file);
        let _ = std::fs::remove_file(&tmp);
    }
    Ok((types, source))
}

/// What a cache entry for `kernel` must say it was made from ([`from_kernel_cached`]), or `None`
/// if either file's metadata cannot be read.
fn cache_key(kernel: &Path) -> Option<String> {
    let path = std::fs::canonicalize(kernel).ok()?;
    let kernel_seen = kpin_images::seen_line(&std::fs::metadata(&path).ok()?);
    let exe_seen = kpin_images::seen_line(&std::fs::metadata("/proc/self/exe").ok()?);
    Some(format!("{} {kernel_seen} exe {exe_seen}", path.display()))
}

/// The types and note of a cache file's `text`, if it is one for `key`.
fn parse_cached(text: &str, key: &str) -> Option<(KernelTypes, String)> {
    let mut lines = text.lines();
    if lines.next()? != CACHE_FORMAT || lines.next()? != key {
        return None;
    }
    let values: Vec<u64> = lines
        .next()?
        .split(' ')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let source = lines.next()?.to_owned();
    Some((types_from_fields(&values)?, source))
}

/// Every field of `t`, in declaration order.
fn types_fields(t: &KernelTypes) -> [u64; 25] {
    let m = &t.maple;
    [
        t.current_task,
        t.task_pid.into(),
        t.task_tgid.into(),
        t.task_comm.into(),
        t.comm_bytes.into(),
        t.task_mm.into(),
        t.mm_exe_file.into(),
        t.file_dentry.into(),
        t.dentry_name_len.into(),
        t.dentry_name.into(),
        t.dentry_parent.into(),
        t.mm_mt_root.into(),
        t.mm_vdso.into(),
        t.vma_start.into(),
        t.vma_end.into(),
        t.vma_pgoff.into(),
        t.vma_file.into(),
        m.range_pivot.into(),
        m.range_slot.into(),
        m.range_meta.into(),
        m.range_pivots.into(),
        m.arange_pivot.into(),
        m.arange_slot.into(),
        m.arange_meta.into(),
        m.arange_pivots.into(),
    ]
}

/// The inverse of [`types_fields`]; `None` if there are not 25 values or one does not fit
/// its field.
fn types_from_fields(v: &[u64]) -> Option<KernelTypes> {
    let v: &[u64; 25] = v.try_into().ok()?;
    let w = |i: usize| u32::try_from(v[i]).ok();
    let h = |i: usize| u16::try_from(v[i]).ok();
    Some(KernelTypes {
        current_task: v[0],
        task_pid: w(1)?,
        task_tgid: w(2)?,
        task_comm: w(3)?,
        comm_bytes: w(4)?,
        task_mm: w(5)?,
        mm_exe_file: w(6)?,
        file_dentry: w(7)?,
        dentry_name_len: w(8)?,
        dentry_name: w(9)?,
        dentry_parent: w(10)?,
        mm_mt_root: w(11)?,
        mm_vdso: w(12)?,
        vma_start: w(13)?,
        vma_end: w(14)?,
        vma_pgoff: w(15)?,
        vma_file: w(16)?,
        maple: MapleLayout {
            range_pivot: h(17)?,
            range_slot: h(18)?,
            range_meta: h(19)?,
            range_pivots: h(20)?,
            arange_pivot: h(21)?,
            arange_slot: h(22)?,
            arange_meta: h(23)?,
            arange_pivots: h(24)?,
        },
    })
}

/// FNV-1a 64 of `bytes`: the cache file's name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A kernel's types, or the thread still finding them: parsing a distribution kernel's
/// BTF takes ~0.1 s, which `kpin run` overlaps with building the engine image and the VM
/// ([`Pending::start`]); the engine's entry takes them ([`Pending::get`]).
#[derive(Clone, Debug)]
pub struct Pending(Arc<Mutex<PendingState>>);

#[derive(Debug)]
enum PendingState {
    Ready(KernelTypes),
    Finding(JoinHandle<KernelTypes>),
}

impl Pending {
    /// Types known already.
    pub fn ready(types: KernelTypes) -> Self {
        Self(Arc::new(Mutex::new(PendingState::Ready(types))))
    }

    /// Runs `find` on a thread of its own (if no thread can be started: unknown types,
    /// with a warning).
    pub fn start(find: impl FnOnce() -> KernelTypes + Send + 'static) -> Self {
        match std::thread::Builder::new()
            .name("kpin-btf".into())
            .spawn(find)
        {
            Ok(handle) => Self(Arc::new(Mutex::new(PendingState::Finding(handle)))),
            Err(e) => {
                eprintln!("kpin: warning: processes are reported by address space (CR3): no thread to read the kernel's BTF: {e}");
                Self::ready(KernelTypes::UNKNOWN)
            }
        }
    }

    /// The types, waiting for the thread if it still runs; a thread that panicked (a BTF
    /// btfparse could not take) gives `KernelTypes::UNKNOWN`: processes by address space.
    pub fn get(&self) -> KernelTypes {
        let Ok(mut state) = self.0.lock() else {
            return KernelTypes::UNKNOWN;
        };
        let types = match std::mem::replace(&mut *state, PendingState::Ready(KernelTypes::UNKNOWN)) {
            PendingState::Ready(types) => types,
            PendingState::Finding(handle) => handle.join().unwrap_or_else(|_| {
                eprintln!("kpin: warning: processes are reported by address space (CR3): reading the kernel's BTF failed");
                KernelTypes::UNKNOWN
            }),
        };
        *state = PendingState::Ready(types);
        types
    }
}

/// What [`from_btf`]'s note says when the VMAs cannot be found (`kpin run` warns).
pub const NO_CODE_ORIGINS: &str = "no code origins";

/// The byte offset of `path` in struct `s`.
fn member(info: &TypeInformation, s: &str, path: &str) -> Result<u32, String> {
    match info.offset_of(struct_id(info, s)?, path) {
        Ok((_, Offset::ByteOffset(off))) => Ok(off),
        Ok(_) => Err(format!("{s}.{path} is a bit field")),
        Err(e) => Err(format!("{s}.{path}: {e:?}")),
    }
}

/// `types` with the offsets on the way from a task's `mm` to the VMA that maps an address:
/// the maple tree's root (`mm_struct.mm_mt.ma_root`), its node layouts, `vm_area_struct`'s
/// range, page offset and file, and (optional) `mm_struct.context.vdso`.
fn vma_offsets(info: &TypeInformation, types: KernelTypes) -> Result<KernelTypes, String> {
    let small = |s: &str, path: &str| -> Result<u16, String> {
        let off = member(info, s, path)?;
        u16::try_from(off).map_err(|_| format!("{s}.{path} at {off:#x}"))
    };
    // The number of pivots: the `pivot` array's size in u64s.
    let pivots = |s: &str| -> Result<u16, String> {
        let (tid, _) = info
            .offset_of(struct_id(info, s)?, "pivot")
            .map_err(|e| format!("{s}.pivot: {e:?}"))?;
        let bytes = info
            .size_of(tid)
            .map_err(|e| format!("{s}.pivot's size: {e:?}"))?;
        u16::try_from(bytes / 8).map_err(|_| format!("{s}.pivot has {bytes} bytes"))
    };
    let maple = MapleLayout {
        range_pivot: small("maple_range_64", "pivot")?,
        range_slot: small("maple_range_64", "slot")?,
        range_meta: small("maple_range_64", "meta")?,
        range_pivots: pivots("maple_range_64")?,
        arange_pivot: small("maple_arange_64", "pivot")?,
        arange_slot: small("maple_arange_64", "slot")?,
        arange_meta: small("maple_arange_64", "meta")?,
        arange_pivots: pivots("maple_arange_64")?,
    };
    let t = KernelTypes {
        mm_mt_root: member(info, "mm_struct", "mm_mt.ma_root")?,
        // Without it the vDSO's code is `[anon]`.
        mm_vdso: member(info, "mm_struct", "context.vdso").unwrap_or(0),
        vma_start: member(info, "vm_area_struct", "vm_start")?,
        vma_end: member(info, "vm_area_struct", "vm_end")?,
        vma_pgoff: member(info, "vm_area_struct", "vm_pgoff")?,
        vma_file: member(info, "vm_area_struct", "vm_file")?,
        maple,
        ..types
    };
    if t.knows_vmas() {
        Ok(t)
    } else {
        Err(format!("implausible offsets {t:?}"))
    }
}

/// `types` with the offsets on the way from a task to its executable's name:
/// `task->mm->exe_file->f_path.dentry->d_name` (`len`, `name`) and `d_parent`.
fn exe_offsets(info: &TypeInformation, types: KernelTypes) -> Result<KernelTypes, String> {
    let at = |s: &str, path: &str| member(info, s, path);
    let t = KernelTypes {
        task_mm: at("task_struct", "mm")?,
        mm_exe_file: at("mm_struct", "exe_file")?,
        file_dentry: at("file", "f_path.dentry")?,
        dentry_name_len: at("dentry", "d_name.len")?,
        dentry_name: at("dentry", "d_name.name")?,
        dentry_parent: at("dentry", "d_parent")?,
        ..types
    };
    if t.knows_exe() {
        Ok(t)
    } else {
        Err(format!("implausible offsets {t:?}"))
    }
}

/// The id of the struct (not a variable or forward declaration of the same name) `name`.
fn struct_id(info: &TypeInformation, name: &str) -> Result<u32, String> {
    info.get()
        .iter()
        .find(|(_, t)| matches!(t, TypeVariant::Struct(s) if s.name().as_deref() == Some(name)))
        .map(|(&id, _)| id)
        .ok_or_else(|| format!("the BTF has no struct {name}"))
}

/// The offset of per-CPU variable `name` in the `.data..percpu` data section.
fn percpu_offset(info: &TypeInformation, name: &str) -> Option<u64> {
    info.get().values().find_map(|t| {
        let TypeVariant::DataSec(d) = t else {
            return None;
        };
        if d.name().as_deref() != Some(PERCPU_SECTION) {
            return None;
        }
        d.variable_list().iter().find_map(|v| {
            matches!(info.from_id(v.var_decl_id),
                Some(TypeVariant::Var(var)) if var.name().as_deref() == Some(name))
            .then_some(u64::from(v.offset))
        })
    })
}

/// A byte slice as btfparse reads it.
struct Buffer<'a>(&'a [u8]);

impl Readable for Buffer<'_> {
    fn read(&self, offset: u64, out: &mut [u8]) -> btfparse::Result<()> {
        let start = usize::try_from(offset).ok();
        match start.and_then(|s| self.0.get(s..s.checked_add(out.len())?)) {
            Some(b) => {
                out.copy_from_slice(b);
                Ok(())
            }
            None => Err(btfparse::Error::new(
                btfparse::ErrorKind::EOF,
                "read past the end of the BTF",
            )),
        }
    }
}

/// Bytes at an offset of a file or of memory: what [`elf_section`] reads.
trait Bytes {
    /// `len` bytes at `off` (`None`: past the end, or unreadable).
    fn at(&self, off: u64, len: u64) -> Option<Vec<u8>>;
    /// What the bytes are, for messages.
    fn what(&self) -> String;
}

/// An open file read at offsets.
struct FileBytes<'a>(std::fs::File, &'a Path);

impl<'a> FileBytes<'a> {
    fn open(path: &'a Path) -> Result<Self, String> {
        let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(FileBytes(f, path))
    }
}

impl Bytes for FileBytes<'_> {
    fn at(&self, off: u64, len: u64) -> Option<Vec<u8>> {
        let mut b = vec![0; usize::try_from(len).ok()?];
        self.0.read_exact_at(&mut b, off).ok().map(|()| b)
    }
    fn what(&self) -> String {
        self.1.display().to_string()
    }
}

impl Bytes for &[u8] {
    fn at(&self, off: u64, len: u64) -> Option<Vec<u8>> {
        let start = usize::try_from(off).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        self.get(start..end).map(<[u8]>::to_vec)
    }
    fn what(&self) -> String {
        "the decompressed vmlinux".into()
    }
}

/// The bytes of section `name` of the little-endian ELF64 file in `file` (`None`: not
/// such a file, or no such section), reading only its headers and that section.
fn elf_section(file: &dyn Bytes, name: &str) -> Result<Option<Vec<u8>>, String> {
    let read = |off: u64, len: u64| file.at(off, len);
    let Some(header) = read(0, 64) else {
        return Ok(None);
    };
    if header[..6] != *b"\x7fELF\x02\x01" {
        return Ok(None);
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let shoff = u64_at(&header, 0x28);
    let shentsize = u64::from(u16_at(&header, 0x3a));
    let shnum = u64::from(u16_at(&header, 0x3c));
    let shstrndx = u64::from(u16_at(&header, 0x3e));
    if shentsize < 0x40 || shstrndx >= shnum {
        return Ok(None);
    }
    let Some(table) = read(shoff, shnum * shentsize) else {
        return Ok(None);
    };
    let sh = |i: u64| &table[(i * shentsize) as usize..][..0x40];
    let names = sh(shstrndx);
    let (names_off, names_len) = (u64_at(names, 0x18), u64_at(names, 0x20));
    let Some(names) = read(names_off, names_len.min(1 << 20)) else {
        return Ok(None);
    };
    for i in 0..shnum {
        let s = sh(i);
        let at = u32_at(s, 0) as usize;
        let this = names
            .get(at..)
            .and_then(|n| n.split(|&c| c == 0).next())
            .unwrap_or_default();
        if this == name.as_bytes() {
            let (off, size) = (u64_at(s, 0x18), u64_at(s, 0x20));
            if size > MAX_BTF_BYTES {
                return Err(format!("{name} of {} has {size} bytes", file.what()));
            }
            return Ok(read(off, size));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn kernel_dir(release: &str) -> Option<PathBuf> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../images/out")
            .join(format!("linux-{release}"));
        if dir.join("vmlinux").is_file() && dir.join("System.map").is_file() {
            Some(dir)
        } else {
            eprintln!(
                "SKIPPED: {} has no vmlinux and System.map (run `kpin images`)",
                dir.display()
            );
            None
        }
    }

    fn map_address(dir: &Path, symbol: &str) -> u64 {
        let map = std::fs::read_to_string(dir.join("System.map")).unwrap();
        map.lines()
            .find_map(|l| {
                let mut f = l.split_whitespace();
                let (a, _, n) = (f.next()?, f.next()?, f.next()?);
                (n == symbol).then(|| u64::from_str_radix(a, 16).unwrap())
            })
            .unwrap_or_else(|| panic!("{symbol} not in System.map"))
    }

    #[test]
    fn test_linux_61_current_task_is_a_percpu_variable() {
        let Some(dir) = kernel_dir("6.1.0-56-cloud-amd64") else {
            return;
        };
        let (t, how) = from_kernel(&dir.join("vmlinux")).unwrap();
        eprintln!("{how}: {t:x?}");
        assert!(how.contains("(current_task)"), "{how}");
        assert_eq!(t.current_task, map_address(&dir, "current_task"));
        assert_eq!(t.comm_bytes, 16);
        assert_eq!(t.task_tgid, t.task_pid + 4, "{t:?}");
        assert!(t.task_comm > t.task_tgid, "{t:?}");
        assert_exe_offsets(&t);
        assert_vma_offsets(&t);
        // The LZ4 bzImage's payload has the same BTF.
        let (z, how) = from_kernel(&dir.join("vmlinuz")).unwrap();
        assert!(how.contains("vmlinuz's payload (current_task)"), "{how}");
        assert_eq!(z, t);
    }

    /// The executable's offsets are there and plausible.
    fn assert_exe_offsets(t: &KernelTypes) {
        assert!(t.knows_exe(), "{t:x?}");
        // `struct path` is { mnt, dentry }; `struct qstr` is { hash, len, name }.
        assert_eq!(t.dentry_name, t.dentry_name_len + 4, "{t:x?}");
        assert!(
            t.task_mm > t.task_pid.min(0x400) && t.task_mm < 0x4000,
            "{t:x?}"
        );
    }

    /// The VMAs' offsets are there and match the maple tree's 64-bit layout
    /// (`include/linux/maple_tree.h`: 15 pivots and 16 slots, the metadata over the last
    /// slot; 9 pivots, 10 slots, 10 gaps, then the metadata).
    fn assert_vma_offsets(t: &KernelTypes) {
        assert!(t.knows_vmas(), "{t:x?}");
        let m = t.maple;
        assert_eq!(
            (m.range_pivot, m.range_slot, m.range_meta, m.range_pivots),
            (8, 0x80, 0xf8, 15),
            "{m:x?}"
        );
        assert_eq!(
            (
                m.arange_pivot,
                m.arange_slot,
                m.arange_meta,
                m.arange_pivots
            ),
            (8, 0x50, 0xf0, 9),
            "{m:x?}"
        );
        assert_eq!(t.vma_end, t.vma_start + 8, "{t:x?}");
        assert!(t.mm_vdso != 0, "{t:x?}");
    }

    #[test]
    fn test_a_btf_without_the_maple_tree_keeps_tasks_and_executables() {
        let Some(dir) = kernel_dir("6.1.0-56-cloud-amd64") else {
            return;
        };
        let btf = elf_section(&FileBytes::open(&dir.join("vmlinux")).unwrap(), ".BTF")
            .unwrap()
            .unwrap();
        let (full, _) = from_btf(&btf).unwrap();
        // The same BTF with the struct renamed in its string table: the engine names tasks
        // and executables as before and records no code origins, and the note says why.
        let mut renamed = btf.clone();
        let name = b"\0maple_range_64\0";
        let at = renamed.windows(name.len()).position(|w| w == name).unwrap();
        renamed[at + 1] = b'n';
        let (t, how) = from_btf(&renamed).unwrap();
        assert!(
            how.contains("no code origins: the BTF has no struct maple_range_64"),
            "{how}"
        );
        assert!(t.knows_exe() && !t.knows_vmas(), "{t:x?}");
        assert_eq!(t.task_mm, full.task_mm);
    }

    #[test]
    fn test_linux_612_current_task_is_in_pcpu_hot() {
        let Some(dir) = kernel_dir("6.12.117+deb12-cloud-amd64") else {
            return;
        };
        let (t, how) = from_kernel(&dir.join("vmlinux")).unwrap();
        eprintln!("{how}: {t:x?}");
        assert!(how.contains("pcpu_hot.current_task"), "{how}");
        // The distribution's PC configuration (no System.map) has the same layout of
        // `current`.
        let generic = dir
            .with_file_name("linux-6.12.117+deb12-amd64")
            .join("vmlinux");
        if generic.is_file() {
            let (g, _) = from_kernel(&generic).unwrap();
            assert_eq!(g.comm_bytes, 16);
            assert!(g.current_task != 0, "{g:x?}");
        }
        // `current_task` is pcpu_hot's first member.
        assert_eq!(t.current_task, map_address(&dir, "pcpu_hot"));
        assert_eq!(t.comm_bytes, 16);
        assert_eq!(t.task_tgid, t.task_pid + 4, "{t:?}");
        assert_exe_offsets(&t);
        assert_vma_offsets(&t);
        // The zstd bzImage's payload (decompressed by the host's zstd) has the same BTF.
        let (z, how) = from_kernel(&dir.join("vmlinuz")).unwrap();
        assert!(how.contains("vmlinuz's payload (pcpu_hot"), "{how}");
        assert_eq!(z, t);
    }

    #[test]
    fn test_the_cache_gives_what_the_btf_gave_for_that_file_only() {
        let Some(kernels) = kernel_dir("6.1.0-56-cloud-amd64") else {
            return;
        };
        let dir = std::env::temp_dir().join(format!("kpin-kt-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // A copy, so that its modification time can change under the test.
        let kernel = dir.join("vmlinux");
        std::fs::copy(kernels.join("vmlinux"), &kernel).unwrap();
        let cache = dir.join("cache");
        let read = from_kernel(&kernel).unwrap();
        assert_eq!(from_kernel_cached(&kernel, &cache).unwrap(), read);
        let entries: Vec<_> = std::fs::read_dir(&cache).unwrap().collect();
        assert_eq!(entries.len(), 1, "one entry, no temporary file left");
        let entry = entries[0].as_ref().unwrap().path();
        // The entry answers from now on: a forged one (its values changed) is believed...
        let text = std::fs::read_to_string(&entry).unwrap();
        let line = types_fields(&read.0).map(|v| v.to_string()).join(" ");
        let mut forged = read.0;
        forged.task_pid += 8;
        let forged_line = types_fields(&forged).map(|v| v.to_string()).join(" ");
        std::fs::write(&entry, text.replace(&line, &forged_line)).unwrap();
        assert_eq!(from_kernel_cached(&kernel, &cache).unwrap().0, forged);
        // ...but not for the file once it changed (its modification time): read again.
        let f = std::fs::File::options().write(true).open(&kernel).unwrap();
        f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
            .unwrap();
        drop(f);
        assert_eq!(from_kernel_cached(&kernel, &cache).unwrap(), read);
        // A cache directory that cannot be made only costs the BTF read.
        let blocked = dir.join("blocked");
        std::fs::write(&blocked, b"a file, not a directory").unwrap();
        assert_eq!(
            from_kernel_cached(&kernel, &blocked.join("cache")).unwrap(),
            read
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn test_cached_types_round_trip_and_refuse_what_does_not_fit() {
        let mut fields = [0u64; 25];
        for (k, f) in fields.iter_mut().enumerate() {
            *f = 1000 + k as u64;
        }
        fields[0] = 0x1_0000_0000_1234;
        let t = types_from_fields(&fields).unwrap();
        assert_eq!(types_fields(&t), fields);
        assert_eq!(t.current_task, 0x1_0000_0000_1234);
        assert_eq!(t.maple.arange_pivots, 1024);
        assert_eq!(types_from_fields(&fields[..24]), None);
        let mut wide = fields;
        wide[1] = u64::from(u32::MAX) + 1;
        assert_eq!(types_from_fields(&wide), None);
        wide = fields;
        wide[17] = 0x1_0000;
        assert_eq!(types_from_fields(&wide), None);
        let key = "k";
        let line = fields.map(|v| v.to_string()).join(" ");
        let text = format!("{CACHE_FORMAT}\n{key}\n{line}\nnote\n");
        assert_eq!(parse_cached(&text, key), Some((t, "note".into())));
        assert_eq!(parse_cached(&text, "other key"), None);
        assert_eq!(
            parse_cached(&text.replace(CACHE_FORMAT, "kpin-kernel-types 0"), key),
            None
        );
        assert_eq!(parse_cached(&text.replace(" 1001 ", " x "), key), None);
    }

    #[test]
    fn test_files_without_btf_say_why() {
        let dir = std::env::temp_dir().join(format!("kpin-kt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let not_elf = dir.join("bzImage");
        std::fs::write(
            &not_elf,
            b"MZ not an ELF file at all, but long enough for a header; .....",
        )
        .unwrap();
        let e = from_kernel(&not_elf).unwrap_err();
        assert!(e.contains("no .BTF section"), "{e}");
        // A bzImage header with a payload that is not a kernel: said, not a guess.
        let mut bz = vec![0u8; 0x1000];
        bz[0x202..0x206].copy_from_slice(b"HdrS");
        let bz_path = dir.join("vmlinuz");
        std::fs::write(&bz_path, &bz).unwrap();
        let e = from_kernel(&bz_path).unwrap_err();
        assert!(e.contains("the vmlinux in the bzImage"), "{e}");
        // An ELF in memory without sections.
        assert_eq!(elf_section(&&b"\x7fELF\x02\x01"[..], ".BTF"), Ok(None));
        assert!(from_kernel(&dir.join("missing")).is_err());
        assert!(from_btf(b"\x9f\xeb\x01\x00").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
