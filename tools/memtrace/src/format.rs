//! `memtrace.bin`: a 16-byte header, then one [`RECORD_BYTES`]-byte record per memory
//! access, all little-endian, nothing after the last record.
//!
//! Header: `magic` [`MAGIC`] (8 bytes), `version` u32 ([`VERSION`]), `record_bytes` u32
//! ([`RECORD_BYTES`]).
//!
//! Record: `insn_vaddr` u64, `mem_vaddr` u64, `mem_paddr` u64 (`u64::MAX`: the address did
//! not translate), `size` u16 (bytes, saturated), `flags` u8 ([`FLAG_READ`],
//! [`FLAG_WRITE`], the CPL in bits [`FLAG_CPL_SHIFT`]..+2), one reserved zero byte.
//!
//! The file comes from inside the guest: [`Trace::parse`] checks the header and the
//! length and never panics.

use core::fmt;

/// The file's first 8 bytes.
pub const MAGIC: [u8; 8] = *b"KPINMTR\0";
/// The format version.
pub const VERSION: u32 = 1;
/// Header bytes.
pub const HEADER_BYTES: usize = 16;
/// Bytes per record.
pub const RECORD_BYTES: usize = 28;
/// The access reads memory.
pub const FLAG_READ: u8 = 1;
/// The access writes memory.
pub const FLAG_WRITE: u8 = 2;
/// Shift of the 2-bit CPL in `flags`.
pub const FLAG_CPL_SHIFT: u8 = 4;

/// The header's bytes.
pub fn header() -> [u8; HEADER_BYTES] {
    let mut h = [0; HEADER_BYTES];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(RECORD_BYTES as u32).to_le_bytes());
    h
}

/// One access.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// The instruction's virtual address.
    pub insn_vaddr: u64,
    /// The data's virtual address.
    pub mem_vaddr: u64,
    /// The data's physical address (`u64::MAX`: unresolved).
    pub mem_paddr: u64,
    /// Bytes accessed.
    pub size: u16,
    /// [`FLAG_READ`], [`FLAG_WRITE`] and the CPL.
    pub flags: u8,
}

impl Record {
    /// The CPL the access was made at.
    pub fn cpl(&self) -> u8 {
        self.flags >> FLAG_CPL_SHIFT & 3
    }

    /// Whether the access reads.
    pub fn is_read(&self) -> bool {
        self.flags & FLAG_READ != 0
    }

    /// Whether the access writes.
    pub fn is_write(&self) -> bool {
        self.flags & FLAG_WRITE != 0
    }

    /// The record's bytes.
    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0; RECORD_BYTES];
        b[0..8].copy_from_slice(&self.insn_vaddr.to_le_bytes());
        b[8..16].copy_from_slice(&self.mem_vaddr.to_le_bytes());
        b[16..24].copy_from_slice(&self.mem_paddr.to_le_bytes());
        b[24..26].copy_from_slice(&self.size.to_le_bytes());
        b[26] = self.flags;
        b
    }

    /// The record in `b`.
    pub fn decode(b: &[u8; RECORD_BYTES]) -> Self {
        let u64_at = |o: usize| {
            let mut x = [0; 8];
            x.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(x)
        };
        Record {
            insn_vaddr: u64_at(0),
            mem_vaddr: u64_at(8),
            mem_paddr: u64_at(16),
            size: u16::from_le_bytes([b[24], b[25]]),
            flags: b[26],
        }
    }
}

/// Why a file is not a memtrace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatError {
    /// Shorter than the header.
    NoHeader,
    /// The first 8 bytes are not [`MAGIC`].
    BadMagic,
    /// Another version or record size.
    BadVersion {
        /// The version found.
        version: u32,
        /// The record size found.
        record_bytes: u32,
    },
    /// The records do not end on a record boundary (the file was cut).
    Truncated {
        /// Bytes after the last whole record.
        extra: usize,
    },
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FormatError::NoHeader => f.write_str("shorter than the memtrace header"),
            FormatError::BadMagic => f.write_str("not a memtrace file (bad magic)"),
            FormatError::BadVersion {
                version,
                record_bytes,
            } => write!(
                f,
                "memtrace version {version} with {record_bytes}-byte records (this reader knows version {VERSION}, {RECORD_BYTES} bytes)"
            ),
            FormatError::Truncated { extra } => {
                write!(f, "truncated: {extra} bytes after the last whole record")
            }
        }
    }
}

/// A checked `memtrace.bin`.
#[derive(Clone, Copy, Debug)]
pub struct Trace<'a> {
    body: &'a [u8],
}

impl<'a> Trace<'a> {
    /// Checks the header and that the rest is whole records.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, FormatError> {
        if bytes.len() < HEADER_BYTES {
            return Err(if bytes.len() >= 8 && bytes[..8] != MAGIC {
                FormatError::BadMagic
            } else {
                FormatError::NoHeader
            });
        }
        if bytes[..8] != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        let record_bytes = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
        if version != VERSION || record_bytes as usize != RECORD_BYTES {
            return Err(FormatError::BadVersion {
                version,
                record_bytes,
            });
        }
        let body = &bytes[HEADER_BYTES..];
        let extra = body.len() % RECORD_BYTES;
        if extra != 0 {
            return Err(FormatError::Truncated { extra });
        }
        Ok(Trace { body })
    }

    /// Records in the file.
    pub fn len(&self) -> usize {
        self.body.len() / RECORD_BYTES
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.body.is_empty()
    }

    /// The records, in the order the guest made the accesses.
    pub fn records(&self) -> impl Iterator<Item = Record> + 'a {
        self.body.chunks_exact(RECORD_BYTES).map(|c| {
            let mut b = [0; RECORD_BYTES];
            b.copy_from_slice(c);
            Record::decode(&b)
        })
    }
}
