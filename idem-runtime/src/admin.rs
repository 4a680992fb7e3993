//! Operations for operators: see one record, forget it, erase everything a caller left, list the
//! claims that stay in flight, count what the store holds. They work on every built-in store and
//! never need the store's layout: callers name records by (scope, key) as the application gave
//! them, and long parts are bounded the way the engine bounds them ([`RecordKey`]).
//!
//! ```
//! use idem_runtime::admin::Forgettable;
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::{Begin, Engine, Fingerprint, Policy, RecordKey, StoredResponse};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::new(MemoryStore::new());
//! let fp = Fingerprint::of_request("POST", "/orders", None, b"two apples");
//! if let Ok(Begin::Execute(claim)) = engine.begin(RecordKey::new("user-7", "order-42"), fp, &Policy::new()).await {
//!     claim.complete(&StoredResponse { status: 201, headers: vec![], body: "created".into() }).await?;
//! }
//! let seen = engine.inspect("user-7", "order-42").await?.expect("the record");
//! assert_eq!(seen.state().as_str(), "completed");
//! // Let the key run again (after fixing what made its response wrong, say).
//! engine.forget("user-7", "order-42", Forgettable::Done).await?;
//! assert!(engine.inspect("user-7", "order-42").await?.is_none());
//! # Ok(()) }
//! ```

use crate::clock::Timestamp;
use crate::engine::Engine;
use crate::record::{Record, RecordKey, RecordState};
use crate::store::{Listed, StateKind, Stats, StoreError};
use std::time::Duration;

/// How many records one statement of [`Engine::erase`] deletes.
const ERASE_BATCH: usize = 1_000;

/// One record as [`Engine::inspect`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inspection {
    /// The record's key as stored.
    pub key: RecordKey,
    /// The record.
    pub record: Record,
    /// The store's time of the read: what "expired" and "lease live" are judged against.
    pub now: Timestamp,
}

impl Inspection {
    /// The record's state, without its contents.
    pub fn state(&self) -> StateKind {
        StateKind::of(&self.record.state)
    }

    /// Whether the record is past its expiry (answering 410).
    pub fn expired(&self) -> bool {
        self.now >= self.record.expires_at
    }

    /// Whether it is in flight with a lease that has not run out: a handler may be running.
    pub fn lease_live(&self) -> bool {
        matches!(self.record.state, RecordState::InFlight { lease_until } if lease_until > self.now)
    }
}

/// Which records [`Engine::forget`] may delete. A record that changed between the read and the
/// delete (claimed, completed or released meanwhile) is never deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgettable {
    /// Completed, released or expired records: nothing is running.
    Done,
    /// Those, and in-flight records whose lease ran out (a worker that died; a retry would take
    /// them over anyway).
    DeadClaims,
    /// Anything, a live claim included: its handler may still be running, and a retry then runs it
    /// a second time (only the downstream key protects the services it calls). For a claim that is
    /// known to be stuck.
    Anything,
}

/// What [`Engine::forget`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgotten {
    /// The record was deleted; it was in this state. The next request with the key runs as new.
    Deleted(StateKind),
    /// There is no such record (or only one past retention).
    NotFound,
    /// Not deleted: its state is more than the [`Forgettable`] asked for allows.
    Refused {
        /// The record's state.
        state: StateKind,
        /// Whether it is in flight under a live lease.
        lease_live: bool,
    },
    /// Not deleted: the record changed between its read and the delete. Look again.
    Changed,
}

impl Engine {
    /// The record of `key` in `scope` (as the application gave them), with the store's time.
    pub async fn inspect(&self, scope: &str, key: &str) -> Result<Option<Inspection>, StoreError> {
        let key = RecordKey::new(scope, key);
        self.inspect_key(key).await
    }

    /// [`inspect`](Self::inspect) by a key as stored (from a listing, or a derived key).
    pub async fn inspect_key(&self, key: RecordKey) -> Result<Option<Inspection>, StoreError> {
        let found = self.call("get", self.store().get(&key)).await?;
        Ok(found.map(|found| Inspection {
            key,
            record: found.record,
            now: found.now,
        }))
    }

    /// Deletes the record of `key` in `scope` if `allowed`, so that the next request with the key
    /// runs as new. Fenced like every write: a record claimed, completed or released since it was
    /// read is left alone ([`Forgotten::Changed`]).
    pub async fn forget(
        &self,
        scope: &str,
        key: &str,
        allowed: Forgettable,
    ) -> Result<Forgotten, StoreError> {
        self.forget_key(RecordKey::new(scope, key), allowed).await
    }

    /// [`forget`](Self::forget) by a key as stored.
    pub async fn forget_key(
        &self,
        key: RecordKey,
        allowed: Forgettable,
    ) -> Result<Forgotten, StoreError> {
        let Some(seen) = self.inspect_key(key).await? else {
            return Ok(Forgotten::NotFound);
        };
        let state = seen.state();
        let lease_live = seen.lease_live();
        let may = match (allowed, state) {
            (Forgettable::Anything, _) => true,
            (_, StateKind::Completed | StateKind::Released) => true,
            (_, StateKind::InFlight) if seen.expired() => true,
            (Forgettable::DeadClaims, StateKind::InFlight) => !lease_live,
            (Forgettable::Done, StateKind::InFlight) => false,
        };
        if !may {
            return Ok(Forgotten::Refused { state, lease_live });
        }
        let store = self.store();
        let deleted = self
            .call("forget", store.forget(&seen.key, seen.record.token, state))
            .await?;
        tracing::info!(target: "idem", scope = %seen.key.scope(), key = %seen.key.key(),
            state = state.as_str(), deleted, "record forgotten by an operator");
        Ok(if deleted {
            Forgotten::Deleted(state)
        } else {
            Forgotten::Changed
        })
    }

    /// Deletes every record of `scope` (as the application gave it), whatever its state, responses
    /// included: what a caller's erasure request asks of idem. Returns how many were deleted. See
    /// `docs/security.md` for what each store keeps after it (replicas, persistence files, free
    /// pages).
    pub async fn erase(&self, scope: &str) -> Result<u64, StoreError> {
        let stored = RecordKey::new(scope, "");
        let mut total = 0;
        loop {
            let store = self.store();
            let call = store.erase_scope(stored.scope(), ERASE_BATCH);
            let erased = self.call("erase", call).await?;
            total += erased;
            if erased < ERASE_BATCH as u64 {
                tracing::info!(target: "idem", scope = %stored.scope(), erased = total,
                    "scope erased by an operator");
                return Ok(total);
            }
        }
    }

    /// At most `limit` records in flight for at least `older_than` (claims whose handler runs
    /// long, or whose worker died and whose lease has not been taken over), oldest first, with the
    /// store's time.
    pub async fn in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        let store = self.store();
        self.call("list", store.list_in_flight(older_than, limit))
            .await
    }

    /// What the store holds right now.
    pub async fn stats(&self) -> Result<Stats, StoreError> {
        let store = self.store();
        self.call("stats", store.stats()).await
    }
}
