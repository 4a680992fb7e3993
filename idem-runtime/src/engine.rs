//! The claim / replay state machine.
//!
//! [`Engine::begin`] turns one request (scope, key, fingerprint, policy) into exactly one decision:
//!
//! | store finds | decision |
//! |---|---|
//! | nothing, or a record past retention | [`Begin::Execute`]: run the handler, then complete or release |
//! | completed, same fingerprint, not expired | [`Begin::Replay`] |
//! | same key, different fingerprint | [`Rejection::Mismatch`] |
//! | in flight, same fingerprint | wait (woken by the completion), then replay; [`Rejection::InFlight`] at the bound |
//! | in flight, lease run out, same fingerprint | [`Begin::Execute`], taken over with a new fencing token |
//! | past `expires_at`, within retention | [`Rejection::Expired`] |
//! | store error or timeout | [`Rejection::Unavailable`]: the handler never runs |
//!
//! See `docs/semantics.md` for the state diagram and the HTTP meaning of each outcome.
//!
//! ```
//! use idem_runtime::{Begin, Engine, Fingerprint, Policy, RecordKey, StoredResponse};
//! use idem_runtime::store::memory::MemoryStore;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let engine = Engine::new(MemoryStore::new());
//! let key = RecordKey::new("user-7", "order-42");
//! let fp = Fingerprint::of_request("POST", "/orders", None, b"two apples");
//! let policy = Policy::new();
//!
//! match engine.begin(key.clone(), fp, &policy).await.unwrap() {
//!     Begin::Execute(claim) => {
//!         let response = StoredResponse { status: 201, headers: vec![], body: "created".into() };
//!         claim.complete(&response).await.unwrap();
//!     }
//!     Begin::Replay(_) => unreachable!("a new key runs"),
//! }
//! // The retry replays.
//! let Begin::Replay(replay) = engine.begin(key, fp, &policy).await.unwrap() else { panic!() };
//! assert_eq!(replay.response.status, 201);
//! # }
//! ```

use crate::clock::{Clock, SystemClock, Timestamp};
use crate::fingerprint::Fingerprint;
use crate::metrics::{Metrics, Outcome};
use crate::policy::Policy;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use crate::store::{Claim, ClaimOutcome, Store, StoreError};
use crate::wait::{DuplicateWait, Timers};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

/// The `Retry-After` hint of an in-flight conflict (see [`Rejection::InFlight`]).
pub(crate) const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The idempotency engine: a store, a clock and counters. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// Aligned so that the `Arc`'s reference counts have a cache line to themselves: every request
/// clones the engine out of the router state and drops it, on whichever core it runs, and those
/// writes would otherwise evict the store and clock pointers every request reads from the other
/// cores' caches. The counters keep lines of their own too (see [`Metrics`]).
#[repr(align(128))]
struct Inner {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    metrics: Metrics,
    store_timeout: Option<Duration>,
    unavailable_retry_after: Duration,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("store_timeout", &self.inner.store_timeout)
            .finish_non_exhaustive()
    }
}

/// What to do with a request.
#[derive(Debug)]
pub enum Begin {
    /// This request holds the key: run the handler, then [`ClaimGuard::complete`] or
    /// [`ClaimGuard::release`].
    Execute(ClaimGuard),
    /// The key was completed by an earlier identical request: answer with this.
    Replay(Replay),
}

/// A stored response to send again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// The stored response.
    pub response: StoredResponse,
    /// Until when the key is remembered.
    pub expires_at: Timestamp,
}

/// Why a request must not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    /// The key was used for a different request (another body, method or path). Never retry this key.
    #[error("this Idempotency-Key was already used for a different request")]
    Mismatch {
        /// When the key stops being remembered.
        expires_at: Timestamp,
    },
    /// An identical request holds the key and did not finish within the wait bound. Retry later with
    /// the same key.
    #[error("a request with this Idempotency-Key is still being processed")]
    InFlight {
        /// A hint for `Retry-After`: one second. Not the lease's end: that bounds when a dead holder
        /// can be taken over, not when a live one finishes, and a 30 s hint would push a client past
        /// its own deadline. The retry then waits up to `wait` on the server for the original.
        retry_after: Duration,
    },
    /// The key is past its ttl. Decide whether to send the request again under a new key.
    #[error("this Idempotency-Key has expired")]
    Expired {
        /// When it expired.
        expired_at: Timestamp,
    },
    /// The store could not be reached; nothing ran. Retry later with the same key.
    #[error("the idempotency store is unavailable")]
    Unavailable {
        /// A hint for `Retry-After`.
        retry_after: Duration,
        /// What failed.
        #[source]
        source: StoreError,
    },
}

impl Engine {
    /// An engine over `store`, on the system clock, with a 5 s store timeout.
    pub fn new(store: impl Store) -> Self {
        Self::from_arc(Arc::new(store))
    }

    /// An engine over a shared store.
    pub fn from_arc(store: Arc<dyn Store>) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                clock: Arc::new(SystemClock),
                metrics: Metrics::default(),
                store_timeout: Some(Duration::from_secs(5)),
                unavailable_retry_after: Duration::from_secs(1),
            }),
        }
    }

    fn rebuild(self, f: impl FnOnce(&mut Inner)) -> Self {
        let old = match Arc::try_unwrap(self.inner) {
            Ok(inner) => inner,
            Err(shared) => Inner {
                store: shared.store.clone(),
                clock: shared.clock.clone(),
                metrics: Metrics::default(),
                store_timeout: shared.store_timeout,
                unavailable_retry_after: shared.unavailable_retry_after,
            },
        };
        let mut inner = old;
        f(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// Uses `clock` for all record times (tests use [`ManualClock`](crate::clock::ManualClock)).
    pub fn with_clock(self, clock: impl Clock) -> Self {
        self.rebuild(|i| i.clock = Arc::new(clock))
    }

    /// Bounds every store call; a call that takes longer counts as the store being unavailable.
    /// `None` disables the bound (do that under tokio's paused test clock with a store that does real
    /// I/O, or auto-advancing time will fire the timeout).
    pub fn with_store_timeout(self, timeout: Option<Duration>) -> Self {
        self.rebuild(|i| i.store_timeout = timeout)
    }

    /// The `Retry-After` hint sent when the store is unavailable (default 1 s).
    pub fn with_unavailable_retry_after(self, after: Duration) -> Self {
        self.rebuild(|i| i.unavailable_retry_after = after)
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The store, to call: a method called on the `Arc` itself would resolve to the `Store for
    /// Arc<S>` impl, which boxes the store's future a second time on every call.
    pub(crate) fn store_ref(&self) -> &dyn Store {
        self.inner.store.as_ref()
    }

    /// The current time on the engine's clock.
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// The decision counters.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The bound on each store call, if any (transactional mode bounds its own calls with it).
    #[cfg(any(feature = "sqlite", feature = "postgres"))]
    pub(crate) fn store_timeout(&self) -> Option<Duration> {
        self.inner.store_timeout
    }

    /// The `Retry-After` hint for an unavailable store (the HTTP layer's failed-commit answer).
    #[cfg(all(feature = "axum", any(feature = "sqlite", feature = "postgres")))]
    pub(crate) fn unavailable_retry_after(&self) -> Duration {
        self.inner.unavailable_retry_after
    }

    pub(crate) fn record(&self, outcome: Outcome, key: &RecordKey, policy: &Policy) {
        self.inner.metrics.record(outcome);
        match outcome {
            Outcome::Executed | Outcome::Replayed | Outcome::Waited => tracing::debug!(
                target: "idem", outcome = outcome.as_str(), handler = policy.handler,
                scope = %key.scope, key = %key.key, "idempotency decision"
            ),
            Outcome::Unavailable | Outcome::CompletionFailed => tracing::warn!(
                target: "idem", outcome = outcome.as_str(), handler = policy.handler,
                scope = %key.scope, key = %key.key, "idempotency decision"
            ),
            _ => tracing::info!(
                target: "idem", outcome = outcome.as_str(), handler = policy.handler,
                scope = %key.scope, key = %key.key, "idempotency decision"
            ),
        }
    }

    /// Runs one store call under the engine's store timeout. The timer is armed only once the call
    /// has to wait: a call that is ready when first polled never touches tokio's timer wheel. It is
    /// boxed when armed: only a store that answers later arms it (a network round trip, beside
    /// which one allocation is nothing), and inline its 112 bytes would be part of every request's
    /// future. A store that answers on the spot (the memory store, through [`Store::claim_now`]
    /// and [`Store::complete_now`]) is not called through here: it has nothing to wait for.
    ///
    /// A plain function around an `async move` block, so that `self` is not kept in the future.
    #[allow(clippy::manual_async_fn)]
    pub(crate) fn call<T>(
        &self,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> impl Future<Output = Result<T, StoreError>> {
        let limit = self.inner.store_timeout;
        async move {
            let Some(limit) = limit else {
                return fut.await;
            };
            let mut fut = std::pin::pin!(fut);
            let mut timer: Option<Pin<Box<tokio::time::Sleep>>> = None;
            std::future::poll_fn(move |cx| {
                if let Poll::Ready(result) = fut.as_mut().poll(cx) {
                    return Poll::Ready(result);
                }
                let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(StoreError::unavailable(format!(
                        "no answer within the store timeout ({limit:?})"
                    )))),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await
        }
    }

    pub(crate) fn unavailable(
        &self,
        source: StoreError,
        key: &RecordKey,
        policy: &Policy,
    ) -> Rejection {
        self.record(Outcome::Unavailable, key, policy);
        tracing::warn!(target: "idem", error = %source, "idempotency store call failed");
        Rejection::Unavailable {
            retry_after: self.inner.unavailable_retry_after,
            source,
        }
    }

    /// Decides what to do with one request: claim the key and run, replay, or reject. Waits up to
    /// `policy.wait` for an identical in-flight request, woken by its completion.
    pub fn begin<'a>(
        &'a self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &'a Policy,
    ) -> impl Future<Output = Result<Begin, Rejection>> + 'a {
        begin_with(self, key, fingerprint, policy, Timers::Tokio)
    }

    /// [`begin`](Self::begin) on an engine the caller gives away: the claim takes it over instead of
    /// a clone (the HTTP layer's request owns the engine it took from the router state, and needs it
    /// no longer once the decision is made).
    #[cfg(feature = "axum")]
    pub(crate) fn begin_owned(
        self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
    ) -> impl Future<Output = Result<Begin, Rejection>> + '_ {
        begin_with(self, key, fingerprint, policy, Timers::Tokio)
    }

    /// [`begin`](Self::begin) with time standing still: a duplicate waits until the store wakes it,
    /// however long that takes (never at a lease end or at `policy.wait`, which must not be zero).
    /// Only the loom models (`tests/loom.rs`) use it, on an engine built
    /// [`with_store_timeout(None)`](Self::with_store_timeout): loom cannot drive tokio's timers, and
    /// without them a lost wake-up shows as a deadlock instead of a late timer.
    #[cfg(loom)]
    #[doc(hidden)]
    pub async fn begin_without_timers(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
    ) -> Result<Begin, Rejection> {
        let frozen = Timers::Frozen(tokio::time::Instant::from_std(std::time::Instant::now()));
        begin_with(self, key, fingerprint, policy, frozen).await
    }
}

/// The engine a decision is made on: borrowed ([`Engine::begin`]; the claim gets a clone) or owned
/// ([`Engine::begin_owned`]; the claim gets it).
trait EngineHandle {
    fn engine(&self) -> &Engine;
    fn into_engine(self) -> Engine;
}

impl EngineHandle for &Engine {
    fn engine(&self) -> &Engine {
        self
    }

    fn into_engine(self) -> Engine {
        self.clone()
    }
}

impl EngineHandle for Engine {
    fn engine(&self) -> &Engine {
        self
    }

    fn into_engine(self) -> Engine {
        self
    }
}

/// [`Engine::begin`] on `handle`'s engine. A plain function around an `async move` block, not an
/// `async fn`: an `async fn` keeps its arguments twice in its future (as arguments and as locals),
/// and this future is part of every request's.
///
/// The duplicate's wait bound (`policy.wait`) starts when the key is first found in flight, so a
/// request that claims or replays never reads tokio's clock.
#[allow(clippy::manual_async_fn)]
fn begin_with<'a, H: EngineHandle + 'a>(
    handle: H,
    key: RecordKey,
    fingerprint: Fingerprint,
    policy: &'a Policy,
    timers: Timers,
) -> impl Future<Output = Result<Begin, Rejection>> + 'a {
    async move {
        let mut deadline = None;
        let mut wait = DuplicateWait::default();
        loop {
            let engine = handle.engine();
            let now = engine.inner.clock.now();
            let claim = Claim::fresh(&key, fingerprint, now, policy);
            let store = engine.store_ref();
            let answer = match store.claim_now(&claim) {
                Some(answer) => answer,
                None => engine.call(store.claim(&claim)).await,
            };
            let found = match answer {
                Ok(ClaimOutcome::Claimed { taken_over }) => {
                    engine.record(Outcome::of_claim(taken_over), &key, policy);
                    return Ok(Begin::Execute(ClaimGuard {
                        engine: handle.into_engine(),
                        expires_at: claim.expires_at,
                        token: claim.token,
                        key,
                        taken_over,
                        armed: true,
                        handler: policy.handler,
                    }));
                }
                Ok(ClaimOutcome::Existing(record)) => record,
                Err(e) => return Err(engine.unavailable(e, &key, policy)),
            };
            match classify(found, fingerprint, now) {
                Found::Expired { expires_at } => {
                    engine.record(Outcome::Expired, &key, policy);
                    return Err(Rejection::Expired {
                        expired_at: expires_at,
                    });
                }
                Found::Mismatch { expires_at } => {
                    engine.record(Outcome::Mismatch, &key, policy);
                    return Err(Rejection::Mismatch { expires_at });
                }
                Found::Completed {
                    response,
                    expires_at,
                } => {
                    if wait.waited() {
                        engine.record(Outcome::Waited, &key, policy);
                    }
                    engine.record(Outcome::Replayed, &key, policy);
                    return Ok(Begin::Replay(Replay {
                        response,
                        expires_at,
                    }));
                }
                Found::InFlight { lease_until } => {
                    let lease_left = now.until(lease_until);
                    let at = timers.now();
                    let deadline = *deadline.get_or_insert(at + policy.wait);
                    if at >= deadline {
                        engine.record(Outcome::Conflict, &key, policy);
                        return Err(Rejection::InFlight {
                            retry_after: IN_FLIGHT_RETRY_AFTER,
                        });
                    }
                    // Wake on completion or release, when the lease runs out (takeover), or at
                    // the deadline; never on a polling tick.
                    let wake = deadline.min(at + lease_left);
                    // Boxed: waiting is the rare path, and its timers and subscription inline would
                    // make every request's future (and the allocation axum boxes it in) larger.
                    if let Err(e) = Box::pin(wait.step(engine, store, &key, wake, timers)).await {
                        return Err(engine.unavailable(e, &key, policy));
                    }
                }
            }
        }
    }
}

pub(crate) enum Found {
    Expired {
        expires_at: Timestamp,
    },
    Mismatch {
        expires_at: Timestamp,
    },
    Completed {
        response: StoredResponse,
        expires_at: Timestamp,
    },
    InFlight {
        lease_until: Timestamp,
    },
}

/// The order matters: an expired key is dead whatever it held; a different request never sees the
/// original's response or waits for it. Takes the record by value so that a replay moves the stored
/// response out instead of cloning it.
pub(crate) fn classify(record: Record, fingerprint: Fingerprint, now: Timestamp) -> Found {
    let expires_at = record.expires_at;
    if now >= expires_at {
        Found::Expired { expires_at }
    } else if record.fingerprint != fingerprint {
        Found::Mismatch { expires_at }
    } else {
        match record.state {
            RecordState::Completed { response } => Found::Completed {
                response,
                expires_at,
            },
            RecordState::InFlight { lease_until } => Found::InFlight { lease_until },
        }
    }
}

/// The right to run the handler for one key. Complete it with the response, or release it so that a
/// retry runs again. Dropped without either (a panic, a cancelled request), it releases the claim in
/// the background, so a retry does not wait for the lease.
#[derive(Debug)]
pub struct ClaimGuard {
    engine: Engine,
    key: RecordKey,
    token: FencingToken,
    expires_at: Timestamp,
    taken_over: bool,
    armed: bool,
    handler: &'static str,
}

impl ClaimGuard {
    /// The claimed key.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// This claim's fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Until when the key will be remembered.
    pub fn expires_at(&self) -> Timestamp {
        self.expires_at
    }

    /// Whether this claim took over a dead worker's.
    pub fn taken_over(&self) -> bool {
        self.taken_over
    }

    /// Stores `response` for replay and wakes waiting duplicates. Fails with
    /// [`StoreErrorKind::Fenced`](crate::store::StoreErrorKind::Fenced) if the lease ran out and
    /// another request took the key over; the response is then not stored.
    pub fn complete(
        mut self,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<(), StoreError>> + '_ {
        self.armed = false;
        async move {
            let store = self.engine.store_ref();
            let result = match store.complete_now(&self.key, self.token, response) {
                Some(result) => result,
                None => {
                    self.engine
                        .call(store.complete(&self.key, self.token, response))
                        .await
                }
            };
            self.completed(result)
        }
    }

    fn completed(&self, result: Result<(), StoreError>) -> Result<(), StoreError> {
        if let Err(e) = &result {
            self.engine.inner.metrics.record(Outcome::CompletionFailed);
            tracing::warn!(target: "idem", handler = self.handler, scope = %self.key.scope,
                key = %self.key.key, error = %e, "response could not be stored");
        }
        result
    }

    /// Gives the key up: the record is deleted and the next request with this key runs the handler.
    pub fn release(mut self) -> impl Future<Output = Result<(), StoreError>> {
        self.armed = false;
        self.engine.inner.metrics.record(Outcome::Released);
        async move {
            self.engine
                .call(self.engine.store_ref().release(&self.key, self.token))
                .await
        }
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.engine.inner.metrics.record(Outcome::Released);
        let store = self.engine.inner.store.clone();
        let key = std::mem::replace(&mut self.key, RecordKey::new("", ""));
        let token = self.token;
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.as_ref().release(&key, token).await {
                    tracing::debug!(target: "idem", error = %e, "background release failed; the lease will run out");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::store::memory::MemoryStore;
    use tokio::time::Instant;

    /// Record time that follows tokio's (paused) clock, so lease expiry and tokio sleeps agree.
    struct TokioClock {
        base: Timestamp,
        start: Instant,
    }

    impl Clock for TokioClock {
        fn now(&self) -> Timestamp {
            self.base + self.start.elapsed()
        }
    }

    fn fp() -> Fingerprint {
        Fingerprint::of_request("POST", "/x", None, b"x")
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![],
            body: "done".into(),
        }
    }

    async fn until_waiting(store: &MemoryStore) {
        while store.waiting_keys() == 0 {
            tokio::task::yield_now().await;
        }
    }

    /// A store that answers claims and completions only on the spot: its `claim` and `complete`
    /// fail, so a request that succeeds went through `claim_now` and `complete_now`.
    struct OnTheSpot(MemoryStore);

    #[async_trait::async_trait]
    impl Store for OnTheSpot {
        async fn claim(&self, _: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
            Err(StoreError::unavailable("claim called"))
        }
        fn claim_now(&self, claim: &Claim<'_>) -> Option<Result<ClaimOutcome, StoreError>> {
            self.0.claim_now(claim)
        }
        async fn complete(
            &self,
            _: &RecordKey,
            _: FencingToken,
            _: &StoredResponse,
        ) -> Result<(), StoreError> {
            Err(StoreError::unavailable("complete called"))
        }
        fn complete_now(
            &self,
            key: &RecordKey,
            token: FencingToken,
            response: &StoredResponse,
        ) -> Option<Result<(), StoreError>> {
            self.0.complete_now(key, token, response)
        }
        async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
            self.0.release(key, token).await
        }
        async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
            self.0.get(key, now).await
        }
        fn subscribe(&self, key: &RecordKey) -> crate::store::Subscription {
            self.0.subscribe(key)
        }
    }

    #[tokio::test]
    async fn a_store_that_answers_on_the_spot_is_called_on_the_spot() {
        let engine = Engine::new(OnTheSpot(MemoryStore::new()));
        let policy = Policy::new();
        let key = RecordKey::new("s", "k");
        let Ok(Begin::Execute(guard)) = engine.begin(key.clone(), fp(), &policy).await else {
            panic!("the first request executes")
        };
        guard
            .complete(&response())
            .await
            .expect("completed on the spot");
        let Ok(Begin::Replay(replay)) = engine.begin(key, fp(), &policy).await else {
            panic!("the retry replays")
        };
        assert_eq!(replay.response.body, response().body);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_duplicate_is_woken_by_the_completion_not_by_time() {
        let store = Arc::new(MemoryStore::new());
        let engine =
            Engine::from_arc(store.clone()).with_clock(ManualClock::new(Timestamp::from_millis(0)));
        let policy = Policy::new().wait(Duration::from_secs(60));
        let key = RecordKey::new("s", "k");
        let Ok(Begin::Execute(guard)) = engine.begin(key.clone(), fp(), &policy).await else {
            panic!("first request executes")
        };
        let start = Instant::now();
        let e = engine.clone();
        let k = key.clone();
        let duplicate = tokio::spawn(async move { e.begin(k, fp(), &policy).await });
        until_waiting(&store).await;
        guard.complete(&response()).await.unwrap();
        let Ok(Begin::Replay(replay)) = duplicate.await.unwrap() else {
            panic!("the duplicate replays")
        };
        assert_eq!(replay.response, response());
        // The paused clock did not move: the wake-up came from the completion, not a timer or a poll.
        assert_eq!(Instant::now(), start);
        assert_eq!(engine.metrics().get(Outcome::Waited), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_duplicate_takes_over_when_the_lease_runs_out() {
        let store = Arc::new(MemoryStore::new());
        let start = Instant::now();
        let clock = TokioClock {
            base: Timestamp::from_millis(1_000_000),
            start,
        };
        let engine = Engine::from_arc(store.clone()).with_clock(clock);
        let policy = Policy::new()
            .lease(Duration::from_secs(5))
            .wait(Duration::from_secs(60));
        let key = RecordKey::new("s", "k");
        let Ok(Begin::Execute(dead)) = engine.begin(key.clone(), fp(), &policy).await else {
            panic!("first request executes")
        };
        std::mem::forget(dead); // the worker dies without releasing
        let Ok(Begin::Execute(heir)) = engine.begin(key, fp(), &policy).await else {
            panic!("the duplicate takes over")
        };
        assert!(heir.taken_over());
        // It woke exactly when the lease ran out, not at the 60 s bound and not on a polling tick.
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn the_wait_is_bounded_and_ends_in_a_conflict() {
        let store = Arc::new(MemoryStore::new());
        let engine = Engine::from_arc(store.clone());
        let policy = Policy::new().wait(Duration::from_secs(3));
        let key = RecordKey::new("s", "k");
        let Ok(Begin::Execute(_held)) = engine.begin(key.clone(), fp(), &policy).await else {
            panic!("first request executes")
        };
        let start = Instant::now();
        match engine.begin(key, fp(), &policy).await {
            Err(Rejection::InFlight { retry_after }) => {
                assert!(retry_after >= Duration::from_secs(1))
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        assert_eq!(engine.metrics().get(Outcome::Conflict), 1);
    }
}
