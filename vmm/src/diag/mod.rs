//! Diagnostics: the guest-state dump written on every unexpected end of a run, the
//! guest page-table walk it uses, and kernel symbol tables that name addresses in it and
//! in tool reports.

pub mod dump;
pub mod kaslr;
pub mod kernel_symbols;
pub mod paging;
pub mod symbols;
