//! The image's side of the task watch (`guest_engine::tasks`, `docs/processes.md`): the
//! virtual CPU gets a watch over the engine's instruction counters and the kernel's types
//! from the attach block at the start of the run, and every report writes the rows it
//! charged as `processes.json`.

use guest_engine::tasks::TaskWatch;
use guest_engine::Engine;
use kpin_abi::attach::AttachBlock;
use kpin_abi::output::ENGINE_PROCESSES;

use crate::log;
use crate::run::tools;
use crate::run::vcpu::Vcpu;

/// Gives `vcpu` a task watch (none if the engine does not count instructions).
pub fn watch(vcpu: &mut Vcpu<'_>, block: &AttachBlock, engine: &Engine) {
    let Some(counts) = engine.insn_counts() else {
        return;
    };
    let w = TaskWatch::new(&block.kernel_types, counts);
    let t = &block.kernel_types;
    if w.by_task() {
        log!(
            Info,
            "engine: processes: `current` at per-CPU offset {:#x}; task_struct pid at {:#x}, tgid at {:#x}, comm at {:#x} ({} bytes)",
            t.current_task,
            t.task_pid,
            t.task_tgid,
            t.task_comm,
            t.comm_bytes
        );
        if w.reads_exe() {
            log!(
                Info,
                "engine: processes: executables through mm at {:#x}, exe_file at {:#x}, f_path.dentry at {:#x}, d_name.len/name at {:#x}/{:#x}, d_parent at {:#x}",
                t.task_mm,
                t.mm_exe_file,
                t.file_dentry,
                t.dentry_name_len,
                t.dentry_name,
                t.dentry_parent
            );
        }
        if w.records_origins() {
            log!(
                Info,
                "engine: processes: user code's files through mm_mt.ma_root at {:#x}, vm_start/vm_end/vm_pgoff/vm_file at {:#x}/{:#x}/{:#x}/{:#x}, context.vdso at {:#x}",
                t.mm_mt_root,
                t.vma_start,
                t.vma_end,
                t.vma_pgoff,
                t.vma_file,
                t.mm_vdso
            );
        }
    } else {
        log!(
            Info,
            "engine: processes: no kernel types in the attach block: reported by address space (CR3)"
        );
    }
    vcpu.tasks = Some(w);
}

/// Writes `processes.json` (if the virtual CPU has a task watch) and logs what it saw.
pub fn report(vcpu: &Vcpu<'_>) {
    let Some(w) = &vcpu.tasks else {
        return;
    };
    let s = &w.stats;
    log!(
        Info,
        "engine: processes: {} rows, {} changes of the running task in {} entries to user mode, {} reads skipped, {} executables unreadable",
        w.report_table().rows().len(),
        s.switches,
        s.user_entries,
        s.reads_failed,
        s.exe_reads_failed
    );
    if let Some(o) = w.origins() {
        log!(
            Info,
            "engine: processes: user code from {} objects on {} pages, {} VMA walks, {} failed, {} pages dropped",
            o.objects().len(),
            o.page_count(),
            s.origin_walks,
            s.origin_walk_failures,
            s.origins_dropped
        );
    }
    let text = w.to_json();
    if let Err(e) = tools::write_file(ENGINE_PROCESSES, text.as_bytes()) {
        log!(Error, "engine: cannot write {ENGINE_PROCESSES}: {e}");
    }
}
