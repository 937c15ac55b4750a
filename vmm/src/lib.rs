//! vmm
