//! The memory store's retention index: which records to evict next, oldest retention first.
//!
//! A handler's retention is a constant of its policy, so a service claims under a few retention
//! lengths, and within one length claims arrive in the order their retention ends. The index is
//! therefore one first-in-first-out queue per length: a claim appends, eviction looks at the queues'
//! fronts. Both are constant time, where an ordered map searched its whole height on every claim
//! (and Rust's B-tree scans each node from the left, the costliest way to append).
//!
//! The queues are exact up to the clock: a claim that read the clock just before another but took
//! the store's lock just after lands behind it, and a wall clock stepped back puts the records
//! claimed after the step behind the ones claimed before it. Such a record is evicted when it reaches
//! its queue's front, late by at most that difference. A record past retention is absent to every
//! reader whether or not it has been evicted (`Record::is_forgotten`), so lateness costs memory, not
//! correctness.
//!
//! Lengths beyond the first [`MAX_QUEUES`] (a caller of [`Store::claim`](crate::store::Store::claim)
//! may pass any retention) go to one ordered map, as the whole index once did.
//!
//! Entries are never removed from the middle: a released record, or one renewed under a new sequence
//! number, leaves its entry behind, and eviction skips an entry whose sequence number no longer
//! matches a slot. Each stale entry goes when its own retention ends.

use crate::clock::Timestamp;
use std::collections::{BTreeMap, VecDeque};

/// Retention lengths with a queue of their own.
const MAX_QUEUES: usize = 8;

/// Entries per chunk of a queue: a queue grows and shrinks a chunk at a time, so a million records
/// never need one contiguous block moved while the store's lock is held.
const CHUNK: usize = 1024;

/// One record's place in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Due {
    pub(super) retain_until: Timestamp,
    /// The slot's sequence number when the entry was made.
    pub(super) seq: u64,
    /// The slot's hash in the table.
    pub(super) hash: u64,
}

/// The index: see the module documentation.
#[derive(Debug, Default)]
pub(super) struct Retention {
    queues: Vec<Queue>,
    /// `(retain_until, seq)` → hash, for retention lengths without a queue.
    others: BTreeMap<(Timestamp, u64), u64>,
}

#[derive(Debug)]
struct Queue {
    /// `retain_until - now` of every claim in it, in milliseconds.
    length: i64,
    /// Only the last chunk may be partly filled.
    chunks: VecDeque<Vec<Due>>,
    /// Where the front is in the first chunk.
    head: usize,
}

impl Queue {
    fn front(&self) -> Option<Due> {
        self.chunks.front().and_then(|c| c.get(self.head)).copied()
    }

    fn push(&mut self, due: Due) {
        match self.chunks.back_mut() {
            Some(chunk) if chunk.len() < CHUNK => chunk.push(due),
            _ => {
                let mut chunk = Vec::with_capacity(CHUNK);
                chunk.push(due);
                self.chunks.push_back(chunk);
            }
        }
    }

    fn pop(&mut self) {
        self.head += 1;
        if self.head == CHUNK {
            self.chunks.pop_front();
            self.head = 0;
        }
    }
}

/// Where the next entry to evict is.
enum Source {
    Queue(usize),
    Others,
}

impl Retention {
    /// Adds a record claimed at `now`.
    pub(super) fn push(&mut self, now: Timestamp, due: Due) {
        let length = due.retain_until.as_millis().saturating_sub(now.as_millis());
        if let Some(queue) = self.queues.iter_mut().find(|q| q.length == length) {
            queue.push(due);
        } else if self.queues.len() < MAX_QUEUES {
            let mut queue = Queue {
                length,
                chunks: VecDeque::new(),
                head: 0,
            };
            queue.push(due);
            self.queues.push(queue);
        } else {
            self.others.insert((due.retain_until, due.seq), due.hash);
        }
    }

    /// Takes the entry whose retention ends first, if it ended at or before `now`.
    pub(super) fn pop_due(&mut self, now: Timestamp) -> Option<Due> {
        let mut next: Option<(Due, Source)> = self.others.first_key_value().map(|(&(r, s), &h)| {
            let due = Due {
                retain_until: r,
                seq: s,
                hash: h,
            };
            (due, Source::Others)
        });
        for (i, queue) in self.queues.iter().enumerate() {
            if let Some(due) = queue.front() {
                if next
                    .as_ref()
                    .is_none_or(|(n, _)| due.retain_until < n.retain_until)
                {
                    next = Some((due, Source::Queue(i)));
                }
            }
        }
        let (due, source) = next.filter(|(due, _)| due.retain_until <= now)?;
        match source {
            Source::Queue(i) => self.queues[i].pop(),
            Source::Others => {
                self.others.pop_first();
            }
        }
        Some(due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn due(retain_until: i64, seq: u64) -> Due {
        Due {
            retain_until: at(retain_until),
            seq,
            hash: seq * 10,
        }
    }

    fn drain(index: &mut Retention, now: i64) -> Vec<u64> {
        std::iter::from_fn(|| index.pop_due(at(now)))
            .map(|d| d.seq)
            .collect()
    }

    #[test]
    fn entries_come_out_in_retention_order_across_lengths_and_only_once_due() {
        let mut index = Retention::default();
        // Three lengths, claimed interleaved: 100 ms, 10 ms, and 50 ms.
        for (seq, now) in (0..6).map(|i| (i as u64, i * 2)) {
            let length = [100, 10, 50][seq as usize % 3];
            index.push(at(now), due(now + length, seq));
        }
        // Due at 12, 18 (length 10); 54, 60 (length 50); 100, 106 (length 100).
        assert!(index.pop_due(at(11)).is_none());
        assert_eq!(drain(&mut index, 20), [1, 4]);
        assert_eq!(drain(&mut index, 99), [2, 5]);
        assert_eq!(drain(&mut index, 1_000), [0, 3]);
        assert!(index.pop_due(at(i64::MAX)).is_none());
    }

    #[test]
    fn a_queue_spans_chunks_and_lengths_past_the_queues_go_to_the_map() {
        let mut index = Retention::default();
        let n = CHUNK as u64 * 2 + 3;
        for seq in 0..n {
            index.push(at(seq as i64), due(1_000 + seq as i64, seq));
        }
        // More lengths than queues: the last ones are kept in the map and still come out in order.
        for extra in 0..MAX_QUEUES as u64 + 3 {
            let seq = n + extra;
            index.push(at(0), due(500 + extra as i64, seq));
        }
        assert_eq!(index.queues.len(), MAX_QUEUES);
        assert_eq!(index.others.len(), 4);
        let extras: Vec<u64> = (n..n + MAX_QUEUES as u64 + 3).collect();
        assert_eq!(drain(&mut index, 999), extras);
        let all: Vec<u64> = (0..n).collect();
        assert_eq!(drain(&mut index, i64::MAX), all);
        // Drained, the queue takes new entries again.
        index.push(at(0), due(5, 7));
        assert_eq!(drain(&mut index, 5), [7]);
    }
}
