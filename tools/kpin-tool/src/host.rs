//! Files on the host, written from inside the guest.
//!
//! [`Sink`] is the transport: in the engine image, records of the host I/O ring
//! (`kpin_abi::io_ring`: `Open`, `Write`, `Close`), drained by `host-daemon` into the
//! run's output directory; in host tests, memory. [`File`] buffers writes into
//! [`CHUNK_BYTES`] records, so a tool that writes a line at a time costs one ring record
//! per chunk, and a doorbell (a VM exit) only when the ring fills.
//!
//! Names are checked here with the rule the daemon applies
//! (`kpin_abi::io_ring::validate_name`), so a name that could escape the output directory
//! fails at `create`, in the guest, not silently on the host.

use alloc::vec::Vec;
use core::fmt;

use kpin_abi::io_ring::{validate_name, NameError};

/// Bytes buffered before a [`File`] hands a `Write` record to its sink.
pub const CHUNK_BYTES: usize = 2048;

/// Why a host file operation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    /// The name could escape or alias the output directory.
    BadName(NameError),
    /// Every file number is in use.
    TooManyFiles,
    /// The transport refused the record (ring detached, record too large).
    Transport,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::BadName(e) => write!(f, "bad file name ({e:?})"),
            Error::TooManyFiles => f.write_str("too many open host files"),
            Error::Transport => f.write_str("the host I/O ring refused the record"),
        }
    }
}

/// A transport for host files. File numbers are the sink's.
pub trait Sink {
    /// Opens (creates or truncates) `name`, already validated; returns its file number.
    fn open(&mut self, name: &str) -> Result<u16, Error>;
    /// Appends `data` (at most [`CHUNK_BYTES`]) to file `file`.
    fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error>;
    /// Closes file `file`.
    fn close(&mut self, file: u16) -> Result<(), Error>;
}

/// A file in the run's output directory on the host.
pub struct File<'s> {
    sink: &'s mut dyn Sink,
    number: u16,
    buf: Vec<u8>,
    /// The first failure of a `fmt::Write` call, returned by [`File::close`].
    failed: Option<Error>,
}

impl<'s> File<'s> {
    /// Creates `name` (relative, `[A-Za-z0-9._-/]`, no `.`/`..` components).
    pub fn create(sink: &'s mut dyn Sink, name: &str) -> Result<Self, Error> {
        validate_name(name.as_bytes()).map_err(Error::BadName)?;
        let number = sink.open(name)?;
        Ok(Self {
            sink,
            number,
            buf: Vec::with_capacity(CHUNK_BYTES),
            failed: None,
        })
    }

    /// Appends `data`.
    pub fn write_all(&mut self, mut data: &[u8]) -> Result<(), Error> {
        while !data.is_empty() {
            let n = (CHUNK_BYTES - self.buf.len()).min(data.len());
            self.buf.extend_from_slice(&data[..n]);
            data = &data[n..];
            if self.buf.len() == CHUNK_BYTES {
                self.flush_chunk()?;
            }
        }
        Ok(())
    }

    fn flush_chunk(&mut self) -> Result<(), Error> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let r = self.sink.write(self.number, &self.buf);
        self.buf.clear();
        r
    }

    /// Writes what is buffered and closes the file; reports the first error of any
    /// earlier `fmt::Write` call too.
    pub fn close(mut self) -> Result<(), Error> {
        let flushed = self.flush_chunk();
        let closed = self.sink.close(self.number);
        match self.failed {
            Some(e) => Err(e),
            None => flushed.and(closed),
        }
    }
}

impl fmt::Write for File<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.write_all(s.as_bytes()).map_err(|e| {
            self.failed.get_or_insert(e);
            fmt::Error
        })
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::string::String;
    use std::vec::Vec;

    use super::*;
    use core::fmt::Write;

    /// Records every call, as a ring would carry them.
    #[derive(Default)]
    struct Recorder {
        calls: Vec<(char, u16, Vec<u8>)>,
        opened: u16,
    }

    impl Sink for Recorder {
        fn open(&mut self, name: &str) -> Result<u16, Error> {
            self.opened += 1;
            self.calls
                .push(('o', self.opened, name.as_bytes().to_vec()));
            Ok(self.opened)
        }
        fn write(&mut self, file: u16, data: &[u8]) -> Result<(), Error> {
            assert!(data.len() <= CHUNK_BYTES);
            self.calls.push(('w', file, data.to_vec()));
            Ok(())
        }
        fn close(&mut self, file: u16) -> Result<(), Error> {
            self.calls.push(('c', file, Vec::new()));
            Ok(())
        }
    }

    #[test]
    fn small_writes_are_batched_into_chunks() {
        let mut r = Recorder::default();
        let mut f = File::create(&mut r, "out/lines.txt").unwrap();
        let mut expected = String::new();
        for i in 0..1000 {
            writeln!(f, "line {i}").unwrap();
            writeln!(expected, "line {i}").unwrap();
        }
        f.close().unwrap();
        let writes: Vec<&Vec<u8>> = r
            .calls
            .iter()
            .filter(|c| c.0 == 'w')
            .map(|c| &c.2)
            .collect();
        // 1000 lines of ~8 bytes: a handful of records, not a thousand.
        assert_eq!(writes.len(), expected.len().div_ceil(CHUNK_BYTES));
        let joined: Vec<u8> = writes.iter().flat_map(|w| w.iter().copied()).collect();
        assert_eq!(joined, expected.as_bytes());
        assert_eq!(r.calls.first().unwrap().0, 'o');
        assert_eq!(r.calls.last().unwrap().0, 'c');
    }

    #[test]
    fn names_that_could_escape_fail_at_create() {
        let mut r = Recorder::default();
        for bad in ["../x", "/etc/passwd", "a//b", "a/./b", "", "sp ace"] {
            assert!(
                matches!(File::create(&mut r, bad), Err(Error::BadName(_))),
                "{bad:?} accepted"
            );
        }
        assert!(r.calls.is_empty(), "a refused name reached the sink");
    }
}
