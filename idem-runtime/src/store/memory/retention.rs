//! The memory store's retention index: which records to evict next, oldest retention first.
//!
//! A handler's retention is a constant of its policy, so a service claims under a few retention
//! lengths, and within one length claims arrive in the order their retention ends. The index is
//! therefore one first-in-first-out queue per length: a claim appends, eviction looks at the queues'
//! fronts. Both are constant time, where an ordered map searched its whole height on every claim
//! (and Rust's B-tree scans each node from the left, the costliest way to append).
//!
//! Every queue stays sorted, so the index is exact. An entry that would land out of order in its
//! queue goes to one ordered map instead, as the whole index once did: a claim that read the clock
//! just before another but took the lock just after, or any claim after the wall clock stepped back.
//! So do lengths beyond the first [`MAX_QUEUES`] (a caller of
//! [`Store::claim`](crate::store::Store::claim) may pass any retention); a queue left empty is
//! taken by the next new length.
//!
//! Entries are not removed from the middle: a released record, or one renewed under a new sequence
//! number, leaves its entry behind, and eviction skips an entry whose sequence number no longer
//! matches a slot. The store counts such entries and, once they outnumber its records, keeps only
//! the live ones ([`Retention::retain`]), so the index never holds more than about twice as many
//! entries as the store holds records.

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
    fn new(length: i64) -> Self {
        Queue {
            length,
            chunks: VecDeque::new(),
            head: 0,
        }
    }

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

    /// The entry pushed last, whether or not it has been popped since.
    fn back(&self) -> Option<Due> {
        self.chunks.back().and_then(|c| c.last()).copied()
    }

    fn pop(&mut self) {
        self.head += 1;
        if self.head == CHUNK {
            self.chunks.pop_front();
            self.head = 0;
        }
    }

    fn entries(&self) -> impl Iterator<Item = &Due> {
        self.chunks.iter().flatten().skip(self.head)
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
        let length = due.retain_until.as_millis().checked_sub(now.as_millis());
        let in_order = |q: &Queue| {
            q.back()
                .is_none_or(|last| last.retain_until <= due.retain_until)
        };
        let queue = match length {
            None => None,
            Some(length) => match self.queues.iter().position(|q| q.length == length) {
                Some(i) => Some(i).filter(|&i| in_order(&self.queues[i])),
                None => self.new_queue(length),
            },
        };
        match queue {
            Some(i) => self.queues[i].push(due),
            None => {
                self.others.insert((due.retain_until, due.seq), due.hash);
            }
        }
    }

    /// A queue for a new retention length: a new one while there are fewer than [`MAX_QUEUES`],
    /// else one left empty, else none.
    fn new_queue(&mut self, length: i64) -> Option<usize> {
        let empty = Queue::new(length);
        if self.queues.len() < MAX_QUEUES {
            self.queues.push(empty);
            return Some(self.queues.len() - 1);
        }
        let i = self.queues.iter().position(|q| q.front().is_none())?;
        self.queues[i] = empty;
        Some(i)
    }

    /// Keeps only the entries `keep` accepts, in order. Linear in the entries held.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&Due) -> bool) {
        for queue in &mut self.queues {
            let mut kept = Queue::new(queue.length);
            for due in queue.entries().filter(|due| keep(due)) {
                kept.push(*due);
            }
            *queue = kept;
        }
        self.others.retain(|&(retain_until, seq), &mut hash| {
            keep(&Due {
                retain_until,
                seq,
                hash,
            })
        });
    }

    /// How many entries are held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        let queued = |q: &Queue| q.chunks.iter().map(Vec::len).sum::<usize>() - q.head;
        self.queues.iter().map(queued).sum::<usize>() + self.others.len()
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
        // Drained, a queue takes new entries of its length again...
        index.push(at(10_000), due(11_000, 7));
        assert_eq!(index.others.len(), 0);
        assert_eq!(index.len(), 1);
        assert_eq!(drain(&mut index, 11_000), [7]);
        // ... and an empty queue is taken by a new length rather than the map.
        index.push(at(0), due(77, 8));
        assert_eq!(index.others.len(), 0);
        assert!(index.queues.iter().any(|q| q.length == 77));
    }

    #[test]
    fn an_entry_out_of_order_in_its_queue_goes_to_the_map_and_nothing_waits_behind_it() {
        let mut index = Retention::default();
        // The clock stepped forward by a day, then back: the entry claimed in the future must not
        // hold back the ones after it, which are due much earlier.
        index.push(at(0), due(10, 1));
        index.push(at(86_400_000), due(86_400_010, 2));
        index.push(at(1), due(11, 3));
        index.push(at(2), due(12, 4));
        assert_eq!(
            index.others.len(),
            2,
            "3 and 4 would land behind 2 in the queue"
        );
        assert_eq!(drain(&mut index, 20), [1, 3, 4]);
        // A retention that does not fit an i64 of milliseconds goes to the map too.
        index.push(at(-5), due(i64::MAX, 5));
        assert_eq!(drain(&mut index, i64::MAX), [2, 5]);
    }

    #[test]
    fn retain_keeps_the_accepted_entries_in_order() {
        let mut index = Retention::default();
        for seq in 0..(CHUNK as u64 + 10) {
            index.push(at(seq as i64), due(100 + seq as i64, seq));
        }
        for extra in 0..MAX_QUEUES as u64 + 2 {
            index.push(at(0), due(50 + extra as i64, 10_000 + extra));
        }
        index.pop_due(at(50));
        index.retain(|d| d.seq % 2 == 0);
        let kept = drain(&mut index, i64::MAX);
        let mut expected: Vec<u64> = (10_002..10_000 + MAX_QUEUES as u64 + 2)
            .filter(|s| s % 2 == 0)
            .collect();
        expected.extend((0..CHUNK as u64 + 10).filter(|s| s % 2 == 0));
        assert_eq!(kept, expected);
    }

    proptest::proptest! {
        /// Against a sorted set: whatever the pushes (any length, the clock stepping either way),
        /// compactions and pops, `pop_due` returns an entry exactly when one is due, and the one
        /// whose retention ends first.
        #[test]
        fn pop_due_agrees_with_a_sorted_set(
            ops in proptest::collection::vec((0u8..4, -50i64..200, 0i64..120), 1..300),
        ) {
            let mut index = Retention::default();
            let mut model = std::collections::BTreeSet::new();
            for (seq, (op, now, length)) in ops.into_iter().enumerate() {
                let seq = seq as u64;
                match op {
                    0 | 1 => {
                        index.push(at(now), due(now + length, seq));
                        model.insert((now + length, seq));
                    }
                    2 => {
                        let keep = |s: u64| s % 3 != length as u64 % 3;
                        index.retain(|d| keep(d.seq));
                        model.retain(|&(_, s)| keep(s));
                    }
                    _ => {
                        let first = model.first().copied().filter(|&(end, _)| end <= now);
                        match (index.pop_due(at(now)), first) {
                            (None, None) => {}
                            (Some(got), Some((end, _))) => {
                                proptest::prop_assert_eq!(got.retain_until, at(end));
                                proptest::prop_assert!(
                                    model.remove(&(end, got.seq)),
                                    "popped an entry the model does not hold"
                                );
                            }
                            (got, want) => proptest::prop_assert!(
                                false,
                                "at {now}: popped {got:?}, the earliest due is {want:?}"
                            ),
                        }
                    }
                }
            }
        }
    }
}
