//! The in-memory store: for tests and single-process services.
//!
//! One mutex over a map of records and an index of them by `retain_until`: every operation on a
//! key is one critical section, which makes the claim trivially atomic. The mutex comes from
//! `crate::sync`, so `tests/loom.rs` checks claim, complete and release under every interleaving.
//! Memory stays bounded by the live records: each claim evicts a few records past retention
//! (oldest first), and [`Purge`] evicts in batches. Nothing survives a restart, and a second
//! process never sees these records: use SQLite, PostgreSQL or Redis for that.

use super::{
    Claim, ClaimOutcome, ClaimRule, Found, Listed, Purge, StateKind, Stats, Store, StoreError,
    Subscription, Waiters,
};
use crate::clock::{Clock, SystemClock, Timestamp};
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use crate::sync::{Mutex, MutexGuard};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, PoisonError};
use std::time::Duration;

/// How many records past retention one claim evicts at most (keeps each critical section short).
const EVICT_PER_CLAIM: usize = 8;

/// An in-memory [`Store`].
///
/// ```
/// use idem_runtime::{Engine, store::memory::MemoryStore};
/// let engine = Engine::new(MemoryStore::new());
/// # let _ = engine;
/// ```
pub struct MemoryStore {
    records: Mutex<Records>,
    waiters: Waiters,
    /// The store's time: this process's clock (see "Time is the store's" in [`crate::store`]).
    clock: Arc<dyn Clock>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self {
            records: Mutex::default(),
            waiters: Waiters::default(),
            clock: Arc::new(SystemClock),
        }
    }
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("records", &self.lock().by_key.len())
            .finish_non_exhaustive()
    }
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
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::default()
    }

    /// Judges every time by `clock` instead of the system clock (tests move a
    /// [`ManualClock`](crate::clock::ManualClock) to expire keys and leases).
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
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
        let now = self.clock.now();
        let mut records = self.lock();
        records.evict(now, EVICT_PER_CLAIM);
        let record = records.by_key.get_mut(claim.key);
        match (claim.decide(record.as_deref(), now), record) {
            // Taken over, resumed or kept: the record's `retain_until`, and so its place in the
            // retention index, stays.
            (rule, Some(record)) if rule != ClaimRule::Insert => Ok(claim.apply(rule, record, now)),
            _ => {
                let mut fresh = claim.record(now);
                let outcome = claim.apply(ClaimRule::Insert, &mut fresh, now);
                records.insert(claim.key, fresh);
                Ok(outcome)
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
            let record = records
                .in_flight_under(key, token)
                .ok_or_else(StoreError::fenced)?;
            record.state = RecordState::Released;
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut records = self.lock();
        let record = records
            .in_flight_under(key, token)
            .ok_or_else(StoreError::fenced)?;
        record.state = RecordState::InFlight {
            lease_until: now + lease,
        };
        Ok(())
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        let now = self.clock.now();
        Ok(self
            .lock()
            .by_key
            .get(key)
            .filter(|r| !r.is_forgotten(now))
            .map(|record| Found {
                record: record.clone(),
                now,
            }))
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.subscribe(key)
    }

    async fn forget(
        &self,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        {
            let mut records = self.lock();
            let seen = records
                .by_key
                .get(key)
                .is_some_and(|r| r.token == token && StateKind::of(&r.state) == state);
            if !seen {
                return Ok(false);
            }
            records.remove(key);
        }
        self.waiters.notify(key);
        Ok(true)
    }

    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        let erased: Vec<RecordKey> = {
            let mut records = self.lock();
            let keys: Vec<RecordKey> = records
                .by_key
                .keys()
                .filter(|key| key.scope() == scope)
                .take(batch)
                .cloned()
                .collect();
            for key in &keys {
                records.remove(key);
            }
            keys
        };
        for key in &erased {
            self.waiters.notify(key);
        }
        Ok(erased.len() as u64)
    }

    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        let now = self.clock.now();
        let mut listed: Vec<Listed> = self
            .lock()
            .by_key
            .iter()
            .filter(|(_, r)| {
                matches!(r.state, RecordState::InFlight { .. })
                    && !r.is_forgotten(now)
                    && r.created_at.until(now) >= older_than
            })
            .map(|(key, record)| Listed {
                key: key.clone(),
                record: record.clone(),
            })
            .collect();
        listed.sort_by_key(|l| (l.record.created_at, l.key.clone()));
        listed.truncate(limit);
        Ok((listed, now))
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let now = self.clock.now();
        let records = self.lock();
        Ok(Stats::count(records.by_key.values(), now))
    }
}

#[async_trait::async_trait]
impl Purge for MemoryStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let now = self.clock.now();
        Ok(self.lock().evict(now, batch) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::fingerprint::Fingerprint;
    use crate::store::Claimed;

    fn ms(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    /// A claim with a 10 ms lease whose record is retained (and expires) after `retain` ms.
    fn claim(key: &RecordKey, token: i64, retain: u64) -> Claim<'_> {
        Claim {
            key,
            fingerprint: Fingerprint([7; 32]),
            token: FencingToken(token),
            lease: ms(10),
            ttl: ms(retain),
            retain: ms(retain),
        }
    }

    fn store() -> (MemoryStore, ManualClock) {
        let clock = ManualClock::new(Timestamp::from_millis(0));
        (MemoryStore::new().with_clock(clock.clone()), clock)
    }

    #[tokio::test]
    async fn purge_removes_only_records_past_retention_in_batches() {
        let (store, clock) = store();
        let keys: Vec<RecordKey> = (0..10)
            .map(|i| RecordKey::new("s", i.to_string()))
            .collect();
        for (i, key) in keys.iter().enumerate() {
            // Keys 0..5 are retained until 100, keys 5..10 until 1000.
            let retain = if i < 5 { 100 } else { 1000 };
            store.claim(&claim(key, 1, retain)).await.expect("claim");
        }
        clock.advance(ms(100));
        assert_eq!(store.purge_expired(3).await.expect("purge"), 3);
        assert_eq!(store.purge_expired(3).await.expect("purge"), 2);
        assert_eq!(store.purge_expired(3).await.expect("purge"), 0);
        assert_eq!(store.len(), 5);
        for key in &keys[5..] {
            assert!(store.get(key).await.expect("get").is_some());
        }
    }

    #[tokio::test]
    async fn a_claim_evicts_a_few_records_past_retention() {
        let (store, clock) = store();
        let old: Vec<RecordKey> = (0..20)
            .map(|i| RecordKey::new("s", i.to_string()))
            .collect();
        for key in &old {
            store.claim(&claim(key, 1, 100)).await.expect("claim");
        }
        clock.advance(ms(200));
        let fresh = RecordKey::new("s", "fresh");
        store.claim(&claim(&fresh, 1, 1000)).await.expect("claim");
        assert_eq!(store.len(), 21 - EVICT_PER_CLAIM);
    }

    #[tokio::test]
    async fn a_takeover_keeps_the_record_in_the_retention_index_once() {
        let (store, clock) = store();
        let key = RecordKey::new("s", "k");
        store.claim(&claim(&key, 1, 100)).await.expect("claim");
        // The lease ran out at 10: a second claim takes over, keeping `retain_until`.
        clock.advance(ms(50));
        let outcome = store.claim(&claim(&key, 2, 500)).await.expect("claim");
        assert!(matches!(
            outcome,
            ClaimOutcome::Claimed(Claimed {
                taken_over: true,
                ..
            })
        ));
        store
            .renew(&key, FencingToken(2), ms(40))
            .await
            .expect("renewed by the new holder");
        assert!(store.renew(&key, FencingToken(1), ms(40)).await.is_err());
        clock.advance(ms(50));
        assert_eq!(store.purge_expired(10).await.expect("purge"), 1);
        assert!(store.is_empty());
        assert!(store.lock().by_retention.is_empty());
    }

    #[tokio::test]
    async fn a_released_record_resumes_for_its_request_and_is_replaced_for_another() {
        let (store, clock) = store();
        let key = RecordKey::new("s", "k");
        let first = store.claim(&claim(&key, 1, 100)).await.expect("claim");
        store.release(&key, FencingToken(1)).await.expect("release");
        clock.advance(ms(5));
        // The same request: the same record, claimed again (not a takeover).
        let again = store.claim(&claim(&key, 2, 100)).await.expect("claim");
        let (ClaimOutcome::Claimed(first), ClaimOutcome::Claimed(again)) = (first, again) else {
            panic!("both claims win")
        };
        assert_eq!(
            (again.created_at, again.taken_over),
            (first.created_at, false)
        );
        store.release(&key, FencingToken(2)).await.expect("release");
        // Another request under the key: a new record.
        let other = Claim {
            fingerprint: Fingerprint([8; 32]),
            ..claim(&key, 3, 100)
        };
        let ClaimOutcome::Claimed(other) = store.claim(&other).await.expect("claim") else {
            panic!("another request replaces a released record")
        };
        assert_eq!(other.created_at, Timestamp::from_millis(5));
        assert_eq!(store.lock().by_retention.len(), 1);
    }
}
