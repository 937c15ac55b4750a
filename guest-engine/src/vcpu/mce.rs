//! The machine-check MSRs, virtual: what a KVM guest reads and may write (KVM's
//! `set_msr_mce`/`get_msr_mce`), kept in the virtual CPU because the guest's kernel runs
//! at CPL 3 under the engine and a machine check of the real CPU is the engine's, never
//! the guest's. A kernel with machine-check support (every distribution kernel) clears
//! and enables every bank at boot with unchecked `wrmsr`s; before this file existed each
//! of them was #GP(0) and Linux 6.12 printed `unchecked MSR access error: WRMSR to 0x400`.
//!
//! - IA32_MCG_CAP (read-only) is KVM's value for the vCPU, read by the VMM into the
//!   attach block (`vmm::engine::attach::MODEL_MSRS`); without it there are no
//!   machine-check MSRs (#GP(0)).
//! - IA32_MCG_STATUS: any value.
//! - IA32_MCG_CTL: only when MCG_CAP.MCG_CTL_P; 0 or all ones.
//! - Per bank i below MCG_CAP.Count (at most [`MAX_BANKS`]): MCi_CTL (0x400 + 4i) takes 0
//!   or all ones, except that bits 0 and 10 may be clear (old kernels' errata
//!   workarounds, which KVM accepts); MCi_STATUS takes only 0 from the guest; MCi_ADDR
//!   and MCi_MISC any value; MCi_CTL2 (0x280 + i) only with MCG_CAP.MCG_CMCI_P, its
//!   CMCI_EN bit and threshold.
//!
//! All start at 0, as KVM's do for a vCPU the VMM never set machine checks up for.

pub use kpin_abi::x86::msr::{MC0_CTL, MC0_CTL2, MCG_CAP, MCG_CTL, MCG_STATUS};

/// The most banks KVM gives a vCPU (`KVM_MAX_MCE_BANKS`).
pub const MAX_BANKS: usize = 32;
/// MCG_CAP: the bank count.
const MCG_COUNT: u64 = 0xff;
/// MCG_CAP: IA32_MCG_CTL present.
const MCG_CTL_P: u64 = 1 << 8;
/// MCG_CAP: corrected-machine-check interrupts (MCi_CTL2) present.
const MCG_CMCI_P: u64 = 1 << 10;
/// MCi_CTL2: CMCI_EN and the corrected-error threshold.
const CTL2_WRITABLE: u64 = (1 << 30) | 0x7fff;

/// The machine-check MSRs of one vCPU.
pub struct MachineCheck {
    cap: u64,
    status: u64,
    ctl: u64,
    /// Per bank: CTL, STATUS, ADDR, MISC.
    banks: [[u64; 4]; MAX_BANKS],
    ctl2: [u64; MAX_BANKS],
}

impl MachineCheck {
    /// The MSRs for a vCPU whose MCG_CAP KVM reports as `cap`.
    pub fn new(cap: u64) -> Self {
        Self {
            cap,
            status: 0,
            ctl: 0,
            banks: [[0; 4]; MAX_BANKS],
            ctl2: [0; MAX_BANKS],
        }
    }

    fn bank_count(&self) -> usize {
        ((self.cap & MCG_COUNT) as usize).min(MAX_BANKS)
    }

    /// Bank and register (0 CTL … 3 MISC) of a bank MSR, if `i` is one that exists.
    fn bank_reg(&self, i: u32) -> Option<(usize, usize)> {
        let off = i.checked_sub(MC0_CTL)? as usize;
        (off / 4 < self.bank_count()).then_some((off / 4, off % 4))
    }

    /// The CTL2 slot of `i`, if CMCI is offered and the bank exists.
    fn ctl2_slot(&self, i: u32) -> Option<usize> {
        let bank = i.checked_sub(MC0_CTL2)? as usize;
        (self.cap & MCG_CMCI_P != 0 && bank < self.bank_count()).then_some(bank)
    }

    /// `rdmsr` of `i`: `Some(value)`, or `None` if `i` is not a machine-check MSR this
    /// vCPU has (the caller decides what else it may be).
    pub fn read(&self, i: u32) -> Option<u64> {
        match i {
            MCG_CAP => Some(self.cap),
            MCG_STATUS => Some(self.status),
            MCG_CTL if self.cap & MCG_CTL_P != 0 => Some(self.ctl),
            _ => {
                if let Some((b, r)) = self.bank_reg(i) {
                    Some(self.banks[b][r])
                } else {
                    self.ctl2_slot(i).map(|b| self.ctl2[b])
                }
            }
        }
    }

    /// Whether `i` is a machine-check MSR this vCPU has.
    pub fn has(&self, i: u32) -> bool {
        self.read(i).is_some()
    }

    /// `wrmsr` of `v` to `i` (one of [`MachineCheck::has`]): `false` for #GP(0).
    pub fn write(&mut self, i: u32, v: u64) -> bool {
        match i {
            MCG_CAP => false,
            MCG_STATUS => {
                self.status = v;
                true
            }
            MCG_CTL if self.cap & MCG_CTL_P != 0 && (v == 0 || v == u64::MAX) => {
                self.ctl = v;
                true
            }
            MCG_CTL => false,
            _ => {
                if let Some((b, r)) = self.bank_reg(i) {
                    let ok = match r {
                        0 => v == 0 || v | (1 << 10) | 1 == u64::MAX,
                        1 => v == 0,
                        _ => true,
                    };
                    if ok {
                        self.banks[b][r] = v;
                    }
                    ok
                } else if let Some(b) = self.ctl2_slot(i) {
                    let ok = v & !CTL2_WRITABLE == 0;
                    if ok {
                        self.ctl2[b] = v;
                    }
                    ok
                } else {
                    false
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_banks_exist_up_to_the_count_and_ctl_takes_zero_or_all_ones() {
        let mut m = MachineCheck::new(10);
        assert_eq!(m.read(MCG_CAP), Some(10));
        assert!(m.has(MC0_CTL + 4 * 9 + 3), "bank 9's MISC");
        assert!(!m.has(MC0_CTL + 4 * 10), "no bank 10");
        assert!(m.write(MC0_CTL, u64::MAX));
        assert_eq!(m.read(MC0_CTL), Some(u64::MAX));
        assert!(m.write(MC0_CTL + 4, 0));
        // Bit 10 clear (a K8 GART workaround) and bit 0 clear are accepted, as by KVM.
        assert!(m.write(MC0_CTL + 16, !(1 << 10)));
        assert!(m.write(MC0_CTL + 16, !1));
        assert!(!m.write(MC0_CTL + 16, 0xff));
        assert_eq!(
            m.read(MC0_CTL + 16),
            Some(!1),
            "a refused write changes nothing"
        );
    }

    #[test]
    fn test_status_takes_only_zero_and_addr_misc_anything() {
        let mut m = MachineCheck::new(2);
        assert!(m.write(MC0_CTL + 1, 0));
        assert!(!m.write(MC0_CTL + 1, 1 << 63));
        assert!(m.write(MC0_CTL + 2, 0x1234_5678));
        assert!(m.write(MC0_CTL + 3, u64::MAX));
        assert_eq!(m.read(MC0_CTL + 2), Some(0x1234_5678));
        assert!(m.write(MCG_STATUS, 4));
        assert_eq!(m.read(MCG_STATUS), Some(4));
        assert!(!m.write(MCG_CAP, 3), "MCG_CAP is read-only");
    }

    #[test]
    fn test_mcg_ctl_and_ctl2_exist_only_with_their_cap_bits() {
        let mut plain = MachineCheck::new(4);
        assert!(!plain.has(MCG_CTL));
        assert!(!plain.has(MC0_CTL2));
        assert!(!plain.write(MCG_CTL, 0));
        let mut m = MachineCheck::new(4 | MCG_CTL_P | MCG_CMCI_P);
        assert!(m.write(MCG_CTL, u64::MAX));
        assert!(!m.write(MCG_CTL, 1));
        assert!(m.write(MC0_CTL2 + 3, (1 << 30) | 5));
        assert!(!m.write(MC0_CTL2 + 3, 1 << 31));
        assert!(!m.has(MC0_CTL2 + 4));
        assert_eq!(m.read(MC0_CTL2 + 3), Some((1 << 30) | 5));
    }

    #[test]
    fn test_a_count_above_kvms_limit_is_clamped() {
        let m = MachineCheck::new(0xff);
        assert!(m.has(MC0_CTL + 4 * (MAX_BANKS as u32 - 1)));
        assert!(!m.has(MC0_CTL + 4 * MAX_BANKS as u32));
    }
}
