//! `kpin trace`: a `--tool memtrace` run's `memtrace.bin` as CSV in the column order of
//! QEMU's mem plugin, instruction addresses named from the run's kernel if given.

use std::path::Path;

use anyhow::{bail, Context};
use vmm::diag::kernel_symbols::KernelSymbols;

/// `kpin trace`: a memtrace run's records as CSV on stdout.
pub(crate) fn trace(
    run: &Path,
    limit: Option<u64>,
    kernel: Option<&Path>,
    system_map: Option<&Path>,
) -> anyhow::Result<()> {
    let mut symbols = match kernel {
        Some(k) => KernelSymbols::load(k, system_map)?,
        None => None,
    };
    let bin = run.join(kpin_tool_memtrace::BIN_NAME);
    let bytes = std::fs::read(&bin).with_context(|| format!("cannot read {}", bin.display()))?;
    // Where the kernel's instructions ran tells a KASLR slide (a bzImage boot).
    if let (Some(s), Ok(t)) = (
        symbols.as_mut(),
        kpin_tool_memtrace::format::Trace::parse(&bytes),
    ) {
        if let Some(found) = s.find_slide(t.records().map(|r| r.insn_vaddr)) {
            if found.slide != 0 {
                eprintln!("kpin: names from {}", s.source);
            }
        }
    }
    let name = |a: u64| symbols.as_ref().and_then(|s| s.describe(a));
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    match kpin_tool_memtrace::reader::write_csv(&bytes, limit, &name, &mut out) {
        Ok(_) => {}
        // `kpin trace … | head` closes the pipe early: not an error.
        Err(kpin_tool_memtrace::reader::ReadError::Io(e))
            if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        Err(e) => bail!("{}: {e}", run.join(kpin_tool_memtrace::BIN_NAME).display()),
    }
    match std::io::Write::flush(&mut out) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}
