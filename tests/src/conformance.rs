//! The store conformance suite: one set of cases, run against every backend.
//!
//! A backend's test file implements [`Backend`] and invokes [`conformance_suite!`](crate::conformance_suite!), which expands to
//! one `#[tokio::test]` per case:
//!
//! ```ignore
//! struct Memory;
//! #[async_trait::async_trait]
//! impl Backend for Memory { /* ... */ }
//! async fn backend() -> Memory { Memory }
//! idem_tests::conformance_suite!(backend);
//! ```
//!
//! A backend on a service passes the attribute that ignores its cases when `IDEM_TEST_SKIP` names
//! the service (see [`services`](crate::services)):
//! `conformance_suite!(postgres, #[cfg_attr(skip_postgres, ignore = "…")])`.
//!
//! Time is a [`ManualClock`] that the store judges by (every backend takes one in place of its own
//! clock): expiry, lease takeover and purging are driven by moving it, never by sleeping. Waiting is synchronised on the store's own subscription (a wrapper signals when the
//! duplicate has subscribed), so no case depends on timing.

use axum::http::header::{HeaderName, HeaderValue, CONTENT_TYPE, LOCATION};
use idem_runtime::clock::{Clock, ManualClock, Timestamp};
use idem_runtime::store::{Claim, ClaimOutcome, Found, Purge, Subscription};
use idem_runtime::sweeper::Sweeper;
use idem_runtime::{
    Begin, Engine, FencingToken, Fingerprint, Policy, Record, RecordKey, RecordState, Rejection,
    Store, StoreError, StoreErrorKind, StoredResponse,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Barrier, Notify};

/// A store backend under test.
#[async_trait::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// The store type.
    type Store: Store + Purge;

    /// Opens a handle onto this backend's storage that judges time by `clock` instead of its own.
    /// For durable backends, every handle sees the same records (two handles are two service
    /// instances; reopening is a restart).
    async fn open(&self, clock: Arc<dyn Clock>) -> Self::Store;

    /// Whether records survive dropping every handle and opening a new one.
    fn durable(&self) -> bool;

    /// A store of this kind that cannot reach its storage, for the "unavailable" outcome; `None`
    /// where that cannot happen (memory), and the suite then injects failures with a wrapper.
    async fn unreachable(&self) -> Option<Self::Store>;
}

/// The time every case starts at.
pub const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);

const TTL: Duration = Duration::from_secs(3600);
const RETAIN: Duration = Duration::from_secs(4 * 3600);
const LEASE: Duration = Duration::from_secs(30);

/// The policy the cases use unless they say otherwise: no waiting.
pub fn policy() -> Policy {
    Policy::new()
        .ttl(TTL)
        .retain(RETAIN)
        .lease(LEASE)
        .wait(Duration::ZERO)
        .handler("conformance")
}

fn waiting_policy() -> Policy {
    policy().wait(Duration::from_secs(60))
}

/// A unique key within a unique scope, so that cases never meet even on a shared server.
pub fn fresh_key() -> RecordKey {
    RecordKey::new(format!("scope-{}", uuid::Uuid::new_v4()), "key-1")
}

/// A fingerprint distinguished by `body`.
pub fn fp(body: &str) -> Fingerprint {
    Fingerprint::of_request(
        "POST",
        "/payments",
        Some("application/json"),
        body.as_bytes(),
    )
}

/// A response with a binary body and a few headers, one of them obs-text (bytes beyond visible
/// ASCII, which every store must keep byte for byte), to check round trips.
pub fn response(tag: &str) -> StoredResponse {
    let mut body = tag.as_bytes().to_vec();
    body.extend_from_slice(&[0, 159, 146, 150, 255]);
    StoredResponse {
        status: 201,
        headers: vec![
            (CONTENT_TYPE, HeaderValue::from_static("application/json")),
            (
                LOCATION,
                HeaderValue::try_from(format!("/payments/{tag}")).expect("a tag makes a value"),
            ),
            (
                HeaderName::from_static("x-obs-text"),
                HeaderValue::from_bytes(b"caf\xe9 \xff").expect("obs-text is a value"),
            ),
        ],
        body: body.into(),
    }
}

/// A store wrapper that signals each subscription and counts finished claims, so a case can complete
/// the original only once the duplicate is waiting (or has re-read the record after announcing).
pub struct Observed<S> {
    inner: S,
    /// Notified once per `subscribe` call.
    pub subscribed: Arc<Notify>,
    /// How many claims have returned.
    pub claims: watch::Sender<usize>,
}

impl<S> Observed<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            subscribed: Arc::new(Notify::new()),
            claims: watch::Sender::new(0),
        }
    }
}

#[async_trait::async_trait]
impl<S: Store> Store for Observed<S> {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let found = self.inner.claim(claim).await;
        self.claims.send_modify(|n| *n += 1);
        found
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.inner.complete(key, token, response).await
    }
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.renew(key, token, lease).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        self.inner.get(key).await
    }
    fn subscribe(&self, key: &RecordKey) -> Subscription {
        let sub = self.inner.subscribe(key);
        self.subscribed.notify_one();
        sub
    }
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.inner.announce_waiter(key).await
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    async fn forget(
        &self,
        key: &RecordKey,
        token: FencingToken,
        state: idem_runtime::store::StateKind,
    ) -> Result<bool, StoreError> {
        self.inner.forget(key, token, state).await
    }
    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        self.inner.erase_scope(scope, batch).await
    }
    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<idem_runtime::store::Listed>, Timestamp), StoreError> {
        self.inner.list_in_flight(older_than, limit).await
    }
    async fn stats(&self) -> Result<idem_runtime::store::Stats, StoreError> {
        self.inner.stats().await
    }
}

/// For shared stores, given two instances that share nothing but the server: through the engine, a
/// duplicate waiting on instance `b`, its wait armed before instance `a`'s original completes, is
/// woken by that completion (it can only hear of it through the server, and only if its announcement
/// reached the record) and replays, long before its 10-minute wait bound or lease end.
pub async fn a_waiting_duplicate_on_another_instance_is_woken<S: Store>(a: S, b: S) {
    const GENEROUS: Duration = Duration::from_secs(30);
    let long = Policy::new()
        .ttl(Duration::from_secs(3600))
        .lease(Duration::from_secs(600))
        .wait(Duration::from_secs(600))
        .handler("cross-instance");
    let a = Engine::new(a);
    let b_store = Arc::new(Observed::new(b));
    let b = Engine::from_arc(b_store.clone());
    for round in 0..3 {
        let mut claims = b_store.claims.subscribe();
        let before = *claims.borrow_and_update();
        let key = fresh_key();
        let original = match a.begin(key.clone(), fp("a"), &long).await {
            Ok(Begin::Execute(guard)) => guard,
            other => panic!("round {round}: the original claims, got {other:?}"),
        };
        let duplicate = {
            let (b, key) = (b.clone(), key.clone());
            tokio::spawn(async move { b.begin(key, fp("a"), &long).await })
        };
        // Its second claim is the re-read after subscribing and announcing: from then on only a
        // notification through the server can wake it before its bound.
        tokio::time::timeout(GENEROUS, claims.wait_for(|n| *n >= before + 2))
            .await
            .expect("the duplicate armed its wait")
            .expect("the store outlives the test");
        original.complete(&response("a")).await.expect("complete");
        let replayed = tokio::time::timeout(GENEROUS, duplicate)
            .await
            .expect("woken by the completion, not by its bound")
            .expect("join");
        match replayed {
            Ok(Begin::Replay(replay)) => assert_eq!(replay.response, response("a")),
            other => panic!("round {round}: the duplicate replays, got {other:?}"),
        }
    }
}

/// For shared stores, given two instances that share nothing but the server: a completion or a
/// release on `a` wakes a subscriber on `b` that announced itself (the wake-up can only come
/// through the server), `b` then reads what `a` wrote, and a subscriber to another key stays asleep.
pub async fn a_completion_or_release_wakes_its_key_on_another_instance<S: Store>(a: &S, b: &S) {
    const GENEROUS: Duration = Duration::from_secs(30);
    for complete in [true, false] {
        let key = fresh_key();
        let claim = claim_of(&key, fp("a"));
        a.claim(&claim).await.expect("claim");
        let mut woken = b.subscribe(&key);
        let mut other = b.subscribe(&fresh_key());
        b.announce_waiter(&key).await.expect("announce");
        if complete {
            a.complete(&key, claim.token, &response("a"))
                .await
                .expect("complete");
        } else {
            a.release(&key, claim.token).await.expect("release");
        }
        tokio::time::timeout(GENEROUS, woken.changed())
            .await
            .expect("b was woken by a's completion or release");
        let record = b.get(&key).await.expect("get").expect("the record");
        let expected = match complete {
            true => RecordState::Completed {
                response: response("a"),
            },
            false => RecordState::Released,
        };
        assert_eq!(record.record.state, expected, "b reads what a wrote");
        let woken = tokio::time::timeout(Duration::ZERO, other.changed()).await;
        assert!(woken.is_err(), "a waiter on another key was woken");
    }
}

/// A store that is down.
struct Down;

#[async_trait::async_trait]
impl Store for Down {
    async fn claim(&self, _: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        Err(StoreError::unavailable("connection refused"))
    }
    async fn complete(
        &self,
        _: &RecordKey,
        _: FencingToken,
        _: &StoredResponse,
    ) -> Result<(), StoreError> {
        Err(StoreError::unavailable("connection refused"))
    }
    async fn release(&self, _: &RecordKey, _: FencingToken) -> Result<(), StoreError> {
        Err(StoreError::unavailable("connection refused"))
    }
    async fn renew(&self, _: &RecordKey, _: FencingToken, _: Duration) -> Result<(), StoreError> {
        Err(StoreError::unavailable("connection refused"))
    }
    async fn get(&self, _: &RecordKey) -> Result<Option<Found>, StoreError> {
        Err(StoreError::unavailable("connection refused"))
    }
    fn subscribe(&self, _: &RecordKey) -> Subscription {
        Subscription::never()
    }
}

/// A claim of `key` by a request with `fingerprint`, under [`policy`], with a fresh token.
pub fn claim_of(key: &RecordKey, fingerprint: Fingerprint) -> Claim<'_> {
    let policy = policy();
    Claim {
        key,
        fingerprint,
        token: FencingToken::generate(),
        lease: policy.lease,
        ttl: policy.ttl,
        retain: policy.retain,
    }
}

/// One store handle judging time by a manual clock, an engine over it, and the clock.
pub struct Harness<S: Store> {
    /// The store under test.
    pub store: Arc<Observed<S>>,
    /// The clock the store judges time by.
    pub clock: ManualClock,
    /// The engine.
    pub engine: Engine,
}

/// A harness over a new handle of `b`, on a store clock standing at [`T0`].
pub async fn harness<B: Backend>(b: &B) -> Harness<B::Store> {
    let clock = ManualClock::new(T0);
    Harness::new(b.open(Arc::new(clock.clone())).await, clock)
}

impl<S: Store> Harness<S> {
    /// A harness over `store`, which judges time by `clock`.
    pub fn new(store: S, clock: ManualClock) -> Self {
        let store = Arc::new(Observed::new(store));
        let engine =
            Engine::from_arc(store.clone()).with_store_timeout(Some(Duration::from_secs(10)));
        Self {
            store,
            clock,
            engine,
        }
    }

    async fn get(&self, key: &RecordKey) -> Option<Record> {
        let found = self.store.get(key).await.expect("get");
        found.map(|found| {
            assert_eq!(
                found.now,
                self.clock.now(),
                "a read carries the store's time"
            );
            found.record
        })
    }
}

fn execute(begin: Result<Begin, Rejection>) -> idem_runtime::ClaimGuard {
    match begin {
        Ok(Begin::Execute(guard)) => guard,
        other => panic!("expected Execute, got {other:?}"),
    }
}

fn replay(begin: Result<Begin, Rejection>) -> idem_runtime::Replay {
    match begin {
        Ok(Begin::Replay(replay)) => replay,
        other => panic!("expected Replay, got {other:?}"),
    }
}

/// Outcome 1 and 2: a new key runs; the record holds exactly what was claimed and then completed;
/// the retry replays it byte for byte.
pub async fn new_key_executes_then_replays<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    assert!(!guard.taken_over());
    assert_eq!(guard.expires_at(), T0 + TTL);

    let record = h.get(&key).await.expect("claimed record");
    assert_eq!(record.fingerprint, fp("a"));
    assert_eq!(record.token, guard.token());
    assert_eq!(record.created_at, T0);
    assert_eq!(record.expires_at, T0 + TTL);
    assert_eq!(record.retain_until, T0 + RETAIN);
    assert_eq!(
        record.state,
        RecordState::InFlight {
            lease_until: T0 + LEASE
        }
    );

    guard.complete(&response("a")).await.expect("complete");
    let record = h.get(&key).await.expect("completed record");
    assert_eq!(
        record.state,
        RecordState::Completed {
            response: response("a")
        }
    );

    h.clock.advance(Duration::from_secs(60));
    let replayed = replay(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    assert_eq!(replayed.response, response("a"));
    assert_eq!(replayed.expires_at, T0 + TTL);
    use idem_runtime::metrics::Outcome;
    assert_eq!(h.engine.metrics().get(Outcome::Executed), 1);
    assert_eq!(h.engine.metrics().get(Outcome::Replayed), 1);
}

/// An empty body and an error status are stored as faithfully as a 201.
pub async fn stored_response_round_trips<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let stored = StoredResponse {
        status: 409,
        headers: vec![],
        body: bytes::Bytes::new(),
    };
    execute(h.engine.begin(key.clone(), fp("a"), &policy()).await)
        .complete(&stored)
        .await
        .expect("complete");
    assert_eq!(
        replay(h.engine.begin(key, fp("a"), &policy()).await).response,
        stored
    );
}

/// Outcome 3: the same key with another request is a mismatch, whether the original completed or is
/// still in flight, and never waits for or sees the original's response.
pub async fn different_request_is_a_mismatch<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let guard = execute(
        h.engine
            .begin(key.clone(), fp("a"), &waiting_policy())
            .await,
    );
    let in_flight = h
        .engine
        .begin(key.clone(), fp("b"), &waiting_policy())
        .await;
    assert!(
        matches!(in_flight, Err(Rejection::Mismatch { .. })),
        "{in_flight:?}"
    );
    guard.complete(&response("a")).await.expect("complete");
    let completed = h.engine.begin(key.clone(), fp("b"), &policy()).await;
    assert!(matches!(completed, Err(Rejection::Mismatch { expires_at }) if expires_at == T0 + TTL));
    // The mismatch left the record alone.
    assert_eq!(h.get(&key).await.expect("record").fingerprint, fp("a"));
}

/// Outcome 4: an identical duplicate waits for the in-flight original, is woken by its completion,
/// and replays it.
pub async fn duplicate_waits_then_replays<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    let subscribed = h.store.subscribed.clone();
    let engine = h.engine.clone();
    let k = key.clone();
    let duplicate = tokio::spawn(async move { engine.begin(k, fp("a"), &waiting_policy()).await });
    subscribed.notified().await;
    guard.complete(&response("a")).await.expect("complete");
    // The wait bound is 60 s; only the completion's wake-up gets a replay (at the bound it is a 409).
    let replayed = replay(duplicate.await.expect("join"));
    assert_eq!(replayed.response, response("a"));
    use idem_runtime::metrics::Outcome;
    assert_eq!(h.engine.metrics().get(Outcome::Waited), 1);
}

/// Outcome 4, at the bound: still running when the wait runs out is a conflict with a retry hint.
pub async fn in_flight_at_the_bound_is_a_conflict<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let _guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    match h.engine.begin(key.clone(), fp("a"), &policy()).await {
        Err(Rejection::InFlight { retry_after }) => {
            assert!(
                retry_after >= Duration::from_secs(1) && retry_after <= LEASE,
                "{retry_after:?}"
            )
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    // A short wait that the original outlasts ends the same way.
    let short = policy().wait(Duration::from_millis(20));
    let waited = h.engine.begin(key, fp("a"), &short).await;
    assert!(
        matches!(waited, Err(Rejection::InFlight { .. })),
        "{waited:?}"
    );
}

/// Outcome 5: a claim whose lease ran out is taken over with a new token; the old worker's late
/// completion and release are fenced off and change nothing.
pub async fn dead_worker_is_taken_over_and_fenced<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let old = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    h.clock.advance(LEASE);
    // Another request may not take it over.
    let other = h.engine.begin(key.clone(), fp("b"), &policy()).await;
    assert!(
        matches!(other, Err(Rejection::Mismatch { .. })),
        "{other:?}"
    );
    let new = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    assert!(new.taken_over());
    assert_ne!(new.token(), old.token());
    let record = h.get(&key).await.expect("record");
    assert_eq!(record.token, new.token());
    assert_eq!(record.created_at, T0, "a takeover keeps the key's lifetime");
    assert_eq!(record.expires_at, T0 + TTL);
    assert_eq!(
        record.state,
        RecordState::InFlight {
            lease_until: T0 + LEASE + LEASE
        }
    );

    let late = old.complete(&response("old")).await;
    assert_eq!(late.expect_err("fenced").kind(), StoreErrorKind::Fenced);
    assert_eq!(h.get(&key).await.expect("record").token, new.token());

    new.complete(&response("new")).await.expect("complete");
    assert_eq!(
        replay(h.engine.begin(key.clone(), fp("a"), &policy()).await).response,
        response("new")
    );

    // A late release is fenced too.
    let key2 = fresh_key();
    let old2 = execute(h.engine.begin(key2.clone(), fp("a"), &policy()).await);
    h.clock.advance(LEASE);
    let new2 = execute(h.engine.begin(key2.clone(), fp("a"), &policy()).await);
    assert_eq!(
        old2.release().await.expect_err("fenced").kind(),
        StoreErrorKind::Fenced
    );
    assert_eq!(h.get(&key2).await.expect("record").token, new2.token());
    new2.complete(&response("b")).await.expect("complete");
}

/// Outcome 6: past its ttl a key answers "expired" (whatever is asked), is kept as a tombstone until
/// retention ends, is purged then, and only then runs again as a new key.
pub async fn expired_key_is_a_tombstone_until_purged<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    execute(h.engine.begin(key.clone(), fp("a"), &policy()).await)
        .complete(&response("a"))
        .await
        .expect("complete");
    h.clock.advance(TTL);
    for body in ["a", "b"] {
        match h.engine.begin(key.clone(), fp(body), &policy()).await {
            Err(Rejection::Expired { expired_at }) => assert_eq!(expired_at, T0 + TTL),
            other => panic!("expected Expired, got {other:?}"),
        }
    }
    assert!(h.get(&key).await.is_some(), "the tombstone is still there");
    assert_eq!(h.store.inner.purge_expired(100).await.expect("purge"), 0);

    h.clock.advance(RETAIN - TTL);
    assert!(h.store.inner.purge_expired(100).await.expect("purge") >= 1);
    assert!(h.get(&key).await.is_none(), "purged");
    let again = execute(h.engine.begin(key.clone(), fp("b"), &policy()).await);
    assert!(!again.taken_over());
    assert_eq!(h.get(&key).await.expect("record").created_at, T0 + RETAIN);
}

/// A key that was in flight when its ttl passed is expired too, not taken over.
pub async fn expired_in_flight_key_is_not_taken_over<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let _dead = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    h.clock.advance(TTL);
    let late = h.engine.begin(key, fp("a"), &policy()).await;
    assert!(matches!(late, Err(Rejection::Expired { .. })), "{late:?}");
}

/// Records past retention count as absent even before a sweep deletes them.
pub async fn forgotten_record_is_replaced_without_a_sweep<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    execute(h.engine.begin(key.clone(), fp("a"), &policy()).await)
        .complete(&response("a"))
        .await
        .expect("complete");
    h.clock.advance(RETAIN);
    assert!(
        h.get(&key).await.is_none(),
        "get hides records past retention"
    );
    let fresh = execute(h.engine.begin(key.clone(), fp("b"), &policy()).await);
    assert!(!fresh.taken_over());
    let record = h.get(&key).await.expect("record");
    assert_eq!(record.fingerprint, fp("b"));
    assert_eq!(record.created_at, T0 + RETAIN);
}

/// Outcome 7: when the store cannot be reached, the request is rejected as unavailable: it never
/// gets a claim, so the handler never runs.
pub async fn unreachable_store_is_unavailable<B: Backend>(b: B) {
    let engine = match b.unreachable().await {
        Some(store) => Engine::new(store).with_store_timeout(Some(Duration::from_secs(5))),
        None => Engine::new(Down),
    };
    match engine.begin(fresh_key(), fp("a"), &policy()).await {
        Err(Rejection::Unavailable {
            retry_after,
            source,
        }) => {
            assert_eq!(source.kind(), StoreErrorKind::Unavailable);
            assert!(retry_after >= Duration::from_secs(1));
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// N identical requests at once, on two instances, elect exactly one executor; every other one
/// waits and replays its response.
pub async fn concurrent_claims_elect_exactly_one<B: Backend>(b: B) {
    const N: usize = 24;
    let first = harness(&b).await;
    let second_store = if b.durable() {
        Some(b.open(Arc::new(first.clock.clone())).await)
    } else {
        None
    };
    let engines = match second_store {
        Some(store) => {
            let second = Harness::new(store, first.clock.clone());
            vec![first.engine.clone(), second.engine.clone()]
        }
        None => vec![first.engine.clone(), first.engine.clone()],
    };
    let key = fresh_key();
    let barrier = Arc::new(Barrier::new(N));
    let executed = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..N {
        let engine = engines[i % 2].clone();
        let (barrier, executed, key) = (barrier.clone(), executed.clone(), key.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            match engine.begin(key, fp("a"), &waiting_policy()).await {
                Ok(Begin::Execute(guard)) => {
                    executed.fetch_add(1, Ordering::SeqCst);
                    guard.complete(&response("once")).await.expect("complete");
                    response("once")
                }
                Ok(Begin::Replay(replay)) => replay.response,
                Err(e) => panic!("request {i}: {e:?}"),
            }
        }));
    }
    for task in tasks {
        assert_eq!(task.await.expect("join"), response("once"));
    }
    assert_eq!(executed.load(Ordering::SeqCst), 1);
}

/// A key belongs to its scope: two callers' identical keys never meet.
pub async fn keys_are_scoped_to_the_caller<B: Backend>(b: B) {
    let h = harness(&b).await;
    let alice = RecordKey::new(format!("alice-{}", uuid::Uuid::new_v4()), "same-key");
    let bob = RecordKey::new(format!("bob-{}", uuid::Uuid::new_v4()), "same-key");
    execute(h.engine.begin(alice.clone(), fp("a"), &policy()).await)
        .complete(&response("alice"))
        .await
        .expect("complete");
    execute(h.engine.begin(bob.clone(), fp("a"), &policy()).await)
        .complete(&response("bob"))
        .await
        .expect("complete");
    assert_eq!(
        replay(h.engine.begin(alice, fp("a"), &policy()).await).response,
        response("alice")
    );
    assert_eq!(
        replay(h.engine.begin(bob, fp("a"), &policy()).await).response,
        response("bob")
    );
}

/// A released claim (the handler failed) lets the next request run: the same request resumes the
/// same record (its times and downstream key kept, not a takeover), and a waiting duplicate is
/// woken by the release and runs itself.
pub async fn release_lets_the_next_request_run<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let first = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    let downstream = first.downstream_key();
    first.release().await.expect("release");
    assert_eq!(
        h.get(&key).await.expect("record").state,
        RecordState::Released
    );
    h.clock.advance(Duration::from_secs(1));
    let second = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    assert!(!second.taken_over());
    assert_eq!(second.downstream_key(), downstream, "the same record");
    assert_eq!(h.get(&key).await.expect("record").created_at, T0);

    let subscribed = h.store.subscribed.clone();
    let engine = h.engine.clone();
    let k = key.clone();
    let waiter = tokio::spawn(async move { engine.begin(k, fp("a"), &waiting_policy()).await });
    subscribed.notified().await;
    second.release().await.expect("release");
    let third = execute(waiter.await.expect("join"));
    third.complete(&response("third")).await.expect("complete");
}

/// A claim dropped while a panic unwinds is released in the background; one dropped otherwise (a
/// task aborted, a process stopping) is left to its lease, like a crash, and then taken over.
pub async fn dropped_claim_is_released_only_on_a_panic<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    let mut released = h.store.subscribe(&key);
    let panicked = tokio::spawn(async move {
        let _held = guard;
        panic!("the handler panics");
    })
    .await;
    assert!(panicked.is_err());
    released.changed().await;
    assert_eq!(
        h.get(&key).await.expect("record").state,
        RecordState::Released
    );

    let key = fresh_key();
    drop(execute(
        h.engine.begin(key.clone(), fp("a"), &policy()).await,
    ));
    let held = h.engine.begin(key.clone(), fp("a"), &policy()).await;
    assert!(matches!(held, Err(Rejection::InFlight { .. })), "{held:?}");
    h.clock.advance(LEASE);
    assert!(execute(h.engine.begin(key, fp("a"), &policy()).await).taken_over());
}

/// A renewal moves the lease of the current claim only: a claim renewed in time is never taken
/// over; a stranger's token, a claim taken over, and a completed record refuse it.
pub async fn renewal_moves_the_lease_of_the_current_claim_only<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    for _ in 0..3 {
        h.clock.advance(LEASE * 2 / 3);
        h.store
            .renew(&key, guard.token(), LEASE)
            .await
            .expect("the holder renews");
        let held = h.engine.begin(key.clone(), fp("a"), &policy()).await;
        assert!(matches!(held, Err(Rejection::InFlight { .. })), "{held:?}");
    }
    assert_eq!(
        h.get(&key).await.expect("record").state,
        RecordState::InFlight {
            lease_until: h.clock.now() + LEASE
        }
    );
    let stranger = FencingToken(guard.token().0.wrapping_add(1));
    let refused = h.store.renew(&key, stranger, LEASE).await;
    assert_eq!(refused.expect_err("fenced").kind(), StoreErrorKind::Fenced);

    // Once the renewals stop, the lease runs out and a takeover fences the old token for good.
    h.clock.advance(LEASE);
    let heir = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    assert!(heir.taken_over());
    let late = h.store.renew(&key, guard.token(), LEASE).await;
    assert_eq!(late.expect_err("fenced").kind(), StoreErrorKind::Fenced);
    let token = heir.token();
    heir.complete(&response("a")).await.expect("complete");
    let done = h.store.renew(&key, token, LEASE).await;
    assert_eq!(done.expect_err("fenced").kind(), StoreErrorKind::Fenced);
    let missing = h.store.renew(&fresh_key(), token, LEASE).await;
    assert_eq!(missing.expect_err("fenced").kind(), StoreErrorKind::Fenced);
}

/// A claim whose record was released under its holder (by a later holder, or here by its own
/// token) gets it back at the holder's completion, under the same token: the retry replays the
/// response instead of running again.
pub async fn a_lost_record_is_claimed_back_by_its_completion<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    h.store.release(&key, guard.token()).await.expect("release");
    assert_eq!(
        h.get(&key).await.expect("record").state,
        RecordState::Released
    );
    guard
        .complete(&response("a"))
        .await
        .expect("claimed back and completed");
    assert_eq!(
        replay(h.engine.begin(key, fp("a"), &policy()).await).response,
        response("a")
    );
}

/// Scopes and keys come from callers: a scope of kilobytes (a long bearer token taken for a user
/// id) and a key at the limit are stored within every store's limits, replay, and never meet a
/// pair that differs only past the stored head.
pub async fn long_scopes_and_keys_stay_within_the_stores_limits<B: Backend>(b: B) {
    let h = harness(&b).await;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let long = format!("{tag}{}", "u".repeat(3000));
    let pairs = [
        RecordKey::new(long.clone(), "k".repeat(255)),
        RecordKey::new(format!("{long}v"), "k".repeat(255)),
        RecordKey::new(long.clone(), format!("{}x", "k".repeat(300))),
        RecordKey::new(format!("{tag}한"), "키".repeat(200)),
    ];
    for (i, key) in pairs.iter().enumerate() {
        assert!(key.scope().len() <= RecordKey::MAX_PART + 1);
        assert!(key.key().len() <= RecordKey::MAX_PART + 1);
        let tag = format!("long-{i}");
        execute(h.engine.begin(key.clone(), fp("a"), &policy()).await)
            .complete(&response(&tag))
            .await
            .expect("complete");
    }
    for (i, key) in pairs.iter().enumerate() {
        assert_eq!(
            replay(h.engine.begin(key.clone(), fp("a"), &policy()).await).response,
            response(&format!("long-{i}")),
            "each long pair has its own record"
        );
    }
}

/// Completion and release need the record's current token and an in-flight record.
pub async fn completion_requires_the_current_token<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    let stranger = FencingToken(guard.token().0.wrapping_add(1));
    let err = h
        .store
        .complete(&key, stranger, &response("x"))
        .await
        .expect_err("fenced");
    assert_eq!(err.kind(), StoreErrorKind::Fenced);
    let err = h.store.release(&key, stranger).await.expect_err("fenced");
    assert_eq!(err.kind(), StoreErrorKind::Fenced);
    let token = guard.token();
    guard.complete(&response("a")).await.expect("complete");
    // Completed records cannot be completed again or released, even with the right token.
    let again = h
        .store
        .complete(&key, token, &response("b"))
        .await
        .expect_err("fenced");
    assert_eq!(again.kind(), StoreErrorKind::Fenced);
    assert_eq!(
        h.store
            .release(&key, token)
            .await
            .expect_err("fenced")
            .kind(),
        StoreErrorKind::Fenced
    );
    let missing = h
        .store
        .complete(&fresh_key(), token, &response("c"))
        .await
        .expect_err("fenced");
    assert_eq!(missing.kind(), StoreErrorKind::Fenced);
    assert_eq!(
        h.get(&key).await.expect("record").state,
        RecordState::Completed {
            response: response("a")
        }
    );
}

/// Durable backends keep records across a restart: completed keys replay, in-flight keys stay held.
pub async fn restart_keeps_records<B: Backend>(b: B) {
    if !b.durable() {
        return;
    }
    let (done, held) = (fresh_key(), fresh_key());
    {
        let h = harness(&b).await;
        execute(h.engine.begin(done.clone(), fp("a"), &policy()).await)
            .complete(&response("a"))
            .await
            .expect("complete");
        let guard = execute(h.engine.begin(held.clone(), fp("a"), &policy()).await);
        std::mem::forget(guard); // the process dies holding it: no release
    }
    let h = harness(&b).await;
    assert_eq!(
        replay(h.engine.begin(done, fp("a"), &policy()).await).response,
        response("a")
    );
    let busy = h.engine.begin(held, fp("a"), &policy()).await;
    assert!(matches!(busy, Err(Rejection::InFlight { .. })), "{busy:?}");
}

/// Purging deletes only records past retention, at most a batch per call; the sweeper loops batches.
pub async fn purge_deletes_in_batches<B: Backend>(b: B) {
    let h = harness(&b).await;
    let scope = format!("purge-{}", uuid::Uuid::new_v4());
    for i in 0..25 {
        let key = RecordKey::new(scope.clone(), format!("k{i}"));
        execute(h.engine.begin(key, fp("a"), &policy()).await)
            .complete(&response("a"))
            .await
            .expect("complete");
    }
    let live = RecordKey::new(scope.clone(), "live");
    execute(
        h.engine
            .begin(live.clone(), fp("a"), &policy().retain(RETAIN * 2))
            .await,
    )
    .complete(&response("live"))
    .await
    .expect("complete");
    h.clock.advance(RETAIN);
    // Other cases may share the server; count only at least our own batches.
    let first = h.store.inner.purge_expired(10).await.expect("purge");
    assert_eq!(first, 10, "a batch is capped");
    let sweeper = Sweeper::new(ArcPurge(h.store.clone())).batch_size(7);
    assert!(sweeper.sweep_once().await.expect("sweep") >= 15);
    for i in 0..25 {
        let key = RecordKey::new(scope.clone(), format!("k{i}"));
        assert!(h.get(&key).await.is_none(), "k{i} purged");
    }
    assert!(
        h.get(&live).await.is_some(),
        "records within retention stay"
    );
}

/// A released record is the same record only for its own request: another request under the key
/// replaces it with a new record (new times, new downstream key), and so does the same request
/// once the record expired, was purged and is claimed again.
pub async fn a_new_record_under_the_same_key_gets_a_new_downstream_key<B: Backend>(b: B) {
    let h = harness(&b).await;
    let key = fresh_key();
    let first = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    let downstream = first.downstream_key();
    first.release().await.expect("release");
    h.clock.advance(Duration::from_secs(1));
    let other = execute(h.engine.begin(key.clone(), fp("b"), &policy()).await);
    assert_ne!(other.downstream_key(), downstream);
    assert_eq!(
        h.get(&key).await.expect("record").created_at,
        T0 + Duration::from_secs(1),
        "another request's claim is a new record"
    );
    let second = other.downstream_key();
    other.complete(&response("b")).await.expect("complete");
    // The same request, sent again once its record is gone: a new record, a new downstream key.
    h.clock.advance(RETAIN);
    h.store.inner.purge_expired(100).await.expect("purge");
    let again = execute(h.engine.begin(key.clone(), fp("b"), &policy()).await);
    assert_ne!(again.downstream_key(), second);
    again.complete(&response("b2")).await.expect("complete");
}

/// Instances judge nothing by their own clocks: an engine whose clock is a lease and 50 s, or a
/// day and an hour, ahead of or behind the store's never takes over a live claim, never answers
/// "expired" to a fresh record, and purges nothing early.
pub async fn skewed_instance_clocks_change_nothing<B: Backend>(b: B) {
    let h = harness(&b).await;
    let day_and_hour = Duration::from_secs(25 * 3600);
    let lease_and_50s = LEASE + Duration::from_secs(50);
    for (ahead, skew) in [
        (true, lease_and_50s),
        (false, lease_and_50s),
        (true, day_and_hour),
        (false, day_and_hour),
    ] {
        let skewed_at = match ahead {
            true => T0 + skew,
            false => Timestamp::from_millis(T0.as_millis() - skew.as_millis() as i64),
        };
        let skewed = Engine::from_arc(h.store.clone()).with_clock(ManualClock::new(skewed_at));
        let key = fresh_key();
        let guard = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
        let held = skewed.begin(key.clone(), fp("a"), &policy()).await;
        assert!(
            matches!(held, Err(Rejection::InFlight { .. })),
            "{skew:?} {}: {held:?}",
            if ahead { "ahead" } else { "behind" }
        );
        guard.complete(&response("a")).await.expect("complete");
        let replayed = replay(skewed.begin(key.clone(), fp("a"), &policy()).await);
        assert_eq!(replayed.expires_at, T0 + TTL);
        // A sweep from the skewed instance deletes nothing that is still retained.
        Sweeper::new(ArcPurge(h.store.clone()))
            .sweep_once()
            .await
            .expect("sweep");
        assert!(h.get(&key).await.is_some(), "purged early");
        // A claim from the skewed instance is stamped by the store.
        let fresh = fresh_key();
        let own = execute(skewed.begin(fresh.clone(), fp("a"), &policy()).await);
        assert_eq!(own.expires_at(), T0 + TTL);
        assert_eq!(h.get(&fresh).await.expect("record").created_at, T0);
        own.complete(&response("own")).await.expect("complete");
    }
}

/// A store wrapper whose claims wait at a gate: a case can drop the request while its claim is on
/// its way to the store, then let the claim land.
struct Gated<S> {
    inner: S,
    arrived: Arc<Notify>,
    open: Arc<Notify>,
}

#[async_trait::async_trait]
impl<S: Store> Store for Gated<S> {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.arrived.notify_one();
        self.open.notified().await;
        self.inner.claim(claim).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.inner.complete(key, token, response).await
    }
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.inner.renew(key, token, lease).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        self.inner.get(key).await
    }
    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.inner.subscribe(key)
    }
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.inner.announce_waiter(key).await
    }
}

/// A request dropped while its claim is on its way (a client that hung up right after sending)
/// leaves no key claimed by nobody: the claim lands, finds no one waiting for it, and is released,
/// so the retry runs at once as the same record instead of waiting for the lease.
pub async fn a_claim_whose_request_was_dropped_is_released<B: Backend>(b: B) {
    let clock = ManualClock::new(T0);
    let store = Arc::new(b.open(Arc::new(clock)).await);
    let gated = Arc::new(Gated {
        inner: store.clone(),
        arrived: Arc::new(Notify::new()),
        open: Arc::new(Notify::new()),
    });
    let engine = Engine::from_arc(gated.clone());
    let key = fresh_key();
    let request = {
        let (engine, key) = (engine.clone(), key.clone());
        tokio::spawn(async move { engine.begin(key, fp("a"), &policy()).await })
    };
    gated.arrived.notified().await;
    request.abort();
    assert!(request.await.expect_err("aborted").is_cancelled());
    let mut settled = store.subscribe(&key);
    gated.open.notify_one();
    settled.changed().await;
    let found = store
        .get(&key)
        .await
        .expect("get")
        .expect("the claim landed");
    assert_eq!(found.record.state, RecordState::Released);
    // The retry (on the store directly: no gate) resumes it at once; not a takeover.
    let retry = execute(Engine::from_arc(store).begin(key, fp("a"), &policy()).await);
    assert!(!retry.taken_over());
    retry.complete(&response("a")).await.expect("complete");
}

/// An operator sees a record as the application named it, and forgets it: a completed record at
/// once, an in-flight one only once its lease ran out or when forced; a record that changed since
/// it was read is left alone. A forgotten key runs again, as new, on its next request.
pub async fn an_operator_sees_and_forgets_records<B: Backend>(b: B) {
    use idem_runtime::admin::{Forgettable, Forgotten};
    use idem_runtime::store::StateKind;
    let h = harness(&b).await;
    let scope = format!("ops-{}", uuid::Uuid::new_v4());
    let key = RecordKey::new(scope.clone(), "done");
    execute(h.engine.begin(key.clone(), fp("a"), &policy()).await)
        .complete(&response("a"))
        .await
        .expect("complete");
    let seen = h.engine.inspect(&scope, "done").await.expect("inspect");
    let seen = seen.expect("the record");
    assert_eq!(seen.state(), StateKind::Completed);
    assert_eq!((seen.now, seen.record.created_at), (T0, T0));
    assert_eq!(seen.record.expires_at, T0 + TTL);
    assert!(!seen.expired() && !seen.lease_live());
    match &seen.record.state {
        RecordState::Completed { response: stored } => assert_eq!(*stored, response("a")),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        h.engine
            .forget(&scope, "done", Forgettable::Done)
            .await
            .expect("forget"),
        Forgotten::Deleted(StateKind::Completed)
    );
    assert!(h
        .engine
        .inspect(&scope, "done")
        .await
        .expect("inspect")
        .is_none());
    assert_eq!(
        h.engine
            .forget(&scope, "done", Forgettable::Done)
            .await
            .expect("forget"),
        Forgotten::NotFound
    );
    let again = execute(h.engine.begin(key.clone(), fp("a"), &policy()).await);
    assert!(!again.taken_over(), "a forgotten key runs as new");
    again.complete(&response("again")).await.expect("complete");

    // In flight: refused while its lease is live, unless forced or once it ran out.
    let held = RecordKey::new(scope.clone(), "held");
    let guard = execute(h.engine.begin(held.clone(), fp("a"), &policy()).await);
    for allowed in [Forgettable::Done, Forgettable::DeadClaims] {
        assert_eq!(
            h.engine
                .forget(&scope, "held", allowed)
                .await
                .expect("forget"),
            Forgotten::Refused {
                state: StateKind::InFlight,
                lease_live: true
            }
        );
    }
    h.clock.advance(LEASE);
    assert_eq!(
        h.engine
            .forget(&scope, "held", Forgettable::Done)
            .await
            .expect("forget"),
        Forgotten::Refused {
            state: StateKind::InFlight,
            lease_live: false
        }
    );
    assert_eq!(
        h.engine
            .forget(&scope, "held", Forgettable::DeadClaims)
            .await
            .expect("forget"),
        Forgotten::Deleted(StateKind::InFlight)
    );
    // Its record is gone, so the old holder's completion claims it back (as after a store loss).
    assert!(
        guard.try_complete(&response("late")).await.is_ok(),
        "a vanished record is claimed back by its holder's completion"
    );
    let live = RecordKey::new(scope.clone(), "live");
    let _running = execute(h.engine.begin(live.clone(), fp("a"), &policy()).await);
    assert_eq!(
        h.engine
            .forget(&scope, "live", Forgettable::Anything)
            .await
            .expect("forget"),
        Forgotten::Deleted(StateKind::InFlight)
    );

    // Fenced: a record that changed since it was read is not deleted.
    let moving = RecordKey::new(scope.clone(), "moving");
    let guard = execute(h.engine.begin(moving.clone(), fp("a"), &policy()).await);
    let stale = h
        .engine
        .inspect(&scope, "moving")
        .await
        .expect("inspect")
        .expect("record");
    guard.complete(&response("m")).await.expect("complete");
    let deleted = h
        .store
        .forget(&moving, stale.record.token, StateKind::InFlight)
        .await
        .expect("forget");
    assert!(!deleted, "a completion since the read fences the delete");
    assert_eq!(
        h.get(&moving).await.expect("kept").token,
        stale.record.token
    );
}

/// Erasing a scope deletes every record of it, whatever its state, responses included, and no
/// record of another scope; a scope longer than the stored bound is named as the application gave
/// it.
pub async fn erase_removes_one_scope_and_no_other<B: Backend>(b: B) {
    let h = harness(&b).await;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let erased = format!("erased-{tag}");
    let long = format!("long-{tag}-{}", "x".repeat(400));
    let kept = format!("kept-{tag}");
    for scope in [&erased, &long, &kept] {
        for (i, end) in ["complete", "release", "hold"].iter().enumerate() {
            let key = RecordKey::new(scope.clone(), format!("k{i}"));
            let guard = execute(h.engine.begin(key, fp("a"), &policy()).await);
            match *end {
                "complete" => guard.complete(&response("secret")).await.expect("complete"),
                "release" => guard.release().await.expect("release"),
                _ => std::mem::forget(guard),
            }
        }
    }
    assert_eq!(h.engine.erase(&erased).await.expect("erase"), 3);
    assert_eq!(h.engine.erase(&long).await.expect("erase"), 3);
    for i in 0..3 {
        for scope in [&erased, &long] {
            let key = RecordKey::new(scope.clone(), format!("k{i}"));
            assert!(h.get(&key).await.is_none(), "{scope}/k{i} erased");
        }
        let key = RecordKey::new(kept.clone(), format!("k{i}"));
        assert!(h.get(&key).await.is_some(), "another scope's k{i} kept");
    }
    assert_eq!(h.engine.erase(&erased).await.expect("erase"), 0);
}

/// Claims in flight for longer than an age are listed oldest first, with their keys as stored;
/// younger claims and finished records are not. The store's counts follow each state.
pub async fn in_flight_claims_are_listed_and_counted<B: Backend>(b: B) {
    use idem_runtime::store::StateKind;
    let h = harness(&b).await;
    let scope = format!("stuck-{}", uuid::Uuid::new_v4());
    let long = format!("{scope}{}", "y".repeat(400));
    let first = execute(
        h.engine
            .begin(RecordKey::new(scope.clone(), "a"), fp("a"), &policy())
            .await,
    );
    h.clock.advance(Duration::from_secs(1));
    let second = execute(
        h.engine
            .begin(RecordKey::new(long.clone(), "b"), fp("a"), &policy())
            .await,
    );
    execute(
        h.engine
            .begin(RecordKey::new(scope.clone(), "done"), fp("a"), &policy())
            .await,
    )
    .complete(&response("d"))
    .await
    .expect("complete");
    execute(
        h.engine
            .begin(RecordKey::new(scope.clone(), "gone"), fp("a"), &policy())
            .await,
    )
    .release()
    .await
    .expect("release");
    h.clock.advance(Duration::from_secs(60));
    let young = execute(
        h.engine
            .begin(RecordKey::new(scope.clone(), "young"), fp("a"), &policy())
            .await,
    );
    let (listed, now) = h
        .engine
        .in_flight(Duration::from_secs(30), 100)
        .await
        .expect("list");
    assert_eq!(now, T0 + Duration::from_secs(61));
    let keys: Vec<&RecordKey> = listed.iter().map(|l| &l.key).collect();
    assert_eq!(
        keys,
        [
            &RecordKey::new(scope.clone(), "a"),
            &RecordKey::new(long.clone(), "b")
        ],
        "the old claims, oldest first"
    );
    assert_eq!(listed[0].record.token, first.token());
    assert_eq!(listed[1].record.token, second.token());
    assert!(listed
        .iter()
        .all(|l| StateKind::of(&l.record.state) == StateKind::InFlight));
    let (one, _) = h.engine.in_flight(Duration::ZERO, 1).await.expect("list");
    assert_eq!(one.len(), 1, "the limit holds");
    let stats = h.engine.stats().await.expect("stats");
    assert_eq!(
        (
            stats.in_flight,
            stats.completed,
            stats.released,
            stats.expired
        ),
        (3, 1, 1, 0),
        "{stats:?}"
    );
    assert_eq!(stats.oldest_in_flight, Some(T0));
    drop(young);
}

struct ArcPurge<S>(Arc<Observed<S>>);

#[async_trait::async_trait]
impl<S: Store + Purge> Purge for ArcPurge<S> {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.0.inner.purge_expired(batch).await
    }
}

/// Expands to one `#[tokio::test]` per conformance case for the backend that `$make` (an async fn
/// returning an `impl Backend`) yields, each case carrying the optional attribute.
#[macro_export]
macro_rules! conformance_suite {
    ($make:path $(, #[$attr:meta])?) => {
        $crate::conformance_suite!(@cases $make; [$(#[$attr])?];
            new_key_executes_then_replays,
            stored_response_round_trips,
            different_request_is_a_mismatch,
            duplicate_waits_then_replays,
            in_flight_at_the_bound_is_a_conflict,
            dead_worker_is_taken_over_and_fenced,
            expired_key_is_a_tombstone_until_purged,
            expired_in_flight_key_is_not_taken_over,
            forgotten_record_is_replaced_without_a_sweep,
            unreachable_store_is_unavailable,
            concurrent_claims_elect_exactly_one,
            keys_are_scoped_to_the_caller,
            release_lets_the_next_request_run,
            dropped_claim_is_released_only_on_a_panic,
            renewal_moves_the_lease_of_the_current_claim_only,
            a_lost_record_is_claimed_back_by_its_completion,
            completion_requires_the_current_token,
            long_scopes_and_keys_stay_within_the_stores_limits,
            restart_keeps_records,
            purge_deletes_in_batches,
            a_new_record_under_the_same_key_gets_a_new_downstream_key,
            skewed_instance_clocks_change_nothing,
            a_claim_whose_request_was_dropped_is_released,
            an_operator_sees_and_forgets_records,
            erase_removes_one_scope_and_no_other,
            in_flight_claims_are_listed_and_counted,
        );
    };
    // The attribute travels as one token tree, so that it can be repeated for every case.
    (@cases $make:path; $attrs:tt; $($case:ident),* $(,)?) => {
        $($crate::conformance_suite!(@case $make; $attrs; $case);)*
    };
    (@case $make:path; [$($attr:tt)*]; $case:ident) => {
        $($attr)*
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            $crate::conformance::$case($make().await).await;
        }
    };
}
