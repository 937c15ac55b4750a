//! Recovering the kernel ELF (`vmlinux`) from a bzImage's compressed payload: LZ4 (legacy
//! format, decoded here) or zstd (located and checked here, decoded by the host's `zstd`,
//! see `linux.rs`).
//!
//! Booting the ELF directly lets the VMM skip the bzImage's decompressor, which would run for
//! a very long time under this KVM's ring-0 instruction emulation.
//!
//! The x86 boot protocol (Documentation/arch/x86/boot.rst) places the setup header in the
//! first sector; from protocol 2.08 on it records where the compressed kernel lies:
//! `payload_offset` is relative to the protected-mode code, which starts after the
//! `setup_sects + 1` sectors of real-mode code (`setup_sects == 0` means 4). The kernel build
//! appends the decompressed size as a little-endian `u32` to the payload (`size_append`); when
//! present it is checked. What the payload decompresses to is `vmlinux.bin`: the kernel ELF
//! with symbols stripped, followed on relocatable kernels by the relocation table, which ELF
//! loaders ignore.
//!
//! Invariant: every offset read from the image is bounds-checked; bad input yields a
//! [`BzImageError`], never a panic.

use crate::lz4_legacy::{self, Lz4Error, LEGACY_MAGIC};

/// Offset of `setup_sects` (u8) in the image.
const SETUP_SECTS_OFFSET: usize = 0x1f1;
/// Offset of the `HdrS` header signature (u32).
const HEADER_MAGIC_OFFSET: usize = 0x202;
/// The header signature, `HdrS` read as a little-endian u32.
const HEADER_MAGIC: u32 = 0x5372_6448;
/// Offset of the boot protocol version (u16).
const PROTOCOL_VERSION_OFFSET: usize = 0x206;
/// First boot protocol version with `payload_offset`/`payload_length`.
const PROTOCOL_WITH_PAYLOAD: u16 = 0x0208;
/// Offset of `payload_offset` (u32).
const PAYLOAD_OFFSET_OFFSET: usize = 0x248;
/// Offset of `payload_length` (u32).
const PAYLOAD_LENGTH_OFFSET: usize = 0x24c;
/// Size of a real-mode setup sector.
const SECTOR_BYTES: usize = 512;
/// `setup_sects` value to assume when the field is 0.
const DEFAULT_SETUP_SECTS: usize = 4;
/// Size of the decompressed-length trailer the kernel build appends.
const SIZE_TRAILER_BYTES: usize = 4;
/// The zstd frame magic, as it appears in the file.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// ELF identification: magic, class 64, little-endian.
const ELF64_LE_IDENT: [u8; 6] = [0x7f, b'E', b'L', b'F', 2, 1];
/// Offset of `e_machine` (u16) in an ELF header.
const ELF_MACHINE_OFFSET: usize = 18;
/// `EM_X86_64`.
const EM_X86_64: u16 = 62;

/// Why a vmlinux could not be extracted from a bzImage.
#[derive(Debug, thiserror::Error)]
pub enum BzImageError {
    /// The file is too short to hold a setup header.
    #[error("file is too short for a bzImage setup header ({len} bytes)")]
    TooShort {
        /// File length.
        len: usize,
    },
    /// The `HdrS` signature is missing.
    #[error("no `HdrS` setup-header signature at offset 0x202; not a bzImage")]
    NotBzImage,
    /// The boot protocol predates the payload fields.
    #[error("boot protocol {version:#06x} is older than 2.08 and does not describe its payload")]
    ProtocolTooOld {
        /// The protocol version found.
        version: u16,
    },
    /// The payload lies (partly) outside the file.
    #[error("payload ({len} bytes at offset {offset}) lies outside the {file_len}-byte file")]
    PayloadOutOfBounds {
        /// Payload offset in the file.
        offset: usize,
        /// Payload length.
        len: usize,
        /// File length.
        file_len: usize,
    },
    /// The payload uses a compression other than LZ4.
    #[error("payload is neither LZ4- nor zstd-compressed (magic {magic:02x?}, looks like {kind}); only those are supported")]
    NotLz4 {
        /// The payload's first bytes.
        magic: Vec<u8>,
        /// A guess at the format, from the magic.
        kind: &'static str,
    },
    /// The LZ4 stream is corrupt.
    #[error("payload LZ4 stream is corrupt")]
    Lz4(#[source] Lz4Error),
    /// The size trailer disagrees with what was decompressed.
    #[error("payload decompressed to {actual} bytes but its trailer says {expected}")]
    SizeMismatch {
        /// Size recorded in the trailer.
        expected: u32,
        /// Size obtained.
        actual: usize,
    },
    /// The decompressed payload is not an x86-64 ELF64 file.
    #[error("decompressed payload is not an x86-64 ELF64 file")]
    NotElf64,
}

fn read_u16_le(data: &[u8], offset: usize) -> Option<u16> {
    Some(u16::from_le_bytes(
        data.get(offset..offset + 2)?.try_into().ok()?,
    ))
}

fn read_u32_le(data: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        data.get(offset..offset + 4)?.try_into().ok()?,
    ))
}

/// Location of the compressed kernel inside a bzImage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Payload {
    /// Byte offset in the file.
    pub offset: usize,
    /// Length in bytes (including the size trailer).
    pub len: usize,
}

/// Parses the setup header of `image` and locates its payload.
pub(crate) fn find_payload(image: &[u8]) -> Result<Payload, BzImageError> {
    let too_short = || BzImageError::TooShort { len: image.len() };
    let magic = read_u32_le(image, HEADER_MAGIC_OFFSET).ok_or_else(too_short)?;
    if magic != HEADER_MAGIC {
        return Err(BzImageError::NotBzImage);
    }
    let version = read_u16_le(image, PROTOCOL_VERSION_OFFSET).ok_or_else(too_short)?;
    if version < PROTOCOL_WITH_PAYLOAD {
        return Err(BzImageError::ProtocolTooOld { version });
    }
    let setup_sects = match image[SETUP_SECTS_OFFSET] {
        0 => DEFAULT_SETUP_SECTS,
        n => usize::from(n),
    };
    let payload_offset = read_u32_le(image, PAYLOAD_OFFSET_OFFSET).ok_or_else(too_short)?;
    let len = read_u32_le(image, PAYLOAD_LENGTH_OFFSET).ok_or_else(too_short)? as usize;
    let offset = (setup_sects + 1) * SECTOR_BYTES + payload_offset as usize;
    if offset.checked_add(len).is_none_or(|end| end > image.len()) {
        return Err(BzImageError::PayloadOutOfBounds {
            offset,
            len,
            file_len: image.len(),
        });
    }
    Ok(Payload { offset, len })
}

/// Names the compression format a payload's first bytes suggest.
fn guess_compression(magic: &[u8]) -> &'static str {
    match magic {
        [0x1f, 0x8b, ..] => "gzip",
        [0x42, 0x5a, 0x68, ..] => "bzip2",
        [0x5d, 0x00, ..] => "lzma",
        [0xfd, 0x37, 0x7a, 0x58, ..] => "xz",
        [0x89, 0x4c, 0x5a, 0x4f, ..] => "lzo",
        [0x28, 0xb5, 0x2f, 0xfd, ..] => "zstd",
        [0x04, 0x22, 0x4d, 0x18, ..] => "LZ4 frame format (not legacy)",
        _ => "unknown",
    }
}

/// Whether `data` starts with an x86-64 ELF64 header.
pub(crate) fn is_x86_64_elf(data: &[u8]) -> bool {
    data.starts_with(&ELF64_LE_IDENT) && read_u16_le(data, ELF_MACHINE_OFFSET) == Some(EM_X86_64)
}

/// A zstd-compressed payload: the frame to decompress and the size the build recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ZstdPayload<'a> {
    /// The zstd frame (the payload without its size trailer).
    pub frame: &'a [u8],
    /// The decompressed size from the trailer the kernel build appends (`size_append`).
    pub size: u32,
}

/// The zstd frame of `image`'s payload, or `None` if the payload is not zstd.
pub(crate) fn zstd_payload(image: &[u8]) -> Result<Option<ZstdPayload<'_>>, BzImageError> {
    let payload = find_payload(image)?;
    let bytes = &image[payload.offset..payload.offset + payload.len];
    if !bytes.starts_with(&ZSTD_MAGIC) {
        return Ok(None);
    }
    // The kernel build always appends the size; `zstd` would reject the 4 bytes as a
    // second frame, so they are cut off here.
    let frame_len = bytes.len().saturating_sub(SIZE_TRAILER_BYTES);
    let size = read_u32_le(bytes, frame_len).ok_or(BzImageError::PayloadOutOfBounds {
        offset: payload.offset,
        len: payload.len,
        file_len: image.len(),
    })?;
    Ok(Some(ZstdPayload {
        frame: &bytes[..frame_len],
        size,
    }))
}

/// Checks what `payload`'s frame decompressed to: the recorded size, an x86-64 ELF.
pub(crate) fn check_zstd_output(
    payload: &ZstdPayload<'_>,
    data: Vec<u8>,
) -> Result<Vec<u8>, BzImageError> {
    if data.len() != payload.size as usize {
        return Err(BzImageError::SizeMismatch {
            expected: payload.size,
            actual: data.len(),
        });
    }
    if !is_x86_64_elf(&data) {
        return Err(BzImageError::NotElf64);
    }
    Ok(data)
}

/// Extracts the kernel ELF from the bzImage `image` with an LZ4 payload (for zstd, see
/// [`zstd_payload`]).
pub(crate) fn extract_vmlinux(image: &[u8]) -> Result<Vec<u8>, BzImageError> {
    let payload = find_payload(image)?;
    let bytes = &image[payload.offset..payload.offset + payload.len];
    if read_u32_le(bytes, 0) != Some(LEGACY_MAGIC) {
        let magic: Vec<u8> = bytes.iter().take(6).copied().collect();
        let kind = guess_compression(&magic);
        return Err(BzImageError::NotLz4 { magic, kind });
    }
    let decoded = lz4_legacy::decompress(bytes).map_err(BzImageError::Lz4)?;
    if bytes.len() - decoded.consumed == SIZE_TRAILER_BYTES {
        let expected = read_u32_le(bytes, decoded.consumed).expect("exactly 4 bytes remain");
        if expected as usize != decoded.data.len() {
            return Err(BzImageError::SizeMismatch {
                expected,
                actual: decoded.data.len(),
            });
        }
    }
    if !is_x86_64_elf(&decoded.data) {
        return Err(BzImageError::NotElf64);
    }
    Ok(decoded.data)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lz4_legacy::compress_for_tests;

    /// A fake ELF: a plausible header followed by compressible filler.
    fn fake_elf(len: usize) -> Vec<u8> {
        let mut elf = vec![0u8; len];
        elf[..6].copy_from_slice(&ELF64_LE_IDENT);
        elf[ELF_MACHINE_OFFSET..ELF_MACHINE_OFFSET + 2].copy_from_slice(&EM_X86_64.to_le_bytes());
        for (i, b) in elf.iter_mut().enumerate().skip(64) {
            *b = (i % 251) as u8;
        }
        elf
    }

    /// A synthetic bzImage: setup header fields set, `payload` placed after the setup code
    /// at `payload_offset`.
    fn fake_bzimage(setup_sects: u8, payload_offset: u32, payload: &[u8]) -> Vec<u8> {
        let sects = if setup_sects == 0 {
            4
        } else {
            setup_sects as usize
        };
        let start = (sects + 1) * SECTOR_BYTES + payload_offset as usize;
        let mut image = vec![0u8; start];
        image[SETUP_SECTS_OFFSET] = setup_sects;
        image[HEADER_MAGIC_OFFSET..HEADER_MAGIC_OFFSET + 4].copy_from_slice(b"HdrS");
        image[PROTOCOL_VERSION_OFFSET..PROTOCOL_VERSION_OFFSET + 2]
            .copy_from_slice(&0x020fu16.to_le_bytes());
        image[PAYLOAD_OFFSET_OFFSET..PAYLOAD_OFFSET_OFFSET + 4]
            .copy_from_slice(&payload_offset.to_le_bytes());
        image[PAYLOAD_LENGTH_OFFSET..PAYLOAD_LENGTH_OFFSET + 4]
            .copy_from_slice(&(payload.len() as u32).to_le_bytes());
        image.extend_from_slice(payload);
        image.extend_from_slice(&[0xcc; 100]); // what follows the payload in a real image
        image
    }

    fn kernel_style_payload(elf: &[u8]) -> Vec<u8> {
        let mut payload = compress_for_tests(elf, BLOCK_FOR_TESTS);
        payload.extend_from_slice(&(elf.len() as u32).to_le_bytes());
        payload
    }

    const BLOCK_FOR_TESTS: usize = 256 * 1024;

    #[test]
    fn test_zstd_payload_splits_frame_and_size_trailer() {
        let mut payload = ZSTD_MAGIC.to_vec();
        payload.extend_from_slice(&[1, 2, 3]);
        payload.extend_from_slice(&1234u32.to_le_bytes());
        let image = fake_bzimage(4, 0x40, &payload);
        let z = zstd_payload(&image).expect("parse").expect("zstd");
        assert_eq!(z.frame, &payload[..7]);
        assert_eq!(z.size, 1234);
        // An LZ4 payload is not zstd.
        let lz4 = fake_bzimage(4, 0, &kernel_style_payload(&fake_elf(4096)));
        assert_eq!(zstd_payload(&lz4).expect("parse"), None);
    }

    #[test]
    fn test_check_zstd_output_wants_recorded_size_and_elf() {
        let elf = fake_elf(4096);
        let z = ZstdPayload {
            frame: &[],
            size: 4096,
        };
        assert_eq!(check_zstd_output(&z, elf.clone()).expect("ok"), elf);
        assert!(matches!(
            check_zstd_output(&z, elf[..4000].to_vec()),
            Err(BzImageError::SizeMismatch {
                expected: 4096,
                actual: 4000
            })
        ));
        assert!(matches!(
            check_zstd_output(&z, vec![0; 4096]),
            Err(BzImageError::NotElf64)
        ));
    }

    #[test]
    fn test_find_payload_reads_header_fields() {
        let image = fake_bzimage(27, 0x3a0, &[1, 2, 3]);
        assert_eq!(
            find_payload(&image).expect("parse"),
            Payload {
                offset: 28 * 512 + 0x3a0,
                len: 3
            }
        );
    }

    #[test]
    fn test_find_payload_treats_zero_setup_sects_as_four() {
        let image = fake_bzimage(0, 16, &[9; 8]);
        assert_eq!(find_payload(&image).expect("parse").offset, 5 * 512 + 16);
    }

    #[test]
    fn test_find_payload_rejects_bad_headers() {
        assert!(matches!(
            find_payload(&[0u8; 100]),
            Err(BzImageError::TooShort { len: 100 })
        ));
        let mut image = fake_bzimage(4, 0, &[1]);
        image[HEADER_MAGIC_OFFSET] = b'X';
        assert!(matches!(
            find_payload(&image),
            Err(BzImageError::NotBzImage)
        ));
        let mut image = fake_bzimage(4, 0, &[1]);
        image[PROTOCOL_VERSION_OFFSET..PROTOCOL_VERSION_OFFSET + 2]
            .copy_from_slice(&0x0206u16.to_le_bytes());
        assert!(matches!(
            find_payload(&image),
            Err(BzImageError::ProtocolTooOld { version: 0x0206 })
        ));
        let mut image = fake_bzimage(4, 0, &[1]);
        image[PAYLOAD_LENGTH_OFFSET..PAYLOAD_LENGTH_OFFSET + 4]
            .copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            find_payload(&image),
            Err(BzImageError::PayloadOutOfBounds { .. })
        ));
    }

    #[test]
    fn test_extract_vmlinux_round_trips_kernel_style_payload() {
        let elf = fake_elf(1_000_000);
        let image = fake_bzimage(30, 0x400, &kernel_style_payload(&elf));
        assert_eq!(extract_vmlinux(&image).expect("extract"), elf);
    }

    #[test]
    fn test_extract_vmlinux_accepts_payload_without_trailer() {
        let elf = fake_elf(300_000);
        let image = fake_bzimage(30, 0, &compress_for_tests(&elf, BLOCK_FOR_TESTS));
        assert_eq!(extract_vmlinux(&image).expect("extract"), elf);
    }

    #[test]
    fn test_extract_vmlinux_checks_size_trailer() {
        let elf = fake_elf(300_000);
        let mut payload = compress_for_tests(&elf, BLOCK_FOR_TESTS);
        payload.extend_from_slice(&(elf.len() as u32 + 1).to_le_bytes());
        let image = fake_bzimage(30, 0, &payload);
        assert!(matches!(
            extract_vmlinux(&image),
            Err(BzImageError::SizeMismatch { expected, actual })
                if expected as usize == elf.len() + 1 && actual == elf.len()
        ));
    }

    #[test]
    fn test_extract_vmlinux_rejects_other_compression_and_non_elf() {
        let image = fake_bzimage(30, 0, &[0x1f, 0x8b, 8, 0, 0, 0, 0, 0]);
        assert!(matches!(
            extract_vmlinux(&image),
            Err(BzImageError::NotLz4 { kind: "gzip", .. })
        ));
        let not_elf = vec![0x55u8; 10_000];
        let image = fake_bzimage(30, 0, &kernel_style_payload(&not_elf));
        assert!(matches!(
            extract_vmlinux(&image),
            Err(BzImageError::NotElf64)
        ));
    }
}
