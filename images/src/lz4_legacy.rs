//! Decoder for the LZ4 *legacy* frame format, the one Linux uses for `CONFIG_KERNEL_LZ4`.
//!
//! Format: the 4-byte little-endian magic [`LEGACY_MAGIC`], then blocks, each a little-endian
//! `u32` compressed size followed by that many bytes of raw LZ4 block data that decompress to
//! at most [`BLOCK_MAX_BYTES`]. There is no end marker: the stream ends at end of input or at
//! a size word that cannot start a block (zero, larger than the worst-case compressed size of
//! a block, or larger than what is left). A size word equal to the magic starts a
//! concatenated stream and is skipped, as the kernel's `unlz4` and the `lz4` tool do.
//!
//! Invariant: decoding never panics and never reads outside `input`; the caller learns how
//! many bytes were consumed, so it can interpret what follows (the kernel appends a size).

/// Magic number that opens a legacy frame.
pub(crate) const LEGACY_MAGIC: u32 = 0x184C_2102;
/// Maximum decompressed size of one block (8 MiB).
pub(crate) const BLOCK_MAX_BYTES: usize = 8 << 20;
/// Largest compressed size a block can have: `LZ4_compressBound(BLOCK_MAX_BYTES)`.
const BLOCK_MAX_COMPRESSED_BYTES: usize = BLOCK_MAX_BYTES + BLOCK_MAX_BYTES / 255 + 16;
/// Size of the magic and of each block-size word.
const WORD_BYTES: usize = 4;

/// Why a legacy LZ4 stream could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum Lz4Error {
    /// The input does not start with [`LEGACY_MAGIC`].
    #[error("not an LZ4 legacy stream (first bytes {found:02x?})")]
    BadMagic {
        /// The first bytes found instead.
        found: Vec<u8>,
    },
    /// A block's data is not valid LZ4 or decompresses to more than 8 MiB.
    #[error("LZ4 block at byte offset {offset} is corrupt")]
    Block {
        /// Offset of the block's size word in the input.
        offset: usize,
        /// What the block decoder reported.
        #[source]
        source: lz4_flex::block::DecompressError,
    },
}

/// A decoded stream.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Decoded {
    /// The decompressed bytes.
    pub data: Vec<u8>,
    /// How many input bytes the stream occupied (magic and blocks).
    pub consumed: usize,
}

fn read_u32_le(input: &[u8], offset: usize) -> Option<u32> {
    let bytes = input.get(offset..offset.checked_add(WORD_BYTES)?)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

/// Decodes the legacy LZ4 stream at the start of `input`.
pub(crate) fn decompress(input: &[u8]) -> Result<Decoded, Lz4Error> {
    if read_u32_le(input, 0) != Some(LEGACY_MAGIC) {
        return Err(Lz4Error::BadMagic {
            found: input.iter().take(WORD_BYTES).copied().collect(),
        });
    }
    let mut pos = WORD_BYTES;
    let mut data = Vec::new();
    let mut block = vec![0u8; BLOCK_MAX_BYTES];
    while let Some(word) = read_u32_le(input, pos) {
        if word == LEGACY_MAGIC {
            pos += WORD_BYTES;
            continue;
        }
        let size = word as usize;
        let start = pos + WORD_BYTES;
        let remaining = input.len() - start;
        if size == 0 || size > BLOCK_MAX_COMPRESSED_BYTES || size > remaining {
            break;
        }
        let n = lz4_flex::block::decompress_into(&input[start..start + size], &mut block).map_err(
            |source| Lz4Error::Block {
                offset: pos,
                source,
            },
        )?;
        data.extend_from_slice(&block[..n]);
        pos = start + size;
    }
    Ok(Decoded {
        data,
        consumed: pos,
    })
}

/// Encodes `data` as a legacy stream (test helper; the kernel build does this for real).
#[cfg(test)]
pub(crate) fn compress_for_tests(data: &[u8], block_bytes: usize) -> Vec<u8> {
    let mut out = LEGACY_MAGIC.to_le_bytes().to_vec();
    for chunk in data.chunks(block_bytes) {
        let compressed = lz4_flex::block::compress(chunk);
        out.extend_from_slice(&(compressed.len() as u32).to_le_bytes());
        out.extend_from_slice(&compressed);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Vec<u8> {
        (0..len).map(|i| ((i * 7) ^ (i >> 9)) as u8).collect()
    }

    #[test]
    fn test_decompress_round_trips_multi_block_stream() {
        let data = sample(3 * 1024 * 1024 + 17);
        let stream = compress_for_tests(&data, 1024 * 1024);
        let decoded = decompress(&stream).expect("decode");
        assert_eq!(decoded.data, data);
        assert_eq!(decoded.consumed, stream.len());
    }

    #[test]
    fn test_decompress_stops_at_implausible_size_word() {
        let data = sample(100_000);
        let mut stream = compress_for_tests(&data, 64 * 1024);
        let consumed = stream.len();
        // What the kernel appends: the total decompressed size, far above a block's bound.
        stream.extend_from_slice(&(40u32 << 20).to_le_bytes());
        let decoded = decompress(&stream).expect("decode");
        assert_eq!(decoded.data, data);
        assert_eq!(decoded.consumed, consumed);
    }

    #[test]
    fn test_decompress_stops_at_size_word_beyond_input() {
        let data = sample(5000);
        let mut stream = compress_for_tests(&data, 4096);
        let consumed = stream.len();
        stream.extend_from_slice(&1000u32.to_le_bytes());
        stream.extend_from_slice(&[0u8; 10]);
        let decoded = decompress(&stream).expect("decode");
        assert_eq!(decoded.data, data);
        assert_eq!(decoded.consumed, consumed);
    }

    #[test]
    fn test_decompress_continues_across_concatenated_streams() {
        let a = sample(3000);
        let b: Vec<u8> = sample(2000).into_iter().rev().collect();
        let mut stream = compress_for_tests(&a, 1024);
        stream.extend_from_slice(&compress_for_tests(&b, 1024));
        let decoded = decompress(&stream).expect("decode");
        assert_eq!(decoded.data, [a, b].concat());
        assert_eq!(decoded.consumed, stream.len());
    }

    #[test]
    fn test_decompress_rejects_bad_magic() {
        let err = decompress(&[0x1f, 0x8b, 8, 0, 0]).expect_err("gzip is not lz4");
        assert!(matches!(err, Lz4Error::BadMagic { ref found } if found == &[0x1f, 0x8b, 8, 0]));
        assert!(decompress(&[]).is_err());
    }

    #[test]
    fn test_decompress_reports_corrupt_block() {
        let mut stream = LEGACY_MAGIC.to_le_bytes().to_vec();
        // A token promising 15+ literals with no length byte and no literals.
        stream.extend_from_slice(&2u32.to_le_bytes());
        stream.extend_from_slice(&[0xf0, 0xff]);
        let err = decompress(&stream).expect_err("corrupt block");
        assert!(matches!(err, Lz4Error::Block { offset: 4, .. }), "{err:?}");
    }
}
