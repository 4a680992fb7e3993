//! The in-memory store: for tests and single-process services.
//!
//! Every operation is one critical section under one mutex, which makes the claim trivially atomic.
//! The mutex comes from `crate::sync`, so `tests/loom.rs` checks claim, complete and release under
//! every interleaving.
//! Memory stays bounded by the live records: each claim evicts a few records past retention (oldest
//! first, through an index ordered by `retain_until`), and [`Purge`] evicts in batches.
//! Nothing survives a restart, and a second process never sees these records: use SQLite,
//! PostgreSQL or Redis for that.
//!
//! # Layout
//! Records live in a hash table of 16-byte buckets (the key's hash and a boxed slot holding the key,
//! once, the record and a sequence number). Keys are client-controlled, so the hash is the standard
//! library's keyed SipHash, computed once per operation and kept in the bucket for the table's own
//! resizing. The retention index maps `(retain_until, sequence)` to that hash: eviction finds its
//! slot by hash and sequence, so the index holds no copy of the key and compares integers only.

use super::{Claim, ClaimOutcome, Purge, Store, StoreError, Subscription, Waiters};
use crate::clock::Timestamp;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use crate::sync::{Mutex, MutexGuard};
use hashbrown::hash_table::{Entry, HashTable};
use std::collections::hash_map::RandomState;
use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::PoisonError;

/// How many records past retention one claim evicts at most (keeps each critical section short).
const EVICT_PER_CLAIM: usize = 8;

/// An in-memory [`Store`].
///
/// ```
/// use idem_runtime::{Engine, store::memory::MemoryStore};
/// let engine = Engine::new(MemoryStore::new());
/// # let _ = engine;
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    inner: Mutex<Inner>,
    waiters: Waiters,
}

#[derive(Debug, Default)]
struct Inner {
    records: HashTable<Bucket>,
    /// `(retain_until, seq)` → the hash of the slot with that `seq`.
    by_retention: BTreeMap<(Timestamp, u64), u64>,
    next_seq: u64,
    hasher: RandomState,
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
    key: RecordKey,
    record: Record,
}

impl Inner {
    fn hash(&self, key: &RecordKey) -> u64 {
        self.hasher.hash_one(key)
    }

    fn find(&self, key: &RecordKey) -> Option<&Record> {
        let hash = self.hash(key);
        self.records
            .find(hash, |b| b.hash == hash && b.slot.key == *key)
            .map(|b| &b.slot.record)
    }

    fn find_mut(&mut self, key: &RecordKey) -> Option<&mut Record> {
        let hash = self.hash(key);
        self.records
            .find_mut(hash, |b| b.hash == hash && b.slot.key == *key)
            .map(|b| &mut b.slot.record)
    }

    fn next_seq(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    fn remove(&mut self, key: &RecordKey) {
        let hash = self.hash(key);
        if let Ok(entry) = self
            .records
            .find_entry(hash, |b| b.hash == hash && b.slot.key == *key)
        {
            let (Bucket { slot, .. }, _) = entry.remove();
            self.by_retention
                .remove(&(slot.record.retain_until, slot.seq));
        }
    }

    fn evict(&mut self, now: Timestamp, limit: usize) -> u64 {
        let mut evicted = 0;
        while evicted < limit {
            let Some(entry) = self.by_retention.first_entry() else {
                break;
            };
            let &(retain_until, seq) = entry.key();
            if retain_until > now {
                break;
            }
            let hash = entry.remove();
            if let Ok(bucket) = self
                .records
                .find_entry(hash, |b| b.hash == hash && b.slot.seq == seq)
            {
                bucket.remove();
            }
            evicted += 1;
        }
        evicted as u64
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records are held, including tombstones not yet evicted.
    pub fn len(&self) -> usize {
        self.lock().records.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many keys have waiting duplicates (for tests).
    #[cfg(test)]
    pub(crate) fn waiting_keys(&self) -> usize {
        self.waiters.waiting_keys()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a half-written record: a record is written by
        // one assignment or one table insert, and the only thing between a table change and its
        // retention-index change is allocation, which aborts rather than panics. So the data is
        // consistent and the poison can be ignored.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let mut guard = self.lock();
        guard.evict(claim.now, EVICT_PER_CLAIM);
        let hash = guard.hash(claim.key);
        let seq = guard.next_seq();
        let Inner {
            records,
            by_retention,
            ..
        } = &mut *guard;
        let fresh = Record::new_claim(claim);
        let same_key = |b: &Bucket| b.hash == hash && b.slot.key == *claim.key;
        let taken_over = match records.entry(hash, same_key, |b| b.hash) {
            Entry::Occupied(mut entry) => {
                let slot = &mut *entry.get_mut().slot;
                let record = &mut slot.record;
                if !record.is_forgotten(claim.now) {
                    if !record.can_take_over(claim) {
                        return Ok(ClaimOutcome::Existing(record.clone()));
                    }
                    record.token = claim.token;
                    record.state = RecordState::InFlight {
                        lease_until: claim.lease_until,
                    };
                    true
                } else {
                    // A record past retention counts as absent: a new record takes its slot.
                    by_retention.remove(&(record.retain_until, slot.seq));
                    by_retention.insert((fresh.retain_until, seq), hash);
                    slot.seq = seq;
                    slot.record = fresh;
                    false
                }
            }
            Entry::Vacant(entry) => {
                by_retention.insert((fresh.retain_until, seq), hash);
                entry.insert(Bucket {
                    hash,
                    slot: Box::new(Slot {
                        seq,
                        key: claim.key.clone(),
                        record: fresh,
                    }),
                });
                false
            }
        };
        Ok(ClaimOutcome::Claimed { taken_over })
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.complete_owned(key, token, response.clone()).await
    }

    async fn complete_owned(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<(), StoreError> {
        {
            let mut inner = self.lock();
            match inner.find_mut(key) {
                Some(r) if r.token == token && matches!(r.state, RecordState::InFlight { .. }) => {
                    r.state = RecordState::Completed { response };
                }
                _ => return Err(StoreError::fenced()),
            }
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        {
            let mut inner = self.lock();
            match inner.find(key) {
                Some(r) if r.token == token && matches!(r.state, RecordState::InFlight { .. }) => {
                    inner.remove(key);
                }
                _ => return Err(StoreError::fenced()),
            }
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        Ok(self
            .lock()
            .find(key)
            .filter(|r| !r.is_forgotten(now))
            .cloned())
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.subscribe(key)
    }
}

#[async_trait::async_trait]
impl Purge for MemoryStore {
    async fn purge_expired(&self, now: Timestamp, batch: usize) -> Result<u64, StoreError> {
        Ok(self.lock().evict(now, batch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
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
    async fn eviction_removes_only_the_records_whose_retention_ended() {
        let store = MemoryStore::new();
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
        let kept = store
            .get(&a, at(25))
            .await
            .unwrap()
            .expect("the new record stays");
        assert_eq!(kept.token, FencingToken(4));
        assert!(store.get(&others[9], at(25)).await.unwrap().is_none());
        // Completing and releasing find the record by key and token, and release frees its slot.
        let response = StoredResponse {
            status: 201,
            headers: vec![("location".into(), "/a".into())],
            body: "done".into(),
        };
        store
            .complete_owned(&a, FencingToken(4), response.clone())
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
}
