//! The memory store's blocks: where a completed record's byte string is kept.
//!
//! A record stays for its retention (a day by default); everything else a request allocates is
//! freed when the request ends. Allocated one by one, the records' byte strings land among the
//! requests' short-lived allocations, and glibc's allocator then serves later requests from the
//! scattered, cold chunks left between them: on the bench machine that cost each new key about
//! 2.5 µs of the server's CPU, more than idem's own work on the request (BENCHMARKS.md, "Where a
//! new key's CPU went: the allocator"). So a shard cuts its completed records' byte strings from
//! blocks of [`BLOCK_SIZE`] bytes, as `Bytes` that share the block, and the allocator sees one
//! block every hundred records or so instead of one chunk per record.
//!
//! A block holds the records of one retention length, in the order they completed. Records of one
//! length leave in about the order they came (oldest retention first), so a block is freed soon
//! after its last record's retention ends: the store holds about its live records' bytes, plus the
//! bytes of records released or renewed since their block opened (each freed with its block, within
//! one retention length), plus one partly filled block per length and shard. A record longer than
//! [`BLOCK_RECORD_MAX`], or of a length beyond the first [`BLOCK_LENGTHS`] a shard has seen, is not
//! cut from a block: its caller allocates it alone, as before.

use bytes::{Bytes, BytesMut};

/// The longest byte string cut from a block. A longer one is allocated alone: it is not the small,
/// scattered chunk that hurts the allocator, and the caller packs it outside the shard's lock.
pub(super) const BLOCK_RECORD_MAX: usize = 1024;

/// A block's size: about a hundred small records.
pub(super) const BLOCK_SIZE: usize = 16 * 1024;

/// Retention lengths a shard opens a block for. A service's handlers share a few retention lengths
/// (each a constant of its policy); any other length's records are allocated alone.
pub(super) const BLOCK_LENGTHS: usize = 4;

/// A shard's open blocks, one per retention length.
#[derive(Debug, Default)]
pub(super) struct Blocks {
    /// Retention length in milliseconds, and the block's unused part.
    open: Vec<(i64, BytesMut)>,
}

impl Blocks {
    /// The `len` bytes `write` appends, as a `Bytes` of their own cut from the open block of records
    /// retained `length` milliseconds (a new block when it has no room left); `None` when no block
    /// takes them (longer than [`BLOCK_RECORD_MAX`], or [`BLOCK_LENGTHS`] other lengths are open).
    pub(super) fn cut(
        &mut self,
        length: i64,
        len: usize,
        write: impl FnOnce(&mut BytesMut),
    ) -> Option<Bytes> {
        if len > BLOCK_RECORD_MAX {
            return None;
        }
        let i = match self.open.iter().position(|(l, _)| *l == length) {
            Some(i) => i,
            None if self.open.len() < BLOCK_LENGTHS => {
                self.open.push((length, BytesMut::new()));
                self.open.len() - 1
            }
            None => return None,
        };
        let block = &mut self.open[i].1;
        // After a cut, a block's capacity is what is left of it.
        if block.capacity() < len {
            *block = BytesMut::with_capacity(BLOCK_SIZE);
        }
        write(block);
        debug_assert_eq!(block.len(), len, "`len` is what `write` appends");
        Some(block.split().freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(blocks: &mut Blocks, length: i64, bytes: &[u8]) -> Option<Bytes> {
        blocks.cut(length, bytes.len(), |b| b.extend_from_slice(bytes))
    }

    #[test]
    fn records_of_one_length_follow_each_other_in_one_block() {
        let mut blocks = Blocks::default();
        let a = cut(&mut blocks, 1_000, b"first").expect("cut");
        let b = cut(&mut blocks, 1_000, b"second").expect("cut");
        assert_eq!((&a[..], &b[..]), (&b"first"[..], &b"second"[..]));
        assert_eq!(b.as_ptr(), a.as_ptr().wrapping_add(a.len()), "b follows a");
        // Another length has a block of its own.
        let c = cut(&mut blocks, 2_000, b"third").expect("cut");
        let d = cut(&mut blocks, 1_000, b"fourth").expect("cut");
        assert_eq!(
            d.as_ptr(),
            b.as_ptr().wrapping_add(b.len()),
            "d follows b, not c"
        );
        assert_ne!(c.as_ptr(), b.as_ptr().wrapping_add(b.len()));
    }

    #[test]
    fn a_full_block_is_held_by_its_records_alone() {
        let mut blocks = Blocks::default();
        let record = [7u8; BLOCK_RECORD_MAX];
        let per_block = BLOCK_SIZE / BLOCK_RECORD_MAX;
        let mut full: Vec<Bytes> = (0..per_block)
            .map(|_| cut(&mut blocks, 1, &record).expect("cut"))
            .collect();
        for pair in full.windows(2) {
            assert_eq!(
                pair[1].as_ptr(),
                pair[0].as_ptr().wrapping_add(BLOCK_RECORD_MAX)
            );
        }
        assert!(!full[0].is_unique(), "the block's other records hold it");
        let next = cut(&mut blocks, 1, &record).expect("cut");
        let end = full[per_block - 1].as_ptr().wrapping_add(BLOCK_RECORD_MAX);
        assert_ne!(next.as_ptr(), end, "a full block opens the next");
        let last = full.pop().expect("a record");
        drop(full);
        assert!(
            last.is_unique(),
            "nothing but its records holds a full block: dropping the last frees it"
        );
    }

    #[test]
    fn long_records_and_lengths_past_the_limit_are_left_to_the_caller() {
        let mut blocks = Blocks::default();
        assert!(cut(&mut blocks, 1, &[0; BLOCK_RECORD_MAX + 1]).is_none());
        for length in 0..BLOCK_LENGTHS as i64 {
            assert!(cut(&mut blocks, length, b"x").is_some());
        }
        assert!(cut(&mut blocks, BLOCK_LENGTHS as i64, b"x").is_none());
        assert!(cut(&mut blocks, 0, b"still open").is_some());
    }
}
