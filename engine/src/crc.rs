//! CRC-32C (Castagnoli): the checksum of every log record and block, tree
//! node, superblock, segment-object chunk and footer, and of the files
//! arbor keeps beside them.
//!
//! Computed by `crc-fast`, which folds 64 bytes at a time with carry-less
//! multiplication (VPCLMULQDQ or PCLMULQDQ on x86_64, PMULL on aarch64,
//! chosen at run time; a table elsewhere). The `crc32c` crate chains the
//! CPU's crc32 instruction instead, whose latency bounds it: on this
//! project's machine kind it checks 1 MiB in 4 KiB blocks in 50 µs, where
//! this takes 24 µs, and a block in 190 against 92 ns (`cargo bench -p
//! arbor-engine --bench crc` measures both). Every write and every
//! verified read passes its bytes through here once. Same polynomial, same values: nothing on disk changes, and
//! the `crc32c` crate stays as the reference the tests compare against.

use crc_fast::{CrcAlgorithm, Digest};

/// The CRC-32C of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// The CRC-32C of `prefix` followed by `data`, given `crc`, the CRC-32C of
/// `prefix`.
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    // The running state is the checksum before its final inversion.
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(data);
    d.finalize() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_check_value_of_the_catalogue() {
        // CRC-32/ISCSI in the CRC catalogue: check = 0xe3069283.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c_append(crc32c(b"1234"), b"56789"), 0xe306_9283);
    }

    #[test]
    fn every_length_around_the_folding_widths_matches_the_reference() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in (0..300).chain([511, 512, 513, 1023, 1024, 1025, 4095, 4096, 4097, 5000]) {
            for start in 0..3 {
                let b = &data[start..(start + len).min(data.len())];
                assert_eq!(crc32c(b), crc32c::crc32c(b), "len {len} at {start}");
            }
        }
    }

    proptest! {
        #[test]
        fn appending_in_any_split_matches_the_reference(data in proptest::collection::vec(any::<u8>(), 0..9000), cut in any::<proptest::sample::Index>()) {
            let at = cut.index(data.len() + 1);
            let want = crc32c::crc32c(&data);
            prop_assert_eq!(crc32c(&data), want);
            prop_assert_eq!(crc32c_append(crc32c(&data[..at]), &data[at..]), want);
            prop_assert_eq!(crc32c_append(crc32c::crc32c(&data[..at]), &data[at..]), want);
        }
    }
}
