//! virtio-rng (virtio 1.2 §5.4): one queue whose writable buffers the device fills with
//! bytes from the host's `getrandom(2)`, at most [`MAX_BYTES_PER_REQUEST`] per buffer
//! (the used length says how many). Entropy for the guest's `/dev/hwrng`, and so for its
//! random pool early in boot (systemd waits for it).

use std::io::Write;

use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::{Queue, Writer};

use super::{serve_chains, GuestRam, VirtioDevice};

/// The queue's size.
pub const QUEUE_SIZE: u16 = 64;
/// The most bytes one request gets.
pub const MAX_BYTES_PER_REQUEST: usize = 64 << 10;

/// A virtio-rng device.
#[derive(Default)]
pub struct Rng {
    buf: Vec<u8>,
    /// Bytes handed to the guest.
    pub bytes: std::rc::Rc<std::cell::Cell<u64>>,
}

/// Fills `buf` from `getrandom(2)`.
fn fill_random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: `rest` is a valid, writable buffer of `rest.len()` bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += n as usize;
    }
    Ok(())
}

impl Rng {
    fn serve(&mut self, chain: virtio_queue::DescriptorChain<&GuestRam>, mem: &GuestRam) -> u32 {
        let Ok(mut writer) = Writer::<()>::new(mem, chain) else {
            return 0;
        };
        let n = writer.available_bytes().min(MAX_BYTES_PER_REQUEST);
        self.buf.resize(n, 0);
        if fill_random(&mut self.buf).is_err() || writer.write_all(&self.buf).is_err() {
            return 0;
        }
        self.bytes.set(self.bytes.get() + n as u64);
        n as u32
    }
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE]
    }

    fn features(&self) -> u64 {
        0
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn process_queue(&mut self, _index: usize, queue: &mut Queue, mem: &GuestRam) -> bool {
        serve_chains(queue, mem, |chain| self.serve(chain, mem))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::{split::Descriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    #[test]
    fn test_writable_buffers_are_filled_and_readable_ones_get_nothing() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
        let mut rng = Rng::default();
        let q = MockSplitQueue::create(&mem, GuestAddress(0x1000), 16);
        let descs = [
            RawDescriptor::from(Descriptor::new(0x8000, 64, VRING_DESC_F_WRITE as u16, 0)),
            RawDescriptor::from(Descriptor::new(0x9000, 64, 0, 0)),
            RawDescriptor::from(Descriptor::new(0x20_0000, 64, VRING_DESC_F_WRITE as u16, 0)),
        ];
        q.add_desc_chains(&descs, 0).unwrap();
        let mut queue: Queue = q.create_queue().unwrap();
        assert!(rng.process_queue(0, &mut queue, &mem));
        let lens: Vec<u32> = (0..3)
            .map(|i| q.used().ring().ref_at(i).unwrap().load().len())
            .collect();
        assert_eq!(lens, [64, 0, 0]);
        let mut got = [0u8; 64];
        mem.read_slice(&mut got, GuestAddress(0x8000)).unwrap();
        assert!(
            got.iter().any(|&b| b != 0),
            "64 random bytes are not all zero"
        );
        assert_eq!(rng.bytes.get(), 64);
    }
}
