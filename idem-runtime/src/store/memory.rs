//! The in-memory store: for tests and single-process services.
//!
//! Every operation is one critical section under one mutex, which makes the claim trivially atomic.
//! The mutex comes from `crate::sync`, so `tests/loom.rs` checks claim, complete and release under
//! every interleaving.
//! Memory stays bounded by the live records: each claim evicts a few records past retention (oldest
//! first, through an index ordered by `retain_until`), and [`Purge`] evicts in batches.
//! Nothing survives a restart, and a second process never sees these records: use SQLite,
//! PostgreSQL or Redis for that.

use super::{Claim, ClaimOutcome, Purge, Store, StoreError, Subscription, Waiters};
use crate::clock::Timestamp;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use crate::sync::{Mutex, MutexGuard};
use std::collections::{BTreeSet, HashMap};
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
    records: HashMap<RecordKey, Record>,
    by_retention: BTreeSet<(Timestamp, RecordKey)>,
}

impl Inner {
    fn insert(&mut self, key: &RecordKey, record: Record) {
        self.by_retention.insert((record.retain_until, key.clone()));
        if let Some(old) = self.records.insert(key.clone(), record) {
            self.by_retention.remove(&(old.retain_until, key.clone()));
        }
    }

    fn remove(&mut self, key: &RecordKey) {
        if let Some(old) = self.records.remove(key) {
            self.by_retention.remove(&(old.retain_until, key.clone()));
        }
    }

    fn evict(&mut self, now: Timestamp, limit: usize) -> u64 {
        let mut evicted = 0;
        while evicted < limit {
            match self.by_retention.first() {
                Some((retain_until, _)) if *retain_until <= now => {}
                _ => break,
            }
            if let Some((_, key)) = self.by_retention.pop_first() {
                self.records.remove(&key);
                evicted += 1;
            }
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
        // A panic while holding the lock cannot leave a half-written record: every mutation is a
        // single insert or remove, so the data is consistent and the poison can be ignored.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let mut inner = self.lock();
        inner.evict(claim.now, EVICT_PER_CLAIM);
        let taken_over = match inner.records.get_mut(claim.key) {
            Some(record) if !record.is_forgotten(claim.now) => {
                if !record.can_take_over(claim) {
                    return Ok(ClaimOutcome::Existing(record.clone()));
                }
                record.token = claim.token;
                record.state = RecordState::InFlight {
                    lease_until: claim.lease_until,
                };
                true
            }
            _ => {
                inner.insert(claim.key, Record::new_claim(claim));
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
        {
            let mut inner = self.lock();
            match inner.records.get_mut(key) {
                Some(r) if r.token == token && matches!(r.state, RecordState::InFlight { .. }) => {
                    r.state = RecordState::Completed {
                        response: response.clone(),
                    };
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
            match inner.records.get(key) {
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
            .records
            .get(key)
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
