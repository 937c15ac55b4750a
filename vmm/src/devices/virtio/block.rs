//! virtio-blk over a raw image file (virtio 1.2 §5.2): one queue; `IN`, `OUT`, `FLUSH`
//! (`fdatasync` of the image) and `GET_ID`; a read-only disk offers `VIRTIO_BLK_F_RO` and
//! answers every `OUT` with `IOERR`. Offered: `SEG_MAX`, `FLUSH` (so the guest keeps a
//! write cache and flushes it, and a killed kpin leaves the image as a power cut would),
//! `INDIRECT_DESC`.
//!
//! A request is a descriptor chain: a 16-byte header the device reads (type, reserved,
//! sector), the data (read for `OUT`, written for `IN`/`GET_ID`), and a last writable byte
//! for the status. Every request the device cannot make sense of — a header shorter than
//! 16 bytes, data not a multiple of 512 bytes, sectors past the end, a descriptor outside
//! guest RAM — completes with `IOERR` when there is a status byte to write it to, and is
//! only returned to the driver otherwise; data moves in [`CHUNK_BYTES`] pieces through one
//! buffer, so no request size makes the VMM allocate more.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_ID_BYTES,
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_FLUSH,
    VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
use virtio_queue::{Queue, Reader, Writer};

use super::{read_bytes_at, serve_chains, GuestRam, VirtioDevice};

/// Bytes per sector.
pub const SECTOR_BYTES: u64 = 512;
/// The queue's size.
pub const QUEUE_SIZE: u16 = 256;
/// The most data segments per request the driver may use (`seg_max`).
const SEG_MAX: u32 = 128;
/// Bytes moved between the image and guest memory at a time.
pub const CHUNK_BYTES: usize = 256 << 10;
/// Bytes of the request header.
const HEADER_BYTES: usize = 16;

/// What the device counted (in `run.json` under these names).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BlockStats {
    /// `IN` requests served.
    pub reads: u64,
    /// `OUT` requests served.
    pub writes: u64,
    /// `FLUSH` requests served.
    pub flushes: u64,
    /// Bytes read from the image.
    pub bytes_read: u64,
    /// Bytes written to the image.
    pub bytes_written: u64,
    /// Requests answered `IOERR` or `UNSUPP`, or returned without a status.
    pub errors: u64,
}

/// A virtio-blk device over an open image file.
pub struct Block {
    file: File,
    read_only: bool,
    /// Capacity in sectors (the image's length rounded down to a sector).
    sectors: u64,
    /// The `GET_ID` answer, NUL-padded.
    id: [u8; VIRTIO_BLK_ID_BYTES as usize],
    config: [u8; 24],
    buf: Vec<u8>,
    /// Counters.
    pub stats: std::rc::Rc<std::cell::Cell<BlockStats>>,
}

impl Block {
    /// A device over `file` of `len` bytes (`read_only`: `VIRTIO_BLK_F_RO`, writes
    /// refused), answering `GET_ID` with `id` (its first 20 bytes).
    pub fn new(file: File, len: u64, read_only: bool, id: &str) -> Self {
        let sectors = len / SECTOR_BYTES;
        let mut config = [0u8; 24];
        config[0..8].copy_from_slice(&sectors.to_le_bytes());
        config[12..16].copy_from_slice(&SEG_MAX.to_le_bytes());
        let mut id_bytes = [0u8; VIRTIO_BLK_ID_BYTES as usize];
        let n = id.len().min(id_bytes.len());
        id_bytes[..n].copy_from_slice(&id.as_bytes()[..n]);
        Block {
            file,
            read_only,
            sectors,
            id: id_bytes,
            config,
            buf: Vec::new(),
            stats: Default::default(),
        }
    }

    /// Capacity in sectors.
    pub fn sectors(&self) -> u64 {
        self.sectors
    }

    fn count(&self, f: impl FnOnce(&mut BlockStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    /// Serves one chain; returns the bytes written into it (the used length).
    fn serve(&mut self, chain: virtio_queue::DescriptorChain<&GuestRam>, mem: &GuestRam) -> u32 {
        let Ok(mut writer) = Writer::<()>::new(mem, chain.clone()) else {
            self.count(|s| s.errors += 1);
            return 0;
        };
        let Some(data_len) = writer.available_bytes().checked_sub(1) else {
            // No byte to write a status to: nothing can be said to the driver.
            self.count(|s| s.errors += 1);
            return 0;
        };
        let Ok(mut status_writer) = writer.split_at(data_len) else {
            self.count(|s| s.errors += 1);
            return 0;
        };
        let status = match Reader::<()>::new(mem, chain) {
            Ok(mut reader) => self.execute(&mut reader, &mut writer),
            Err(_) => VIRTIO_BLK_S_IOERR,
        };
        if status != VIRTIO_BLK_S_OK {
            self.count(|s| s.errors += 1);
        }
        if status_writer.write_all(&[status as u8]).is_err() {
            return 0;
        }
        (writer.bytes_written() + 1).try_into().unwrap_or(u32::MAX)
    }

    /// Runs the request whose header `reader` starts with; its data goes to `writer` (the
    /// writable part before the status byte). Returns the status.
    fn execute(&mut self, reader: &mut Reader<'_>, writer: &mut Writer<'_>) -> u32 {
        let mut header = [0u8; HEADER_BYTES];
        if reader.read_exact(&mut header).is_err() {
            return VIRTIO_BLK_S_IOERR;
        }
        let kind = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
        let sector = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        match kind {
            VIRTIO_BLK_T_IN => {
                let len = writer.available_bytes();
                let Some(offset) = self.check_range(sector, len) else {
                    return VIRTIO_BLK_S_IOERR;
                };
                match self.read_into(offset, len, writer) {
                    Ok(()) => {
                        self.count(|s| {
                            s.reads += 1;
                            s.bytes_read += len as u64;
                        });
                        VIRTIO_BLK_S_OK
                    }
                    Err(_) => VIRTIO_BLK_S_IOERR,
                }
            }
            VIRTIO_BLK_T_OUT => {
                if self.read_only {
                    return VIRTIO_BLK_S_IOERR;
                }
                let len = reader.available_bytes();
                let Some(offset) = self.check_range(sector, len) else {
                    return VIRTIO_BLK_S_IOERR;
                };
                match self.write_from(offset, len, reader) {
                    Ok(()) => {
                        self.count(|s| {
                            s.writes += 1;
                            s.bytes_written += len as u64;
                        });
                        VIRTIO_BLK_S_OK
                    }
                    Err(_) => VIRTIO_BLK_S_IOERR,
                }
            }
            VIRTIO_BLK_T_FLUSH => {
                self.count(|s| s.flushes += 1);
                if self.read_only || self.file.sync_data().is_ok() {
                    VIRTIO_BLK_S_OK
                } else {
                    VIRTIO_BLK_S_IOERR
                }
            }
            VIRTIO_BLK_T_GET_ID => {
                let n = writer.available_bytes().min(self.id.len());
                match writer.write_all(&self.id[..n]) {
                    Ok(()) => VIRTIO_BLK_S_OK,
                    Err(_) => VIRTIO_BLK_S_IOERR,
                }
            }
            _ => VIRTIO_BLK_S_UNSUPP,
        }
    }

    /// The byte offset of `len` bytes at `sector`, if they are whole sectors inside the
    /// disk.
    fn check_range(&self, sector: u64, len: usize) -> Option<u64> {
        let len = len as u64;
        if !len.is_multiple_of(SECTOR_BYTES) {
            return None;
        }
        let end = sector.checked_add(len / SECTOR_BYTES)?;
        (end <= self.sectors).then(|| sector * SECTOR_BYTES)
    }

    fn chunk_buf(&mut self) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(CHUNK_BYTES, 0);
        buf
    }

    fn read_into(
        &mut self,
        offset: u64,
        len: usize,
        writer: &mut Writer<'_>,
    ) -> std::io::Result<()> {
        let mut buf = self.chunk_buf();
        let mut done = 0;
        let r = loop {
            if done == len {
                break Ok(());
            }
            let n = (len - done).min(buf.len());
            if let Err(e) = self.file.read_exact_at(&mut buf[..n], offset + done as u64) {
                break Err(e);
            }
            if let Err(e) = writer.write_all(&buf[..n]) {
                break Err(e);
            }
            done += n;
        };
        self.buf = buf;
        r
    }

    fn write_from(
        &mut self,
        offset: u64,
        len: usize,
        reader: &mut Reader<'_>,
    ) -> std::io::Result<()> {
        let mut buf = self.chunk_buf();
        let mut done = 0;
        let r = loop {
            if done == len {
                break Ok(());
            }
            let n = (len - done).min(buf.len());
            if let Err(e) = reader.read_exact(&mut buf[..n]) {
                break Err(e);
            }
            if let Err(e) = self.file.write_all_at(&buf[..n], offset + done as u64) {
                break Err(e);
            }
            done += n;
        };
        self.buf = buf;
        r
    }
}

impl VirtioDevice for Block {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_BLOCK
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        let mut f = (1 << VIRTIO_BLK_F_SEG_MAX)
            | (1 << VIRTIO_BLK_F_FLUSH)
            | (1 << VIRTIO_RING_F_INDIRECT_DESC);
        if self.read_only {
            f |= 1 << VIRTIO_BLK_F_RO;
        }
        f
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_bytes_at(&self.config, offset, data);
    }

    fn process_queue(&mut self, _index: usize, queue: &mut Queue, mem: &GuestRam) -> bool {
        serve_chains(queue, mem, |chain| self.serve(chain, mem))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    const HDR: u64 = 0x10000;
    const DATA: u64 = 0x20000;
    const STATUS: u64 = 0x30000;
    /// Guest RAM in the tests: 1 MiB.
    const RAM: u64 = 0x10_0000;

    fn image(sectors: u64) -> (File, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!(
            "kpin-blk-test-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let data: Vec<u8> = (0..sectors * SECTOR_BYTES)
            .map(|i| (i / 512) as u8)
            .collect();
        std::fs::write(&path, &data).unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        (f, path)
    }

    fn d(addr: u64, len: u32, flags: u32) -> RawDescriptor {
        RawDescriptor::from(Descriptor::new(addr, len, flags as u16, 0))
    }

    struct Rig {
        mem: GuestMemoryMmap,
        path: std::path::PathBuf,
        dev: Block,
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    fn rig(read_only: bool) -> Rig {
        let (f, path) = image(8);
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)]).unwrap();
        Rig {
            mem,
            path,
            dev: Block::new(f, 8 * SECTOR_BYTES + 100, read_only, "kpin-test-disk"),
        }
    }

    impl Rig {
        fn header(&self, kind: u32, sector: u64) {
            let mut h = [0u8; 16];
            h[0..4].copy_from_slice(&kind.to_le_bytes());
            h[8..16].copy_from_slice(&sector.to_le_bytes());
            self.mem.write_slice(&h, GuestAddress(HDR)).unwrap();
            self.mem.write_slice(&[0xee], GuestAddress(STATUS)).unwrap();
        }

        /// Runs `descs` as one request (the mock links them with NEXT); returns the used
        /// length and the status byte.
        fn run(&mut self, descs: &[RawDescriptor]) -> (u32, u8) {
            let q = MockSplitQueue::create(&self.mem, GuestAddress(0x1000), 16);
            q.build_desc_chain(descs).unwrap();
            let mut queue: Queue = q.create_queue().unwrap();
            assert!(self.dev.process_queue(0, &mut queue, &self.mem));
            let len = q.used().ring().ref_at(0).unwrap().load().len();
            (len, self.mem.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
        }

        /// Runs `descs` raw (no NEXT rewriting), as a hostile driver lays them out.
        fn run_raw(&mut self, descs: &[RawDescriptor]) -> bool {
            let q = MockSplitQueue::create(&self.mem, GuestAddress(0x1000), 16);
            q.add_desc_chains(descs, 0).unwrap();
            let mut queue: Queue = q.create_queue().unwrap();
            self.dev.process_queue(0, &mut queue, &self.mem)
        }
    }

    #[test]
    fn test_read_write_flush_and_get_id() {
        let mut r = rig(false);
        assert_eq!(
            r.dev.sectors(),
            8,
            "a partial last sector is not part of the disk"
        );
        r.header(VIRTIO_BLK_T_IN, 2);
        let (len, status) = r.run(&[
            d(HDR, 16, 0),
            d(DATA, 1024, VRING_DESC_F_WRITE),
            d(STATUS, 1, VRING_DESC_F_WRITE),
        ]);
        assert_eq!((len, status), (1025, VIRTIO_BLK_S_OK as u8));
        let mut got = [0u8; 1024];
        r.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert!(got[..512].iter().all(|&b| b == 2) && got[512..].iter().all(|&b| b == 3));

        r.mem.write_slice(&[0xab; 512], GuestAddress(DATA)).unwrap();
        r.header(VIRTIO_BLK_T_OUT, 7);
        let (_, status) = r.run(&[
            d(HDR, 16, 0),
            d(DATA, 512, 0),
            d(STATUS, 1, VRING_DESC_F_WRITE),
        ]);
        assert_eq!(status, VIRTIO_BLK_S_OK as u8);
        let on_disk = std::fs::read(&r.path).unwrap();
        assert!(on_disk[7 * 512..8 * 512].iter().all(|&b| b == 0xab));

        r.header(VIRTIO_BLK_T_FLUSH, 0);
        let (_, status) = r.run(&[d(HDR, 16, 0), d(STATUS, 1, VRING_DESC_F_WRITE)]);
        assert_eq!(status, VIRTIO_BLK_S_OK as u8);

        r.header(VIRTIO_BLK_T_GET_ID, 0);
        let (len, status) = r.run(&[
            d(HDR, 16, 0),
            d(DATA, 20, VRING_DESC_F_WRITE),
            d(STATUS, 1, VRING_DESC_F_WRITE),
        ]);
        assert_eq!((len, status), (21, VIRTIO_BLK_S_OK as u8));
        let mut id = [0u8; 20];
        r.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id[..14], b"kpin-test-disk");

        r.header(99, 0);
        let (_, status) = r.run(&[d(HDR, 16, 0), d(STATUS, 1, VRING_DESC_F_WRITE)]);
        assert_eq!(status, VIRTIO_BLK_S_UNSUPP as u8);
        let s = r.dev.stats.get();
        assert_eq!((s.reads, s.writes, s.flushes, s.errors), (1, 1, 1, 1));
        assert_eq!((s.bytes_read, s.bytes_written), (1024, 512));
    }

    #[test]
    fn test_a_read_only_disk_refuses_writes_and_says_so() {
        let mut r = rig(true);
        assert_ne!(r.dev.features() & (1 << VIRTIO_BLK_F_RO), 0);
        r.mem.write_slice(&[0xab; 512], GuestAddress(DATA)).unwrap();
        r.header(VIRTIO_BLK_T_OUT, 0);
        let (_, status) = r.run(&[
            d(HDR, 16, 0),
            d(DATA, 512, 0),
            d(STATUS, 1, VRING_DESC_F_WRITE),
        ]);
        assert_eq!(status, VIRTIO_BLK_S_IOERR as u8);
        assert_eq!(
            std::fs::read(&r.path).unwrap()[0],
            0,
            "the image is unchanged"
        );
    }

    #[test]
    fn test_out_of_range_and_ragged_requests_fail_with_ioerr() {
        let mut r = rig(false);
        for (sector, len) in [
            (7, 1024),
            (8, 512),
            (u64::MAX, 512),
            (u64::MAX / 512 + 1, 512),
            (0, 100),
        ] {
            r.header(VIRTIO_BLK_T_IN, sector);
            let (_, status) = r.run(&[
                d(HDR, 16, 0),
                d(DATA, len, VRING_DESC_F_WRITE),
                d(STATUS, 1, VRING_DESC_F_WRITE),
            ]);
            assert_eq!(
                status, VIRTIO_BLK_S_IOERR as u8,
                "sector {sector} len {len}"
            );
        }
        // A header shorter than 16 bytes.
        r.header(VIRTIO_BLK_T_IN, 0);
        let (_, status) = r.run(&[d(HDR, 8, 0), d(STATUS, 1, VRING_DESC_F_WRITE)]);
        assert_eq!(status, VIRTIO_BLK_S_IOERR as u8);
    }

    #[test]
    fn test_a_write_past_the_end_is_an_ioerr_and_leaves_the_image_as_it_was() {
        let mut r = rig(false);
        let before = std::fs::read(&r.path).unwrap();
        r.mem
            .write_slice(&[0xab; 1024], GuestAddress(DATA))
            .unwrap();
        // Straddling the end (its first sector is inside: not written either), just past
        // it, far past it, and a sector number whose byte offset overflows.
        for (sector, len) in [(7, 1024), (8, 512), (1 << 40, 512), (u64::MAX, 512)] {
            r.header(VIRTIO_BLK_T_OUT, sector);
            let (len_used, status) = r.run(&[
                d(HDR, 16, 0),
                d(DATA, len, 0),
                d(STATUS, 1, VRING_DESC_F_WRITE),
            ]);
            assert_eq!(
                (len_used, status),
                (1, VIRTIO_BLK_S_IOERR as u8),
                "sector {sector} len {len}"
            );
        }
        assert_eq!(
            std::fs::read(&r.path).unwrap(),
            before,
            "no byte written, the file not extended"
        );
        // The device goes on serving: a write inside the disk succeeds.
        r.header(VIRTIO_BLK_T_OUT, 7);
        let (_, status) = r.run(&[
            d(HDR, 16, 0),
            d(DATA, 512, 0),
            d(STATUS, 1, VRING_DESC_F_WRITE),
        ]);
        assert_eq!(status, VIRTIO_BLK_S_OK as u8);
        let s = r.dev.stats.get();
        assert_eq!((s.writes, s.errors, s.bytes_written), (1, 4, 512));
    }

    #[test]
    fn test_hostile_chains_never_panic_and_never_touch_memory_outside_ram() {
        let mut r = rig(false);
        r.header(VIRTIO_BLK_T_IN, 0);
        // Data past the end of guest RAM, and straddling it: IOERR, nothing written.
        for (addr, len) in [(RAM + 0x1000, 512), (RAM - 256, 512), (u64::MAX - 100, 512)] {
            let (_, status) = r.run(&[
                d(HDR, 16, 0),
                d(addr, len, VRING_DESC_F_WRITE),
                d(STATUS, 1, VRING_DESC_F_WRITE),
            ]);
            // The writable part is refused whole: no status byte can be written either.
            assert_eq!(status, 0xee, "{addr:#x}");
        }
        // The header outside RAM: the status byte says IOERR.
        let (_, status) = r.run(&[d(RAM + 0x1000, 16, 0), d(STATUS, 1, VRING_DESC_F_WRITE)]);
        assert_eq!(status, VIRTIO_BLK_S_IOERR as u8);
        // Wrong direction: the header is device-writable, the status descriptor readable:
        // the header cannot be read (IOERR), and the status goes to the last writable
        // byte, the header's.
        let errors = r.dev.stats.get().errors;
        assert!(r.run_raw(&[
            RawDescriptor::from(Descriptor::new(
                HDR,
                16,
                (VRING_DESC_F_WRITE | VRING_DESC_F_NEXT) as u16,
                1
            )),
            d(STATUS, 1, 0),
        ]));
        assert_eq!(
            r.mem.read_obj::<u8>(GuestAddress(HDR + 15)).unwrap(),
            VIRTIO_BLK_S_IOERR as u8
        );
        assert_eq!(r.dev.stats.get().errors, errors + 1);
        // Zero-length descriptors everywhere.
        let (len, _) = r.run(&[d(HDR, 0, 0), d(DATA, 0, VRING_DESC_F_WRITE)]);
        assert_eq!(len, 0);
        // A loop: descriptor 0 → 1 → 0 …; bounded by the queue size.
        let looped = [
            RawDescriptor::from(Descriptor::new(HDR, 16, VRING_DESC_F_NEXT as u16, 1)),
            RawDescriptor::from(Descriptor::new(
                STATUS,
                1,
                (VRING_DESC_F_NEXT | VRING_DESC_F_WRITE) as u16,
                0,
            )),
        ];
        r.run_raw(&looped);
        // A next index past the table.
        let past = [RawDescriptor::from(Descriptor::new(
            HDR,
            16,
            VRING_DESC_F_NEXT as u16,
            500,
        ))];
        r.run_raw(&past);
        // Lengths summing past 4 GiB.
        let huge = [
            RawDescriptor::from(Descriptor::new(HDR, u32::MAX, VRING_DESC_F_NEXT as u16, 1)),
            RawDescriptor::from(Descriptor::new(
                DATA,
                u32::MAX,
                VRING_DESC_F_WRITE as u16,
                0,
            )),
        ];
        r.run_raw(&huge);
        assert!(r.dev.stats.get().errors >= 6);
        assert_eq!(r.dev.stats.get().bytes_read, 0);
    }
}
