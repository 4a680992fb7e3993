//! The in-memory store: for tests and single-process services.
//!
//! The records are split by key hash into sixteen shards (`SHARDS`), each a table under its own
//! mutex. Every operation on a key is one critical section under its shard's mutex, which makes the
//! claim trivially atomic. The mutexes come from `crate::sync`, so `tests/loom.rs` checks claim,
//! complete and release under every interleaving.
//! Memory stays bounded by the live records: each claim evicts a few records past retention from its
//! shard (oldest first, through the shard's `retention` index), and [`Purge`] evicts in batches,
//! shard after shard. A released or renewed record leaves a 24-byte index entry behind until such
//! entries outnumber the shard's records, when they are dropped together.
//! Nothing survives a restart, and a second process never sees these records: use SQLite,
//! PostgreSQL or Redis for that.
//!
//! # Layout
//! A shard's records live in a hash table of 16-byte buckets (the key's hash and a boxed slot
//! holding the record's head, a sequence number and one byte string). Keys are client-controlled,
//! so the hash is the standard library's keyed SipHash, computed once per operation (before the
//! lock is taken) and kept in the bucket for the table's own resizing. The retention index holds
//! `retain_until`, the sequence number and that hash: eviction finds its slot by hash and sequence,
//! so the index holds no copy of the key and compares integers only.
//!
//! A slot's byte string holds the scope and the key and, once the record is completed, the stored
//! response's headers and body (`pack`), where keeping the key and response as they arrive kept one
//! allocation per string (nine for a 201 with two headers). A completed record's string of up to
//! a KiB is cut from one of the shard's blocks, each holding the records of one retention length
//! (`blocks`: records that live for a day, allocated one by one among the requests' short-lived
//! allocations, slowed the allocator for every request); a longer one is allocated alone. So a
//! record is its slot's allocation and a slice of a block. A replay's header values and body are
//! slices of the record's bytes (a standard header's name is `http`'s constant), which share the
//! block's reference count: a replay allocates nothing for them.
//! The head is the record without the response's headers and body; the rules every store shares
//! ([`Record::is_forgotten`], [`Record::can_take_over`]) run on a `Record` built from it, which
//! allocates nothing.

use super::{Claim, ClaimOutcome, Purge, Store, StoreError, Subscription, Waiters};
use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use crate::sync::{Mutex, MutexGuard};
use blocks::{Blocks, BLOCK_RECORD_MAX};
use bytes::BufMut;
use bytes::Bytes;
use hashbrown::hash_table::{Entry, HashTable};
use http::header::{HeaderName, HeaderValue};
use retention::{Due, Retention};
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::PoisonError;

mod blocks;
mod retention;

/// How many records past retention one claim evicts at most (keeps each critical section short).
const EVICT_PER_CLAIM: usize = 8;

/// An in-memory [`Store`].
///
/// ```
/// use idem_runtime::{Engine, store::memory::MemoryStore};
/// let engine = Engine::new(MemoryStore::new());
/// # let _ = engine;
/// ```
#[derive(Debug)]
pub struct MemoryStore {
    /// The records, split by key hash (see [`SHARDS`]).
    shards: Box<[Shard]>,
    /// Outside the locks: hashing a key needs no other state, and the hash picks the shard.
    hasher: RandomState,
    waiters: Waiters,
}

/// How many independently locked parts the records are split into. One lock over all records makes
/// every claim and completion of a many-core service wait for every other; split, operations on
/// different keys rarely meet (on the two-core bench machine the difference is within noise, see
/// docs/benchmarks-history.md). Fewer under loom, whose models explore every lock.
#[cfg(not(loom))]
const SHARDS: usize = 16;
#[cfg(loom)]
const SHARDS: usize = 2;

/// One shard, on cache lines of its own (128 bytes: the adjacent-line prefetcher pairs 64-byte
/// lines).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<Inner>);

impl Default for MemoryStore {
    fn default() -> Self {
        Self::with_shards(SHARDS)
    }
}

#[derive(Debug, Default)]
struct Inner {
    records: HashTable<Bucket>,
    retention: Retention,
    /// Where completed records' byte strings are cut from (see `blocks`).
    blocks: Blocks,
    /// Entries in `retention` left behind by released or renewed records (an upper bound: an
    /// entry evicted meanwhile may still be counted).
    stale: usize,
    next_seq: u64,
}

/// Stale retention entries are dropped once they outnumber the shard's records and this.
const STALE_BEFORE_COMPACTING: usize = 1024;

/// What one eviction did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Evicted {
    records: u64,
    /// Whether nothing more was due when it stopped.
    dry: bool,
}

/// What the table holds: the key's hash and the boxed slot. Sixteen bytes, so that growing a table
/// of millions of records moves little (the mutex is held meanwhile), and a probe compares hashes
/// before it follows a pointer.
#[derive(Debug)]
struct Bucket {
    hash: u64,
    slot: Box<Slot>,
}

#[derive(Debug)]
struct Slot {
    /// Tells this record's retention entry from a later record's under the same key.
    seq: u64,
    /// The record but for its stored headers and body, which are in `bytes`.
    head: Head,
    /// The scope, the key, then (once completed) the response's headers and body, see
    /// [`pack`]. `Bytes`, so that a replay's body is a view of it, not a copy.
    bytes: Bytes,
    /// Where the scope ends and the key begins in `bytes`.
    scope_end: usize,
    /// Where the key ends in `bytes`.
    key_end: usize,
}

/// A record as a slot keeps it: a completed one's response reduced to its status.
#[derive(Debug, Clone, Copy)]
struct Head {
    fingerprint: Fingerprint,
    token: FencingToken,
    created_at: Timestamp,
    expires_at: Timestamp,
    retain_until: Timestamp,
    state: HeadState,
}

#[derive(Debug, Clone, Copy)]
enum HeadState {
    InFlight { lease_until: Timestamp },
    Completed { status: u16 },
}

impl Head {
    /// `record`'s head: the inverse of [`Head::record`] but for the response's headers and body.
    fn of(record: &Record) -> Self {
        Head {
            fingerprint: record.fingerprint,
            token: record.token,
            created_at: record.created_at,
            expires_at: record.expires_at,
            retain_until: record.retain_until,
            state: match &record.state {
                RecordState::InFlight { lease_until } => HeadState::InFlight {
                    lease_until: *lease_until,
                },
                RecordState::Completed { response } => HeadState::Completed {
                    status: response.status,
                },
            },
        }
    }

    /// How long the record is retained after its claim, in milliseconds: the retention length its
    /// completed bytes' block is chosen by (see `blocks`).
    fn retention_length(&self) -> i64 {
        self.retain_until.as_millis() - self.created_at.as_millis()
    }

    fn in_flight_under(&self, token: FencingToken) -> bool {
        self.token == token && matches!(self.state, HeadState::InFlight { .. })
    }

    /// The record with `headers` and `body` as its response, if completed; the `Record` rules
    /// (`is_forgotten`, `can_take_over`) are applied to this, so that every store shares them.
    fn record(&self, headers: Vec<(HeaderName, HeaderValue)>, body: Bytes) -> Record {
        Record {
            fingerprint: self.fingerprint,
            token: self.token,
            created_at: self.created_at,
            expires_at: self.expires_at,
            retain_until: self.retain_until,
            state: match self.state {
                HeadState::InFlight { lease_until } => RecordState::InFlight { lease_until },
                HeadState::Completed { status } => RecordState::Completed {
                    response: StoredResponse {
                        status,
                        headers,
                        body,
                    },
                },
            },
        }
    }

    /// The record without its stored headers and body (no allocation), for the rules.
    fn view(&self) -> Record {
        self.record(Vec::new(), Bytes::new())
    }
}

/// A slot's byte string: the scope and the key, then, for a completed record, the header count,
/// each name and value (each after its length), then the body, all lengths as 4-byte little-endian
/// integers (a stored header is far below 4 GiB: it comes from a response's head, and bodies are
/// buffered under the endpoint's limit). This allocates it alone, exactly sized (`Bytes::from` a
/// full vector allocates nothing more); a completed record's short string is cut from a block
/// instead ([`MemoryStore::complete`](Store::complete)).
fn pack(key: &RecordKey, response: Option<&StoredResponse>) -> Bytes {
    let len = packed_len(key, response);
    let mut bytes = Vec::with_capacity(len);
    pack_into(&mut bytes, key, response);
    debug_assert_eq!(bytes.len(), len, "the capacity is the packed length");
    Bytes::from(bytes)
}

/// How long [`pack`]'s string is.
fn packed_len(key: &RecordKey, response: Option<&StoredResponse>) -> usize {
    let head = key.scope.len() + key.key.len();
    let Some(response) = response else {
        return head;
    };
    let header_bytes: usize = response
        .headers
        .iter()
        .map(|(name, value)| 8 + name.as_str().len() + value.len())
        .sum();
    head + 4 + header_bytes + response.body.len()
}

/// Appends [`pack`]'s string to `out`.
fn pack_into(out: &mut impl BufMut, key: &RecordKey, response: Option<&StoredResponse>) {
    out.put_slice(key.scope.as_bytes());
    out.put_slice(key.key.as_bytes());
    let Some(response) = response else {
        return;
    };
    let put_len = |out: &mut _, len: usize| {
        BufMut::put_u32_le(out, u32::try_from(len).unwrap_or(u32::MAX));
    };
    put_len(out, response.headers.len());
    for (name, value) in &response.headers {
        put_len(out, name.as_str().len());
        out.put_slice(name.as_str().as_bytes());
        put_len(out, value.len());
        out.put_slice(value.as_bytes());
    }
    out.put_slice(&response.body);
}

impl Slot {
    fn new(seq: u64, key: &RecordKey, head: Head) -> Box<Self> {
        Box::new(Slot {
            seq,
            head,
            bytes: pack(key, None),
            scope_end: key.scope.len(),
            key_end: key.scope.len() + key.key.len(),
        })
    }

    fn is(&self, key: &RecordKey) -> bool {
        self.bytes.get(..self.scope_end) == Some(key.scope.as_bytes())
            && self.bytes.get(self.scope_end..self.key_end) == Some(key.key.as_bytes())
    }

    /// Replaces the record, keeping the key and dropping any stored response.
    fn renew(&mut self, seq: u64, head: Head) {
        self.seq = seq;
        self.head = head;
        if self.bytes.len() > self.key_end {
            self.bytes = Bytes::copy_from_slice(self.bytes.get(..self.key_end).unwrap_or_default());
        }
    }

    /// Completes the record with `bytes`, packed by [`pack`] for this slot's key, and `status`;
    /// returns the bytes it held, to be dropped once the store's lock is released.
    fn complete(&mut self, bytes: Bytes, status: u16) -> Bytes {
        self.head.state = HeadState::Completed { status };
        std::mem::replace(&mut self.bytes, bytes)
    }

    /// The record as stored, its response (if completed) rebuilt from the bytes: the header values
    /// and the body share the record's bytes (and so its block, whose reference count a replay
    /// takes and gives back), and a standard header's name is `http`'s constant.
    /// The bytes were packed from checked headers, so decoding them fails only if memory is
    /// damaged; it then reports the record corrupt, as every store does, rather than replay part
    /// of a response.
    fn record(&self) -> Result<Record, StoreError> {
        match self.head.state {
            HeadState::InFlight { .. } => Ok(self.head.view()),
            HeadState::Completed { .. } => {
                let mut rest = self.bytes.get(self.key_end..).unwrap_or_default();
                let count = take_len(&mut rest);
                let mut headers = Vec::with_capacity(count.min(rest.len() / 8));
                for _ in 0..count {
                    let name = take(&mut rest);
                    let value = self.bytes.slice_ref(take(&mut rest));
                    headers.push(crate::record::header(name, value).map_err(StoreError::corrupt)?);
                }
                Ok(self.head.record(headers, self.bytes.slice_ref(rest)))
            }
        }
    }
}

/// Reads a length written by [`pack`] off the front of `rest`.
fn take_len(rest: &mut &[u8]) -> usize {
    let (len, tail) = rest.split_first_chunk::<4>().unwrap_or((&[0; 4], &[]));
    *rest = tail;
    u32::from_le_bytes(*len) as usize
}

/// Reads the bytes written by [`pack`] (their length, then themselves) off the front of `rest`.
fn take<'a>(rest: &mut &'a [u8]) -> &'a [u8] {
    let len = take_len(rest).min(rest.len());
    let (bytes, tail) = rest.split_at(len);
    *rest = tail;
    bytes
}

impl Inner {
    fn find(&self, hash: u64, key: &RecordKey) -> Option<&Slot> {
        self.records
            .find(hash, |b| b.hash == hash && b.slot.is(key))
            .map(|b| &*b.slot)
    }

    fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// Removes the record; its retention entry is left to eviction, which skips it.
    fn remove(&mut self, hash: u64, key: &RecordKey) {
        if let Ok(entry) = self
            .records
            .find_entry(hash, |b| b.hash == hash && b.slot.is(key))
        {
            entry.remove();
            self.left_stale();
        }
    }

    /// One retention entry no longer matches a record. Once such entries outnumber the records
    /// (and [`STALE_BEFORE_COMPACTING`]), the index keeps only the live ones: a pass over all
    /// entries, paid for by the releases and renewals that made them, which keeps the index within
    /// about twice the records however many claims are released.
    fn left_stale(&mut self) {
        self.stale += 1;
        if self.stale > self.records.len().max(STALE_BEFORE_COMPACTING) {
            let records = &self.records;
            self.retention.retain(|due| {
                records
                    .find(due.hash, |b| b.hash == due.hash && b.slot.seq == due.seq)
                    .is_some()
            });
            self.stale = 0;
        }
    }

    /// Removes up to `limit` records whose retention ended at or before `now`, oldest first.
    /// Entries of records already removed or renewed are skipped; at most `2 * limit` entries are
    /// looked at, which bounds the time the lock is held.
    fn evict(&mut self, now: Timestamp, limit: usize) -> Evicted {
        let mut records = 0;
        for _ in 0..limit.saturating_mul(2) {
            if records == limit {
                break;
            }
            let Some(Due { seq, hash, .. }) = self.retention.pop_due(now) else {
                return Evicted {
                    records: records as u64,
                    dry: true,
                };
            };
            match self
                .records
                .find_entry(hash, |b| b.hash == hash && b.slot.seq == seq)
            {
                Ok(bucket) => {
                    bucket.remove();
                    records += 1;
                }
                Err(_) => self.stale = self.stale.saturating_sub(1),
            }
        }
        Evicted {
            records: records as u64,
            dry: false,
        }
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store of `shards` shards (the tests that follow one shard's eviction use one).
    fn with_shards(shards: usize) -> Self {
        Self {
            shards: (0..shards.max(1)).map(|_| Shard::default()).collect(),
            hasher: RandomState::new(),
            waiters: Waiters::default(),
        }
    }

    /// How many records are held, including tombstones not yet evicted. The shards are counted one
    /// after another, so under concurrent claims the sum is not a snapshot of one instant.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).records.len()).sum()
    }

    /// Whether no record is held (as [`len`](Self::len), shard after shard).
    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| lock(s).records.is_empty())
    }

    /// How many keys have waiting duplicates (for tests).
    #[cfg(test)]
    pub(crate) fn waiting_keys(&self) -> usize {
        self.waiters.waiting_keys()
    }

    fn hash(&self, key: &RecordKey) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The locked shard of the key with this hash. Bits 40 to 43 of the hash choose it: the table
    /// inside uses the low bits for the bucket and the top seven as its tag.
    fn shard(&self, hash: u64) -> MutexGuard<'_, Inner> {
        lock(&self.shards[(hash >> 40) as usize % self.shards.len()])
    }
}

fn lock(shard: &Shard) -> MutexGuard<'_, Inner> {
    // A panic while holding the lock cannot leave a half-written record: nothing that can panic runs
    // between the writes to one slot, or between a table change and its retention-index change
    // (only allocation, which aborts rather than panics). So the data is consistent and the poison
    // can be ignored.
    shard.0.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemoryStore {
    /// [`Store::claim`]: one critical section, which never waits for anything but the shard's lock.
    fn claim_here(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let hash = self.hash(claim.key);
        let fresh = Head::of(&Record::new_claim(claim));
        let mut guard = self.shard(hash);
        guard.evict(claim.now, EVICT_PER_CLAIM);
        let seq = guard.next_seq();
        let Inner {
            records, retention, ..
        } = &mut *guard;
        let due = Due {
            retain_until: fresh.retain_until,
            seq,
            hash,
        };
        let same_key = |b: &Bucket| b.hash == hash && b.slot.is(claim.key);
        let mut renewed = false;
        let taken_over = match records.entry(hash, same_key, |b| b.hash) {
            Entry::Occupied(mut entry) => {
                let slot = &mut *entry.get_mut().slot;
                let current = slot.head.view();
                if !current.is_forgotten(claim.now) {
                    if !current.can_take_over(claim) {
                        return slot.record().map(ClaimOutcome::Existing);
                    }
                    slot.head.token = claim.token;
                    slot.head.state = HeadState::InFlight {
                        lease_until: claim.lease_until,
                    };
                    true
                } else {
                    // A record past retention counts as absent: a new record takes its slot (and
                    // the old entry in the retention index no longer matches its sequence number).
                    retention.push(claim.now, due);
                    slot.renew(seq, fresh);
                    renewed = true;
                    false
                }
            }
            Entry::Vacant(entry) => {
                retention.push(claim.now, due);
                entry.insert(Bucket {
                    hash,
                    slot: Slot::new(seq, claim.key, fresh),
                });
                false
            }
        };
        if renewed {
            guard.left_stale();
        }
        Ok(ClaimOutcome::Claimed { taken_over })
    }

    /// [`Store::complete`], as [`claim_here`](Self::claim_here) is `claim`.
    fn complete_here(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        // A short record is cut from a block under the lock, where the shard's blocks are; a long
        // one (the body may be tens of KiB) is packed outside it, alone. The old bytes are dropped
        // outside it too.
        let len = packed_len(key, Some(response));
        let alone = (len > BLOCK_RECORD_MAX).then(|| pack(key, Some(response)));
        let hash = self.hash(key);
        let replaced = {
            let mut guard = self.shard(hash);
            let Inner {
                records, blocks, ..
            } = &mut *guard;
            let slot = match records.find_mut(hash, |b| b.hash == hash && b.slot.is(key)) {
                Some(bucket) if bucket.slot.head.in_flight_under(token) => &mut bucket.slot,
                _ => return Err(StoreError::fenced()),
            };
            let packed = alone
                .or_else(|| {
                    blocks.cut(slot.head.retention_length(), len, |block| {
                        pack_into(block, key, Some(response))
                    })
                })
                .unwrap_or_else(|| pack(key, Some(response)));
            slot.complete(packed, response.status)
        };
        drop(replaced);
        self.waiters.notify(key);
        Ok(())
    }
}

/// Every operation is a short critical section that waits for nothing else, so the engine's calls
/// come through [`claim_now`](Store::claim_now) and [`complete_now`](Store::complete_now), not
/// the boxed futures of `claim` and `complete`.
#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.claim_here(claim)
    }

    fn claim_now(&self, claim: &Claim<'_>) -> Option<Result<ClaimOutcome, StoreError>> {
        Some(self.claim_here(claim))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.complete_here(key, token, response)
    }

    fn complete_now(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Option<Result<(), StoreError>> {
        Some(self.complete_here(key, token, response))
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let hash = self.hash(key);
        {
            let mut inner = self.shard(hash);
            match inner.find(hash, key) {
                Some(slot) if slot.head.in_flight_under(token) => inner.remove(hash, key),
                _ => return Err(StoreError::fenced()),
            }
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let hash = self.hash(key);
        self.shard(hash)
            .find(hash, key)
            .filter(|slot| !slot.head.view().is_forgotten(now))
            .map(Slot::record)
            .transpose()
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.subscribe(key)
    }
}

#[async_trait::async_trait]
impl Purge for MemoryStore {
    /// Shard after shard; within a shard, critical sections that each look at up to twice the
    /// records still wanted (entries of released or renewed records are skipped), until the shard
    /// has nothing due. Fewer than `batch` records means nothing due is left.
    async fn purge_expired(&self, now: Timestamp, batch: usize) -> Result<u64, StoreError> {
        // Each shard until it has nothing due, one short critical section at a time, so that a
        // batch comes back short only when nothing due is left (the sweeper stops on a short one).
        let mut purged = 0;
        for shard in self.shards.iter() {
            loop {
                let left = batch.saturating_sub(purged as usize);
                if left == 0 {
                    return Ok(purged);
                }
                let evicted = lock(shard).evict(now, left);
                purged += evicted.records;
                if evicted.dry {
                    break;
                }
            }
        }
        Ok(purged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use http::header::{CONTENT_TYPE, LOCATION};

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    /// The record `store` holds for `key` at `ms`; the test fails if there is none.
    async fn held(store: &MemoryStore, key: &RecordKey, ms: i64) -> Record {
        let found = store
            .get(key, at(ms))
            .await
            .expect("the memory store never fails");
        found.unwrap_or_else(|| panic!("no record for {key:?} at {ms}"))
    }

    fn claim<'a>(key: &'a RecordKey, token: i64, now: i64, retain: i64) -> Claim<'a> {
        Claim {
            key,
            fingerprint: Fingerprint::of_request("POST", "/x", None, b"x"),
            token: FencingToken(token),
            now: at(now),
            lease_until: at(now + 5),
            expires_at: at(now + retain),
            retain_until: at(now + retain),
        }
    }

    #[tokio::test]
    async fn records_spread_over_the_shards_and_purge_drains_every_shard_in_batches() {
        let store = MemoryStore::new();
        let keys: Vec<RecordKey> = (0..200)
            .map(|i| RecordKey::new("s", format!("k{i}")))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            store.claim(&claim(key, i as i64, 0, 10)).await.unwrap();
        }
        let used = store
            .shards
            .iter()
            .filter(|s| !lock(s).records.is_empty())
            .count();
        assert!(
            used > SHARDS / 2,
            "200 keys over {SHARDS} shards used only {used}"
        );
        assert_eq!(store.len(), 200);
        // Nothing is due before retention ends; then batches of 64 across shards, the last short.
        assert_eq!(store.purge_expired(at(9), 64).await.unwrap(), 0);
        let mut batches = Vec::new();
        for _ in 0..5 {
            batches.push(store.purge_expired(at(10), 64).await.unwrap());
        }
        assert_eq!(batches, [64, 64, 64, 8, 0]);
        assert!(store.is_empty());
        for key in &keys {
            assert!(store.get(key, at(10)).await.unwrap().is_none());
        }
    }

    #[tokio::test]
    async fn eviction_removes_only_the_records_whose_retention_ended() {
        let store = MemoryStore::with_shards(1);
        let a = RecordKey::new("s", "a");
        let others: Vec<RecordKey> = (0..10)
            .map(|i| RecordKey::new("t", format!("{i}")))
            .collect();
        for (i, key) in others.iter().enumerate() {
            let outcome = store.claim(&claim(key, i as i64, 0, 5)).await.unwrap();
            assert_eq!(outcome, ClaimOutcome::Claimed { taken_over: false });
        }
        store.claim(&claim(&a, 100, 0, 10)).await.unwrap();
        // At 20 everything is past retention. The claim evicts the 8 oldest records first (not `a`,
        // whose retention ends last), then finds `a` forgotten: a new record takes its slot, and the
        // old record's retention entry must not evict the new one later.
        let outcome = store.claim(&claim(&a, 4, 20, 100)).await.unwrap();
        assert_eq!(outcome, ClaimOutcome::Claimed { taken_over: false });
        assert_eq!(store.len(), 3);
        assert_eq!(store.purge_expired(at(25), 10).await.unwrap(), 2);
        assert_eq!(store.len(), 1);
        let kept = held(&store, &a, 25).await;
        assert_eq!(kept.token, FencingToken(4));
        assert!(store.get(&others[9], at(25)).await.unwrap().is_none());
        // Completing finds the record by key and token; a completed record cannot be released.
        let response = StoredResponse {
            status: 201,
            headers: vec![(LOCATION, HeaderValue::from_static("/a"))],
            body: "done".into(),
        };
        store
            .complete(&a, FencingToken(4), &response)
            .await
            .unwrap();
        assert!(matches!(
            store.get(&a, at(26)).await.unwrap().map(|r| r.state),
            Some(RecordState::Completed { response: stored }) if stored == response
        ));
        let fenced = store.release(&a, FencingToken(4)).await.unwrap_err();
        assert_eq!(fenced.kind(), crate::store::StoreErrorKind::Fenced);
        assert_eq!(store.purge_expired(at(1_000), 10).await.unwrap(), 1);
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn a_purge_reaches_past_entries_of_released_records_and_those_entries_are_compacted() {
        let store = MemoryStore::with_shards(1);
        // Twenty released claims, due first, then one live record.
        for i in 0..20 {
            let key = RecordKey::new("s", format!("gone-{i}"));
            store.claim(&claim(&key, i, 0, 10)).await.unwrap();
            store.release(&key, FencingToken(i)).await.unwrap();
        }
        let live = RecordKey::new("s", "live");
        store.claim(&claim(&live, 99, 1, 10)).await.unwrap();
        // One call looks past all twenty (in critical sections of at most 2 * 8 entries) and
        // returns the live record: a short batch still means nothing due is left.
        assert_eq!(store.purge_expired(at(20), 8).await.unwrap(), 1);
        assert!(store.is_empty());
        assert_eq!(store.shard(0).retention.len(), 0);

        // Released claims' entries do not pile up: once they outnumber the records (and the
        // threshold), the index keeps only the live ones.
        let kept = RecordKey::new("s", "kept");
        store.claim(&claim(&kept, 1, 0, 1_000)).await.unwrap();
        let released = STALE_BEFORE_COMPACTING as i64 * 3;
        for i in 0..released {
            let key = RecordKey::new("s", format!("again-{i}"));
            store.claim(&claim(&key, i, 0, 1_000)).await.unwrap();
            store.release(&key, FencingToken(i)).await.unwrap();
        }
        let entries = store.shard(0).retention.len();
        assert!(
            entries <= STALE_BEFORE_COMPACTING + 2,
            "{entries} index entries for 1 record after {released} releases"
        );
        assert_eq!(store.purge_expired(at(1_000), 10).await.unwrap(), 1);
        assert!(store.get(&kept, at(999)).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn a_record_too_long_for_a_block_replays_as_one_cut_from_a_block_does() {
        let store = MemoryStore::with_shards(1);
        let response = |len: usize| StoredResponse {
            status: 201,
            headers: vec![(LOCATION, HeaderValue::from_static("/payments/1"))],
            body: (0..len)
                .map(|i| (i % 251) as u8)
                .collect::<Vec<u8>>()
                .into(),
        };
        let short = RecordKey::new("s", "short");
        let long = RecordKey::new("s", "long");
        let (short_response, long_response) = (response(16), response(BLOCK_RECORD_MAX + 1));
        for (key, stored) in [(&short, &short_response), (&long, &long_response)] {
            store.claim(&claim(key, 1, 0, 100)).await.unwrap();
            store.complete(key, FencingToken(1), stored).await.unwrap();
        }
        for (key, stored) in [(&short, short_response), (&long, long_response)] {
            match store.get(key, at(1)).await.unwrap().map(|r| r.state) {
                Some(RecordState::Completed { response }) => assert_eq!(response, stored),
                other => panic!("expected {key:?} completed, got {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_record_packs_and_unpacks_its_key_and_response() {
        let store = MemoryStore::with_shards(1);
        // The same bytes split differently between scope and key are two records. (Their hashes
        // differ too, so the slots' own comparison is checked directly.)
        let a = RecordKey::new("ab", "c");
        let b = RecordKey::new("a", "bc");
        let slot = Slot::new(0, &a, Head::of(&Record::new_claim(&claim(&a, 1, 0, 100))));
        assert!(slot.is(&a) && !slot.is(&b));
        // Eight records whose retention ends first, so that a later claim's eviction (at most
        // EVICT_PER_CLAIM) stops before `a` and the claim finds `a` forgotten, in its slot.
        for i in 0..EVICT_PER_CLAIM {
            let filler = RecordKey::new("fill", format!("{i}"));
            store.claim(&claim(&filler, 9, 0, 50)).await.unwrap();
        }
        for key in [&a, &b] {
            let outcome = store.claim(&claim(key, 1, 0, 100)).await.unwrap();
            assert_eq!(outcome, ClaimOutcome::Claimed { taken_over: false });
        }
        let response = StoredResponse {
            status: 201,
            headers: vec![
                // Not visible ASCII (obs-text): kept byte for byte all the same.
                (
                    LOCATION,
                    HeaderValue::from_bytes("/payments/\u{e9}t\u{e9}".as_bytes()).expect("a value"),
                ),
                (
                    HeaderName::from_static("x-empty"),
                    HeaderValue::from_static(""),
                ),
                (CONTENT_TYPE, HeaderValue::from_static("application/json")),
            ],
            body: vec![0, 1, 255, b'{'].into(),
        };
        store
            .complete(&a, FencingToken(1), &response)
            .await
            .unwrap();
        let completed = |r: Option<Record>| match r.map(|r| r.state) {
            Some(RecordState::Completed { response }) => Some(response),
            _ => None,
        };
        assert_eq!(
            completed(store.get(&a, at(1)).await.unwrap()),
            Some(response.clone())
        );
        assert_eq!(completed(store.get(&b, at(1)).await.unwrap()), None);
        // A replay's claim finds the same response.
        match store.claim(&claim(&a, 2, 1, 100)).await.unwrap() {
            ClaimOutcome::Existing(record) => {
                assert_eq!(completed(Some(record)), Some(response.clone()))
            }
            other => panic!("expected the completed record, got {other:?}"),
        }
        // No headers and no body round-trip too.
        let bare = StoredResponse {
            status: 204,
            headers: Vec::new(),
            body: Bytes::new(),
        };
        store.complete(&b, FencingToken(1), &bare).await.unwrap();
        assert_eq!(completed(store.get(&b, at(1)).await.unwrap()), Some(bare));
        // Past retention the slot is renewed in flight: the old response is gone, the key kept.
        let outcome = store.claim(&claim(&a, 3, 200, 100)).await.unwrap();
        assert_eq!(outcome, ClaimOutcome::Claimed { taken_over: false });
        {
            let inner = store.shard(store.hash(&a));
            let slot = inner.find(store.hash(&a), &a).expect("a's slot");
            assert_eq!(&slot.bytes[..], b"abc", "the old response's bytes are gone");
            // `b`, evicted after `a` (same retention, later sequence), is still there: the
            // eviction stopped before `a`, so `a` was renewed in its slot, not inserted anew.
            assert!(inner.find(store.hash(&b), &b).is_some());
            assert_eq!(inner.records.len(), 2);
        }
        let renewed = held(&store, &a, 200).await;
        assert_eq!(renewed.token, FencingToken(3));
        assert!(matches!(renewed.state, RecordState::InFlight { .. }));
        let fresh = StoredResponse {
            status: 200,
            headers: vec![(LOCATION, HeaderValue::from_static("/b"))],
            body: "second".into(),
        };
        store.complete(&a, FencingToken(3), &fresh).await.unwrap();
        assert_eq!(
            completed(store.get(&a, at(201)).await.unwrap()),
            Some(fresh)
        );
    }
}
