//! Diagnostics: the guest-state dump written on every unexpected end of a run, the
//! guest page-table walk it uses, kernel symbol tables that name addresses in it and in
//! tool reports, and the kernel's types that say which task runs (`kernel_types.rs`).

pub mod dump;
pub mod guest_files;
pub mod kaslr;
pub mod kernel_symbols;
pub mod kernel_types;
pub mod paging;
pub mod symbols;
pub mod user_names;
