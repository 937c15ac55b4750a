//! A translation corpus of real x86-64 code: the `.text` of the pinned Linux kernel
//! (`vmlinux`, translated in kernel mode) and of busybox (user mode), with a trace
//! started at every function symbol. Shared by the `translate_cost` example and the
//! `translate_digest` test.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use guest_engine::instrument::CounterId;
use guest_engine::{
    Config, Engine, GuestMemory, GuestPhys, GuestVirt, Mode, NullTool, Tool, TraceInstrumenter,
};

/// The images the corpus comes from, relative to the workspace root.
pub const VMLINUX: &str = "images/out/linux-6.1.0-56-cloud-amd64/vmlinux";
pub const BUSYBOX: &str = "images/out/busybox-source/busybox";

/// Where the code cache is mapped: fixed, so that the emitted bytes (RIP-relative
/// displacements into the context) are the same in every run.
const CACHE_AT: u64 = 0x3f00_0000_0000;
/// Code-cache region: large enough that a whole pass never flushes.
const CACHE_BYTES: usize = 512 << 20;

pub fn workspace_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(rel)
}

/// One image's `.text`: where it is linked, its bytes, its function starts.
pub struct Text {
    pub va: u64,
    pub bytes: Vec<u8>,
    pub functions: Vec<u64>,
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

struct Section {
    name: u32,
    addr: u64,
    offset: usize,
    size: usize,
}

/// Reads `.text` and its function starts (`STT_FUNC` symbols, or for a stripped file the
/// text symbols of the `System.map` beside it) from an ELF64 little-endian file.
pub fn read_text(path: &Path) -> std::io::Result<Text> {
    let f = std::fs::read(path)?;
    assert_eq!(&f[..5], b"\x7fELF\x02", "{}: not ELF64", path.display());
    let shoff = u64_at(&f, 0x28) as usize;
    let shentsize = usize::from(u16_at(&f, 0x3A));
    let shnum = usize::from(u16_at(&f, 0x3C));
    let shstrndx = usize::from(u16_at(&f, 0x3E));
    let sections: Vec<Section> = (0..shnum)
        .map(|k| {
            let h = shoff + k * shentsize;
            Section {
                name: u32_at(&f, h),
                addr: u64_at(&f, h + 0x10),
                offset: u64_at(&f, h + 0x18) as usize,
                size: u64_at(&f, h + 0x20) as usize,
            }
        })
        .collect();
    let names = &sections[shstrndx];
    let name_of = |s: &Section| {
        let at = &f[names.offset + s.name as usize..];
        let end = at.iter().position(|&c| c == 0).expect("NUL");
        &at[..end]
    };
    let text = sections
        .iter()
        .find(|s| name_of(s) == b".text")
        .expect(".text");
    let (lo, hi) = (text.addr, text.addr + text.size as u64);
    let map = path.with_file_name("System.map");
    let mut fentry = None;
    let mut functions: Vec<u64> = match sections.iter().find(|s| name_of(s) == b".symtab") {
        Some(symtab) => f[symtab.offset..symtab.offset + symtab.size]
            .chunks_exact(24)
            .filter(|s| s[4] & 0xF == 2)
            .map(|s| u64_at(s, 8))
            .collect(),
        // A stripped `vmlinux`: its text symbols from `System.map` beside it.
        None => std::fs::read_to_string(map)?
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                let (a, kind, name) = (w.next()?, w.next()?, w.next()?);
                let a = u64::from_str_radix(a, 16).ok()?;
                if name == "__fentry__" {
                    fentry = Some(a);
                }
                matches!(kind, "t" | "T").then_some(a)
            })
            .collect(),
    };
    functions.retain(|a| (lo..hi).contains(a));
    functions.sort_unstable();
    functions.dedup();
    let mut bytes = f[text.offset..text.offset + text.size].to_vec();
    if let Some(fentry) = fentry {
        nop_fentry_calls(&mut bytes, lo, &functions, fentry);
    }
    Ok(Text {
        va: lo,
        bytes,
        functions,
    })
}

/// Turns the `call __fentry__` at a function's start (after its `endbr64`) into the
/// 5-byte nop it is at run time, as Linux's ftrace does at boot.
fn nop_fentry_calls(text: &mut [u8], va: u64, functions: &[u64], fentry: u64) {
    for &f in functions {
        let mut at = (f - va) as usize;
        if text[at..].starts_with(&[0xF3, 0x0F, 0x1E, 0xFA]) {
            at += 4;
        }
        let Some(call) = text.get(at..at + 5) else {
            continue;
        };
        let rel = i32::from_le_bytes(call[1..5].try_into().expect("4 bytes"));
        let target = (va + at as u64 + 5).wrapping_add(rel as u64);
        if call[0] == 0xE8 && target == fentry {
            text[at..at + 5].copy_from_slice(&[0x0F, 0x1F, 0x44, 0x00, 0x00]);
        }
    }
}

/// Guest memory holding the images' text, each on its own run of frames: VA pages of
/// the text map to PA `frames + (page - first page)`, bytes outside `.text` read as 0.
pub struct TextMemory {
    images: Vec<(Text, u64)>,
}

impl TextMemory {
    pub fn new(texts: Vec<Text>) -> Self {
        let images = texts
            .into_iter()
            .enumerate()
            .map(|(k, t)| (t, 0x1_0000_0000 * (k as u64 + 1)))
            .collect();
        Self { images }
    }

    pub fn texts(&self) -> impl Iterator<Item = &Text> {
        self.images.iter().map(|(t, _)| t)
    }
}

impl GuestMemory for TextMemory {
    fn translate(&mut self, va: GuestVirt, _mode: Mode) -> Option<GuestPhys> {
        self.images.iter().find_map(|(t, frames)| {
            let first = t.va & !0xFFF;
            let end = (t.va + t.bytes.len() as u64 + 0xFFF) & !0xFFF;
            (first..end)
                .contains(&va.0)
                .then(|| GuestPhys(frames + (va.0 - first)))
        })
    }

    fn read(&mut self, pa: GuestPhys, out: &mut [u8]) -> bool {
        let Some((t, frames)) = self
            .images
            .iter()
            .find(|(t, f)| pa.0 >= *f && pa.0 - f < t.bytes.len() as u64 + 0x1000)
        else {
            return false;
        };
        // `out` covers text offsets `from..from + len` (negative before `.text`).
        let from = (pa.0 - frames) as i64 - (t.va & 0xFFF) as i64;
        out.fill(0);
        let lo = from.max(0) as usize;
        let hi = ((from + out.len() as i64).max(0) as usize).min(t.bytes.len());
        if lo < hi {
            let at = (lo as i64 - from) as usize;
            out[at..at + hi - lo].copy_from_slice(&t.bytes[lo..hi]);
        }
        true
    }
}

/// Counts every basic block with an inline counter, one counter per distinct block
/// (kpin's `bbcount` tool's instrumentation).
#[derive(Default)]
pub struct BbCount {
    index: BTreeMap<(u64, u64, u8, usize), CounterId>,
}

impl Tool for BbCount {
    fn instrument_trace(&mut self, t: &mut TraceInstrumenter<'_>) {
        let cpl = t.mode().cpl();
        let page = t.physical().0.wrapping_sub(t.address().0);
        for i in 0..t.bbls().len() {
            let b = t.bbls()[i];
            let key = (b.address.0, page.wrapping_add(b.address.0), cpl, b.count);
            let id = match self.index.get(&key) {
                Some(id) => *id,
                None => {
                    let id = t.alloc_counter().expect("counter slots");
                    self.index.insert(key, id);
                    id
                }
            };
            t.insert_bbl_counter(i, id, 1);
        }
    }
}

/// The tools the corpus is translated with.
pub fn tool(name: &str) -> Box<dyn Tool> {
    match name {
        "null" => Box::new(NullTool),
        "bbcount" => Box::new(BbCount::default()),
        _ => panic!("unknown tool {name} (null, bbcount)"),
    }
}

/// An engine configured as the engine image configures it, over a cache at `CACHE_AT`.
pub struct Translator {
    pub engine: Engine,
    cache: *mut u8,
}

impl Translator {
    pub fn new() -> Self {
        // SAFETY: a fresh anonymous mapping at an address nothing else uses (NOREPLACE
        // fails rather than replacing an existing mapping).
        let p = unsafe {
            libc::mmap(
                CACHE_AT as *mut libc::c_void,
                CACHE_BYTES,
                libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE,
                -1,
                0,
            )
        };
        assert_eq!(p as u64, CACHE_AT, "code cache not mapped at {CACHE_AT:#x}");
        let config = Config {
            analysis_preserves_vector_state: true,
            count_insns: true,
            inline_virtual_flags: true,
            ..Config::default()
        };
        // SAFETY: the region is a fresh RWX mapping, page aligned, < 2 GiB, owned by the
        // translator for the engine's lifetime.
        let engine = unsafe { Engine::new(p.cast(), CACHE_BYTES, config) }.expect("engine");
        Self {
            engine,
            cache: p.cast(),
        }
    }

    /// Translates every `stride`-th function of every image (the kernel image in kernel
    /// mode, the others in user mode) into an emptied cache: a trace at its start, then
    /// one after another where the last one's bytes end, up to the next function.
    /// Returns the traces translated.
    pub fn pass(&mut self, mem: &mut TextMemory, tool: &mut dyn Tool, stride: usize) -> u64 {
        self.engine.flush();
        let mut spans: Vec<(u64, u64, Mode)> = Vec::new();
        for t in mem.texts() {
            let mode = if t.va >> 63 == 1 {
                Mode::KERNEL
            } else {
                Mode::USER
            };
            let text_end = t.va + t.bytes.len() as u64;
            for k in (0..t.functions.len()).step_by(stride) {
                let end = t.functions.get(k + 1).copied().unwrap_or(text_end);
                spans.push((t.functions[k], end, mode));
            }
        }
        let before = self.engine.stats().fragments;
        for (start, end, mode) in spans {
            self.engine.set_mode(mode).expect("mode");
            let mut va = start;
            while va < end {
                // Bytes that cannot be fetched (past the text's end) end the span.
                match self.engine.pretranslate(mem, tool, GuestVirt(va)) {
                    Ok(n) => va += n.max(1),
                    Err(_) => break,
                }
            }
        }
        self.engine.stats().fragments - before
    }

    /// Translates the one trace at `va` into an emptied cache (kernel mode for an
    /// upper-half `va`) and returns the code emitted for it, with its cache address.
    // (`tests/translate_digest.rs` shares this file and has no use for it.)
    #[allow(dead_code)]
    pub fn dump(&mut self, mem: &mut TextMemory, tool: &mut dyn Tool, va: u64) -> (u64, Vec<u8>) {
        self.engine.flush();
        let mode = if va >> 63 == 1 {
            Mode::KERNEL
        } else {
            Mode::USER
        };
        self.engine.set_mode(mode).expect("mode");
        self.engine
            .pretranslate(mem, tool, GuestVirt(va))
            .expect("translate");
        let used = self.engine.cache_used_bytes();
        // SAFETY: as in `code_digest`.
        let code = unsafe {
            std::slice::from_raw_parts(self.cache.add(guest_engine::layout::TRACES_OFFSET), used)
        };
        let at = self.cache as u64 + guest_engine::layout::TRACES_OFFSET as u64;
        (at, code.to_vec())
    }

    /// FNV-1a of the code the last pass emitted (every trace, in order).
    pub fn code_digest(&self) -> u64 {
        let used = self.engine.cache_used_bytes();
        // SAFETY: the traces area lies inside the mapping; the cache is not running.
        let code = unsafe {
            std::slice::from_raw_parts(self.cache.add(guest_engine::layout::TRACES_OFFSET), used)
        };
        code.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }
}

impl Drop for Translator {
    fn drop(&mut self) {
        // SAFETY: our own mapping; the engine that used it is dropped with us and never
        // runs code after this.
        unsafe { libc::munmap(self.cache.cast(), CACHE_BYTES) };
    }
}
