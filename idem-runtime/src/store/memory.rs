//! The in-memory store: for tests and single-process services.
//!
//! One mutex over a map of records and an index of them by `retain_until`: every operation on a
//! key is one critical section, which makes the claim trivially atomic. The mutex comes from
//! `crate::sync`, so `tests/loom.rs` checks claim, complete and release under every interleaving.
//! Memory stays bounded by the live records: each claim evicts a few records past retention
//! (oldest first), and [`Purge`] evicts in batches. Nothing survives a restart, and a second
//! process never sees these records: use SQLite, PostgreSQL or Redis for that.

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
    records: Mutex<Records>,
    waiters: Waiters,
}

#[derive(Debug, Default)]
struct Records {
    by_key: HashMap<RecordKey, Record>,
    /// Every record's `(retain_until, key)`, for eviction oldest first.
    by_retention: BTreeSet<(Timestamp, RecordKey)>,
}

impl Records {
    fn insert(&mut self, key: &RecordKey, record: Record) {
        let retain_until = record.retain_until;
        if let Some(old) = self.by_key.insert(key.clone(), record) {
            self.by_retention.remove(&(old.retain_until, key.clone()));
        }
        self.by_retention.insert((retain_until, key.clone()));
    }

    fn remove(&mut self, key: &RecordKey) {
        if let Some(old) = self.by_key.remove(key) {
            self.by_retention.remove(&(old.retain_until, key.clone()));
        }
    }

    /// Removes at most `limit` records past retention at `now`, oldest first; returns how many.
    fn evict(&mut self, now: Timestamp, limit: usize) -> usize {
        let due: Vec<(Timestamp, RecordKey)> = self
            .by_retention
            .iter()
            .take_while(|(retain_until, _)| *retain_until <= now)
            .take(limit)
            .cloned()
            .collect();
        for entry in &due {
            self.by_retention.remove(entry);
            self.by_key.remove(&entry.1);
        }
        due.len()
    }

    /// The record of `key` if it is in flight under `token`.
    fn in_flight_under(&mut self, key: &RecordKey, token: FencingToken) -> Option<&mut Record> {
        self.by_key
            .get_mut(key)
            .filter(|r| r.token == token && matches!(r.state, RecordState::InFlight { .. }))
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many records are held, past retention or not.
    pub fn len(&self) -> usize {
        self.lock().by_key.len()
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many keys have waiting duplicates (for tests that synchronise on a waiter).
    #[cfg(test)]
    pub(crate) fn waiting_keys(&self) -> usize {
        self.waiters.waiting_keys()
    }

    /// Every critical section leaves the maps consistent, so a poisoned lock is still usable.
    fn lock(&self) -> MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    fn kind(&self) -> &'static str {
        "memory"
    }
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let mut records = self.lock();
        records.evict(claim.now, EVICT_PER_CLAIM);
        match records.by_key.get_mut(claim.key) {
            Some(record) if !record.is_forgotten(claim.now) => {
                if !claim.can_take_over(record) {
                    return Ok(ClaimOutcome::Existing(record.clone()));
                }
                record.token = claim.token;
                record.state = RecordState::InFlight {
                    lease_until: claim.lease_until,
                };
                Ok(ClaimOutcome::Claimed { taken_over: true })
            }
            _ => {
                records.insert(claim.key, claim.record());
                Ok(ClaimOutcome::Claimed { taken_over: false })
            }
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        {
            let mut records = self.lock();
            let record = records
                .in_flight_under(key, token)
                .ok_or_else(StoreError::fenced)?;
            record.state = RecordState::Completed {
                response: response.clone(),
            };
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        {
            let mut records = self.lock();
            records
                .in_flight_under(key, token)
                .ok_or_else(StoreError::fenced)?;
            records.remove(key);
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease_until: Timestamp,
    ) -> Result<(), StoreError> {
        let mut records = self.lock();
        let record = records
            .in_flight_under(key, token)
            .ok_or_else(StoreError::fenced)?;
        record.state = RecordState::InFlight { lease_until };
        Ok(())
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        Ok(self
            .lock()
            .by_key
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
        Ok(self.lock().evict(now, batch) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;

    fn at(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn claim(key: &RecordKey, token: i64, now: i64, retain: i64) -> Claim<'_> {
        Claim {
            key,
            fingerprint: Fingerprint([7; 32]),
            token: FencingToken(token),
            now: at(now),
            lease_until: at(now + 10),
            expires_at: at(retain),
            retain_until: at(retain),
        }
    }

    #[tokio::test]
    async fn purge_removes_only_records_past_retention_in_batches() {
        let store = MemoryStore::new();
        let keys: Vec<RecordKey> = (0..10)
            .map(|i| RecordKey::new("s", i.to_string()))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            // Keys 0..5 are retained until 100, keys 5..10 until 1000.
            let retain = if i < 5 { 100 } else { 1000 };
            store.claim(&claim(key, 1, 0, retain)).await.expect("claim");
        }
        assert_eq!(store.purge_expired(at(100), 3).await.expect("purge"), 3);
        assert_eq!(store.purge_expired(at(100), 3).await.expect("purge"), 2);
        assert_eq!(store.purge_expired(at(100), 3).await.expect("purge"), 0);
        assert_eq!(store.len(), 5);
        for key in &keys[5..] {
            assert!(store.get(key, at(100)).await.expect("get").is_some());
        }
    }

    #[tokio::test]
    async fn a_claim_evicts_a_few_records_past_retention() {
        let store = MemoryStore::new();
        let old: Vec<RecordKey> = (0..20)
            .map(|i| RecordKey::new("s", i.to_string()))
            .collect();
        for key in &old {
            store.claim(&claim(key, 1, 0, 100)).await.expect("claim");
        }
        let fresh = RecordKey::new("s", "fresh");
        store
            .claim(&claim(&fresh, 1, 200, 1000))
            .await
            .expect("claim");
        assert_eq!(store.len(), 21 - EVICT_PER_CLAIM);
    }

    #[tokio::test]
    async fn a_takeover_keeps_the_record_in_the_retention_index_once() {
        let store = MemoryStore::new();
        let key = RecordKey::new("s", "k");
        store.claim(&claim(&key, 1, 0, 100)).await.expect("claim");
        // The lease ran out at 10: a second claim takes over, keeping `retain_until`.
        let outcome = store.claim(&claim(&key, 2, 50, 500)).await.expect("claim");
        assert_eq!(outcome, ClaimOutcome::Claimed { taken_over: true });
        store
            .renew(&key, FencingToken(2), at(90))
            .await
            .expect("renewed by the new holder");
        assert!(store.renew(&key, FencingToken(1), at(90)).await.is_err());
        assert_eq!(store.purge_expired(at(100), 10).await.expect("purge"), 1);
        assert!(store.is_empty());
        assert!(store.lock().by_retention.is_empty());
    }
}
