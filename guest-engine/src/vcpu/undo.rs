//! The undo log of a multi-step emulation (exception delivery, `iretq`, far transfers):
//! every guest memory write goes through [`UndoLog::write`], which first saves the bytes
//! it overwrites; if a later step faults, [`UndoLog::rollback`] restores them newest
//! first, so the guest sees its state from before the instruction (DESIGN.md §4, precise
//! exceptions). Register and virtual-CPU changes are made only after the last step that
//! can fault, so they need no log.

use alloc::vec::Vec;

use super::hardware::{GuestFault, GuestMmu};

/// One logged write: where, at which privilege, and the bytes it replaced.
struct Entry {
    va: u64,
    user: bool,
    len: usize,
    old: [u8; 16],
}

/// Guest writes of one emulation, undoable.
#[derive(Default)]
pub struct UndoLog {
    entries: Vec<Entry>,
}

impl UndoLog {
    /// Writes `data` (at most 16 bytes) at `va` (privilege `user`), logging the old bytes.
    pub fn write(
        &mut self,
        mem: &mut impl GuestMmu,
        va: u64,
        user: bool,
        data: &[u8],
    ) -> Result<(), GuestFault> {
        let len = data.len().min(16);
        let mut old = [0u8; 16];
        // The old bytes are read at the same privilege; a write that may go ahead may be
        // read, so a failing read means the write faults too.
        mem.read(va, user, &mut old[..len])
            .and_then(|()| mem.write(va, user, &data[..len]))?;
        self.entries.push(Entry { va, user, len, old });
        Ok(())
    }

    /// Restores every logged write, newest first, and empties the log.
    pub fn rollback(&mut self, mem: &mut impl GuestMmu) {
        while let Some(e) = self.entries.pop() {
            // Cannot fail: the same bytes were written with the same privilege just now.
            let _ = mem.write(e.va, e.user, &e.old[..e.len]);
        }
    }
}
