//! Names for user-mode code (`kpin_tool::host_side::UserNames`, issue #27): the engine's
//! `processes.json` says which file page each user code frame held when the engine
//! translated it (`objects`: guest paths; `code_pages`: `[pfn, object, file offset of the
//! page]`, a later entry for a frame replacing an earlier one); the file is found on the
//! host in the run's disks or initramfs (`guest_files.rs`) and its ELF symbols name the
//! function: the offset goes to a virtual address through the program headers (PT_LOAD),
//! then to the covering function symbol (`.symtab`, else `.dynsym`), demangled.
//!
//! Files are read at the first address that needs them, once each; a file that is missing
//! or not ELF, or has no function symbols, still names its object, and is said in one line.

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kpin_tool::host_side::{UserCode, UserNames};
use object::{Object, ObjectSegment, ObjectSymbol, SymbolKind};
use serde::Deserialize;

use super::guest_files::{Found, GuestFiles};

/// Largest `processes.json` read for its code pages (~25 bytes per page: 64 MiB is over
/// two million pages).
pub const MAX_ORIGINS_BYTES: u64 = 64 << 20;
/// Longest symbol name kept (a mangled C++ name can be kilobytes).
const MAX_NAME_CHARS: usize = 512;
/// Function symbols kept per file.
const MAX_SYMBOLS: usize = 4 << 20;

/// `processes.json`'s code origins.
#[derive(Debug, Default, Deserialize)]
struct OriginsFile {
    #[serde(default)]
    objects: Vec<String>,
    #[serde(default)]
    code_pages: Vec<(u64, u64, u64)>,
}

/// Where each user code frame came from: the objects, and frame → (object, page offset).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CodeOrigins {
    objects: Vec<String>,
    pages: HashMap<u64, (usize, u64)>,
}

impl CodeOrigins {
    /// From `processes.json`'s text; `None` if it records no code page. Entries naming
    /// an object that is not in the list are left out.
    pub fn parse(text: &str) -> Result<Option<Self>, String> {
        let f: OriginsFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let mut pages = HashMap::new();
        for (pfn, object, offset) in f.code_pages {
            if let Ok(i) = usize::try_from(object) {
                if i < f.objects.len() && offset & 0xfff == 0 {
                    pages.insert(pfn, (i, offset));
                }
            }
        }
        Ok((!pages.is_empty()).then_some(CodeOrigins {
            objects: f.objects,
            pages,
        }))
    }

    /// The object index and file offset of the code at physical address `pa`.
    fn origin(&self, pa: u64) -> Option<(usize, u64)> {
        let &(object, page) = self.pages.get(&(pa >> 12))?;
        Some((object, page.saturating_add(pa & 0xfff)))
    }
}

/// An ELF file's function symbols by virtual address, and its loadable segments.
#[derive(Debug, Default)]
pub struct ElfSymbols {
    /// PT_LOAD: (file offset, size in the file, virtual address).
    loads: Vec<(u64, u64, u64)>,
    /// (address, size, raw name), sorted by address.
    functions: Vec<(u64, u64, String)>,
    /// `.symtab` or `.dynsym`.
    pub table: &'static str,
}

impl ElfSymbols {
    /// The symbols of the ELF file `bytes`; an error if it is not ELF.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let file = object::File::parse(bytes).map_err(|e| e.to_string())?;
        if file.format() != object::BinaryFormat::Elf {
            return Err("not ELF".into());
        }
        let loads = file
            .segments()
            .map(|s| {
                let (offset, size) = s.file_range();
                (offset, size, s.address())
            })
            .collect();
        let functions = |syms: &mut dyn Iterator<Item = object::Symbol<'_, '_>>| {
            let mut v: Vec<(u64, u64, String)> = syms
                .filter(|s| s.kind() == SymbolKind::Text && s.size() > 0 && s.is_definition())
                .filter_map(|s| {
                    let name = s.name().ok()?;
                    (!name.is_empty()).then(|| {
                        (
                            s.address(),
                            s.size(),
                            name.chars().take(MAX_NAME_CHARS).collect(),
                        )
                    })
                })
                .take(MAX_SYMBOLS)
                .collect();
            // Aliases at one address: the global (first seen in the table order) kept.
            v.sort_by_key(|&(a, _, _)| a);
            v.dedup_by_key(|&mut (a, _, _)| a);
            v
        };
        let mut table = ".symtab";
        let mut found = functions(&mut file.symbols());
        if found.is_empty() {
            table = ".dynsym";
            found = functions(&mut file.dynamic_symbols());
        }
        Ok(ElfSymbols {
            loads,
            functions: found,
            table,
        })
    }

    /// Whether it names any function.
    pub fn is_empty(&self) -> bool {
        self.functions.is_empty()
    }

    /// `function+0xoff` (demangled) for file offset `offset`.
    pub fn at_offset(&self, offset: u64) -> Option<String> {
        let &(file, _, vaddr) = self
            .loads
            .iter()
            .find(|&&(file, size, _)| offset >= file && offset - file < size)?;
        let va = vaddr.checked_add(offset - file)?;
        let i = self
            .functions
            .partition_point(|&(a, _, _)| a <= va)
            .checked_sub(1)?;
        let (start, size, name) = &self.functions[i];
        (va - start < *size).then(|| format!("{}+{:#x}", demangle(name), va - start))
    }
}

/// `name` demangled as Rust (without the hash) or C++, or as it is.
pub fn demangle(name: &str) -> String {
    if let Ok(d) = rustc_demangle::try_demangle(name) {
        return format!("{d:#}");
    }
    if name.starts_with("_Z") {
        if let Ok(d) = cpp_demangle::Symbol::new(name)
            .map_err(|_| ())
            .and_then(|s| s.demangle(&Default::default()).map_err(|_| ()))
        {
            return d.chars().take(MAX_NAME_CHARS).collect();
        }
    }
    name.to_string()
}

/// Where a line about the names goes (`kpin`'s progress).
pub type Say = Box<dyn FnMut(&str)>;

/// An object's symbols as loaded: `None` until asked for.
type Loaded = Option<Option<ElfSymbols>>;

/// [`UserNames`] for a run: its code origins and its guest's files.
pub struct UserSymbolizer {
    origins: CodeOrigins,
    files: RefCell<GuestFiles>,
    objects: RefCell<Vec<Loaded>>,
    source: String,
    say: RefCell<Say>,
}

impl UserSymbolizer {
    /// For the run in `out` (its `processes.json`), its guest's disks and initramfs;
    /// `Ok(None)` if the engine recorded no code origins. `say` gets one line per object
    /// that cannot be named by function.
    pub fn load(
        out: &Path,
        disks: Vec<PathBuf>,
        initrd: Option<PathBuf>,
        say: Say,
    ) -> anyhow::Result<Option<Self>> {
        let path = out.join(kpin_abi::output::ENGINE_PROCESSES);
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        let text = host_daemon::resolve::read_output_text(&path, MAX_ORIGINS_BYTES)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        let origins =
            CodeOrigins::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(origins.map(|origins| Self::new(origins, GuestFiles::new(disks, initrd), say)))
    }

    /// From code origins and the files they name.
    pub fn new(origins: CodeOrigins, files: GuestFiles, say: Say) -> Self {
        let source = format!(
            "{} code pages of {} objects (processes.json), ELF symbols of {}",
            origins.pages.len(),
            origins.objects.len(),
            files.describe()
        );
        UserSymbolizer {
            objects: RefCell::new((0..origins.objects.len()).map(|_| None).collect()),
            origins,
            files: RefCell::new(files),
            source,
            say: RefCell::new(say),
        }
    }

    /// Reads object `i`'s file once; says why it names no function if it does not.
    fn symbols(&self, i: usize) -> Option<ElfSymbols> {
        let name = &self.origins.objects[i];
        // `[anon]`, `[vdso]`: no file to read.
        if name.starts_with('[') {
            return None;
        }
        let why = match self.files.borrow_mut().read(name) {
            Found::Bytes(bytes, from) => match ElfSymbols::parse(&bytes) {
                Ok(s) if !s.is_empty() => return Some(s),
                Ok(_) => format!(
                    "no function symbols in {name} (stripped) from {}",
                    from.display()
                ),
                Err(e) => format!("{name} from {} is not ELF: {e}", from.display()),
            },
            Found::Missing(why) => format!("{name}: {why}"),
        };
        (self.say.borrow_mut())(&format!("user code: functions unnamed: {why}"));
        None
    }
}

impl UserNames for UserSymbolizer {
    fn source(&self) -> String {
        self.source.clone()
    }

    fn name(&self, pa: u64) -> Option<UserCode> {
        let (i, offset) = self.origins.origin(pa)?;
        let mut objects = self.objects.borrow_mut();
        let loaded = objects[i].get_or_insert_with(|| self.symbols(i));
        Some(UserCode {
            object: self.origins.objects[i].clone(),
            offset,
            function: loaded.as_ref().and_then(|s| s.at_offset(offset)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn test_code_pages_map_frames_to_objects_a_later_entry_winning() {
        let o = CodeOrigins::parse(
            r#"{"by":"task","objects":["/bin/busybox","[anon]"],
                "code_pages":[[16,0,4096],[17,1,0],[16,0,8192],[18,7,0],[19,0,5]]}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            o.origin(0x10_123),
            Some((0, 0x2123)),
            "the later entry for frame 16"
        );
        assert_eq!(o.origin(0x11_000), Some((1, 0)));
        assert_eq!(o.origin(0x12_000), None, "object 7 does not exist");
        assert_eq!(o.origin(0x13_000), None, "an offset that is not a page's");
        assert_eq!(o.origin(0x14_000), None);
        assert_eq!(
            CodeOrigins::parse(r#"{"by":"task"}"#).unwrap(),
            None,
            "no code pages"
        );
        assert!(CodeOrigins::parse(r#"{"code_pages":[[1,2]]}"#).is_err());
    }

    #[test]
    fn test_demangling_rust_and_cpp_and_plain_c() {
        assert_eq!(
            demangle("_ZN4core3fmt9Formatter3pad17h0123456789abcdefE"),
            "core::fmt::Formatter::pad"
        );
        assert_eq!(demangle("_RNvCs1234_7mycrate4main"), "mycrate::main");
        assert_eq!(demangle("_ZN3foo3barEi"), "foo::bar(int)");
        assert_eq!(
            demangle("_ZNSt6vectorIiSaIiEE9push_backERKi"),
            "std::vector<int, std::allocator<int> >::push_back(int const&)"
        );
        assert_eq!(demangle("main"), "main");
        assert_eq!(demangle("_Z"), "_Z", "not a whole name: as it is");
    }

    /// A real ELF: a tiny C program compiled here, each function found at its own file
    /// offset (its address through the program headers, as `nm` says it).
    #[test]
    fn test_file_offsets_name_functions_of_a_real_elf() {
        let dir = std::env::temp_dir().join(format!("kpin-user-names-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("p.c");
        std::fs::write(
            &src,
            "int kpin_twice(int x) { return 2 * x; }\n\
             int kpin_thrice(int x) { return 3 * x; }\n\
             int main(int c, char **v) { (void)v; return kpin_twice(c) + kpin_thrice(c); }\n",
        )
        .unwrap();
        let exe = dir.join("p");
        let built = Command::new("cc")
            .args(["-O1", "-o"])
            .arg(&exe)
            .arg(&src)
            .output();
        if !built.is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: no C compiler on this host");
            return;
        }
        let bytes = std::fs::read(&exe).unwrap();
        let s = ElfSymbols::parse(&bytes).unwrap();
        assert_eq!(s.table, ".symtab");
        let nm = Command::new("nm").arg(&exe).output().unwrap();
        let nm = String::from_utf8(nm.stdout).unwrap();
        let addr = |name: &str| {
            let line = nm
                .lines()
                .find(|l| l.ends_with(&format!(" {name}")))
                .unwrap();
            u64::from_str_radix(line.split(' ').next().unwrap(), 16).unwrap()
        };
        let offset_of = |va: u64| {
            let &(file, _, vaddr) = s
                .loads
                .iter()
                .find(|&&(_, size, v)| va >= v && va - v < size)
                .unwrap();
            file + (va - vaddr)
        };
        let twice = offset_of(addr("kpin_twice"));
        assert_eq!(s.at_offset(twice).as_deref(), Some("kpin_twice+0x0"));
        assert_eq!(
            s.at_offset(offset_of(addr("kpin_thrice") + 1)).as_deref(),
            Some("kpin_thrice+0x1")
        );
        assert!(s
            .at_offset(offset_of(addr("main")))
            .unwrap()
            .starts_with("main+0x0"));
        assert_eq!(s.at_offset(0), None, "the ELF header is no function");
        assert_eq!(s.at_offset(u64::MAX), None);

        // Stripped: .dynsym of a dynamic executable has no local functions; not ELF.
        let stripped = dir.join("p.stripped");
        let ok = Command::new("strip")
            .arg("-o")
            .arg(&stripped)
            .arg(&exe)
            .status();
        if ok.is_ok_and(|s| s.success()) {
            let s = ElfSymbols::parse(&std::fs::read(&stripped).unwrap()).unwrap();
            assert_eq!(s.at_offset(twice), None);
        }
        assert!(ElfSymbols::parse(b"#!/bin/sh\n").is_err());
        for cut in [0, 16, 64, 200, bytes.len() / 2] {
            let _ = ElfSymbols::parse(&bytes[..cut]);
        }

        // Through code pages and an initramfs holding the file.
        let page = twice & !0xfff;
        let initrd = dir.join("initrd.cpio");
        let archive = crate::diag::guest_files::test_cpio::archive(&[("bin/p", 0o100_755, &bytes)]);
        std::fs::write(&initrd, archive).unwrap();
        let origins = CodeOrigins::parse(&format!(
            r#"{{"objects":["/bin/p","/bin/missing","[anon]"],"code_pages":[[100,0,{page}],[101,1,0],[102,2,0]]}}"#
        ))
        .unwrap()
        .unwrap();
        let said = std::rc::Rc::new(RefCell::new(Vec::<String>::new()));
        let s2 = said.clone();
        let names = UserSymbolizer::new(
            origins,
            GuestFiles::new(vec![], Some(initrd)),
            Box::new(move |l| s2.borrow_mut().push(l.to_string())),
        );
        let pa = (100 << 12) | (twice & 0xfff);
        assert_eq!(
            names.name(pa),
            Some(UserCode {
                object: "/bin/p".into(),
                offset: twice,
                function: Some("kpin_twice+0x0".into())
            })
        );
        for _ in 0..3 {
            let m = names.name(101 << 12).unwrap();
            assert_eq!((m.object.as_str(), m.function), ("/bin/missing", None));
        }
        assert_eq!(names.name(102 << 12).unwrap().object, "[anon]");
        assert_eq!(names.name(103 << 12), None);
        let said = said.borrow();
        assert_eq!(said.len(), 1, "one line for the missing object: {said:?}");
        assert!(said[0].contains("/bin/missing"), "{said:?}");
        assert!(
            names.source().starts_with("3 code pages of 3 objects"),
            "{}",
            names.source()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
