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
//! A [`ClaimGuard`] keeps its claim alive while the handler runs ([`ClaimGuard::keep_alive`] renews
//! the lease every third of it), and [`ClaimGuard::complete`] keeps trying to store the response
//! until the store takes it. See `docs/semantics.md` for the state diagram and the HTTP meaning of
//! each outcome.
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
//!         // The work runs while the claim's lease is renewed.
//!         let body = claim.keep_alive(async { "created" }).await;
//!         let response = StoredResponse { status: 201, headers: vec![], body: body.into() };
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
use crate::store::{Claim, ClaimOutcome, Claimed, Found, Store, StoreError, StoreErrorKind};
use crate::wait::{DuplicateWait, Timers};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// The `Retry-After` hint of an in-flight conflict (see [`Rejection::InFlight`]).
pub(crate) const IN_FLIGHT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// How long a failed completion waits before its next attempt, at first and at most.
const COMPLETION_BACKOFF: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(5));

/// The idempotency engine: a store, a clock, counters and the set of handlers it runs. Cheap to
/// clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    store: Arc<dyn Store>,
    clock: Arc<dyn Clock>,
    metrics: Arc<Metrics>,
    store_timeout: Option<Duration>,
    unavailable_retry_after: Duration,
    /// The claimed handlers running detached ([`Engine::spawn`]), for [`Engine::shutdown`].
    tasks: TaskTracker,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("store_timeout", &self.inner.store_timeout)
            .field("running", &self.inner.tasks.len())
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
        /// can be taken over, not when a live one finishes. The retry then waits up to `wait` on the
        /// server for the original.
        retry_after: Duration,
    },
    /// The key is past its ttl. Decide whether to send the request again under a new key.
    #[error("this Idempotency-Key has expired")]
    Expired {
        /// When it expired.
        expired_at: Timestamp,
    },
    /// The store could not be reached, had no free connection ([`StoreErrorKind::Busy`]), or the
    /// engine is shutting down; nothing ran. Retry later with the same key.
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
                metrics: Arc::default(),
                store_timeout: Some(Duration::from_secs(5)),
                unavailable_retry_after: Duration::from_secs(1),
                tasks: TaskTracker::new(),
            }),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Inner)) -> Self {
        f(Arc::make_mut(&mut self.inner));
        self
    }

    /// Uses `clock` for all record times (tests use [`ManualClock`](crate::clock::ManualClock)).
    pub fn with_clock(self, clock: impl Clock) -> Self {
        self.with(|i| i.clock = Arc::new(clock))
    }

    /// Bounds every store call; a call that takes longer counts as the store being unavailable.
    /// `None` disables the bound (do that under tokio's paused test clock with a store that does real
    /// I/O, or auto-advancing time will fire the timeout).
    pub fn with_store_timeout(self, timeout: Option<Duration>) -> Self {
        self.with(|i| i.store_timeout = timeout)
    }

    /// The `Retry-After` hint sent when the store is unavailable (default 1 s).
    pub fn with_unavailable_retry_after(self, after: Duration) -> Self {
        self.with(|i| i.unavailable_retry_after = after)
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.inner.store
    }

    /// The current time on the engine's clock.
    pub fn now(&self) -> Timestamp {
        self.inner.clock.now()
    }

    /// The decision counters.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// The `Retry-After` hint for an unavailable store.
    pub fn unavailable_retry_after(&self) -> Duration {
        self.inner.unavailable_retry_after
    }

    /// Runs `work` as a task of its own, in the current tracing span, counted among the handlers
    /// [`shutdown`](Self::shutdown) waits for. The HTTP layer runs every claimed handler this way,
    /// so that a client hanging up cannot cancel it half-way.
    pub fn spawn<F>(&self, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.inner
            .tasks
            .spawn(work.instrument(tracing::Span::current()))
    }

    /// Stops taking new claims (they are answered [`Rejection::Unavailable`], a 503 the client
    /// retries elsewhere) and waits up to `grace` for the handlers already running, and their
    /// completions, to finish. Returns whether they all did. Call it after the server stopped
    /// accepting connections (axum's `with_graceful_shutdown`), before the process exits.
    pub async fn shutdown(&self, grace: Duration) -> bool {
        self.inner.tasks.close();
        tokio::time::timeout(grace, self.inner.tasks.wait())
            .await
            .is_ok()
    }

    pub(crate) fn record(&self, outcome: Outcome, key: &RecordKey, policy: &Policy) {
        self.inner.metrics.record(outcome, policy.handler);
        let (outcome, handler) = (outcome.as_str(), policy.handler);
        match outcome {
            "executed" | "replayed" | "waited" => tracing::debug!(target: "idem", outcome,
                handler, scope = %key.scope(), key = %key.key(), "idempotency decision"),
            "unavailable" | "busy" => tracing::warn!(target: "idem", outcome, handler,
                scope = %key.scope(), key = %key.key(), "idempotency decision"),
            _ => tracing::info!(target: "idem", outcome, handler, scope = %key.scope(),
                key = %key.key(), "idempotency decision"),
        }
    }

    /// Runs one store call under the engine's store timeout.
    pub(crate) async fn call<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let started = std::time::Instant::now();
        let result = match self.inner.store_timeout {
            Some(limit) => tokio::time::timeout(limit, fut).await.unwrap_or_else(|_| {
                Err(StoreError::unavailable(format!(
                    "no answer within the store timeout ({limit:?})"
                )))
            }),
            None => fut.await,
        };
        let store = self.inner.store.kind();
        self.inner.metrics.store_call(store, op, started.elapsed());
        result
    }

    pub(crate) fn unavailable(
        &self,
        source: StoreError,
        key: &RecordKey,
        policy: &Policy,
    ) -> Rejection {
        let outcome = match source.kind() {
            StoreErrorKind::Busy => Outcome::Busy,
            _ => Outcome::Unavailable,
        };
        self.record(outcome, key, policy);
        tracing::warn!(target: "idem", error = %source, "idempotency store call failed");
        Rejection::Unavailable {
            retry_after: self.inner.unavailable_retry_after,
            source,
        }
    }

    /// One claim, run to its end in a task of its own (on the engine's task set, so that
    /// [`shutdown`](Self::shutdown) waits for it): a caller that stops waiting for it (its request
    /// dropped by a client that hung up, or the store timeout) never leaves the key claimed by
    /// nobody, since a claim that wins after its caller left, or fails and may have landed
    /// unseen, is released at once, which lets the retry resume it without waiting for a lease.
    /// Outside a Tokio runtime it runs inline.
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return self.call("claim", self.inner.store.claim(claim)).await;
        };
        let (store, key) = (self.inner.store.clone(), claim.key.clone());
        let tasks = self.inner.tasks.clone();
        let Claim {
            fingerprint,
            token,
            lease,
            ttl,
            retain,
            ..
        } = *claim;
        let (reply, answer) =
            tokio::sync::oneshot::channel::<(Result<ClaimOutcome, StoreError>, Handoff)>();
        let work = async move {
            let claim = Claim {
                key: &key,
                fingerprint,
                token,
                lease,
                ttl,
                retain,
            };
            let outcome = store.claim(&claim).await;
            // A claim that failed may have landed all the same (its answer lost on the way back):
            // nobody runs it, so give it back, fenced by its token (a claim that did not land
            // changes nothing), before the request hears of it, so that its retry finds the key free.
            if outcome.is_err() {
                give_back(store.as_ref(), &key, token, false).await;
            }
            // A winning claim travels with a handoff that gives it back if nobody takes it: its
            // request may be gone before the answer is sent, or after, with the answer unread.
            let won = matches!(outcome, Ok(ClaimOutcome::Claimed(_)));
            let handoff = Handoff(won.then_some((store, key, token, tasks)));
            let _ = reply.send((outcome, handoff));
        };
        self.inner.tasks.spawn_on(work, &runtime);
        let answer = async {
            match answer.await {
                Ok((outcome, handoff)) => {
                    handoff.taken();
                    outcome
                }
                Err(_) => Err(StoreError::unavailable("the claim's task stopped")),
            }
        };
        self.call("claim", answer).await
    }

    /// Decides what to do with one request: claim the key and run, replay, or reject. Waits up to
    /// `policy.wait` for an identical in-flight request, woken by its completion.
    pub async fn begin(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
    ) -> Result<Begin, Rejection> {
        self.begin_with(key, fingerprint, policy, Timers::Tokio)
            .await
    }

    /// [`begin`](Self::begin) with time standing still: a duplicate waits until the store wakes it,
    /// however long that takes. Only the loom models (`tests/loom.rs`) use it: loom cannot drive
    /// tokio's timers, and without them a lost wake-up shows as a deadlock instead of a late timer.
    #[cfg(loom)]
    #[doc(hidden)]
    pub async fn begin_without_timers(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
    ) -> Result<Begin, Rejection> {
        let frozen = Timers::Frozen(tokio::time::Instant::from_std(std::time::Instant::now()));
        self.begin_with(key, fingerprint, policy, frozen).await
    }

    /// The duplicate's wait bound (`policy.wait`) starts when the key is first found in flight.
    async fn begin_with(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
        timers: Timers,
    ) -> Result<Begin, Rejection> {
        if self.inner.tasks.is_closed() {
            let closing = StoreError::unavailable("the service is shutting down");
            return Err(self.unavailable(closing, &key, policy));
        }
        let store = self.inner.store.as_ref();
        let mut deadline = None;
        let mut wait = DuplicateWait::default();
        let decided = loop {
            let claim = Claim {
                key: &key,
                fingerprint,
                token: FencingToken::generate(),
                lease: policy.lease,
                ttl: policy.ttl,
                retain: policy.retain,
            };
            let Found { record, now } = match self.claim(&claim).await {
                Ok(ClaimOutcome::Claimed(won)) => {
                    let outcome = if won.taken_over {
                        Outcome::TakenOver
                    } else {
                        Outcome::Executed
                    };
                    self.record(outcome, &key, policy);
                    let token = claim.token;
                    break Ok(Begin::Execute(ClaimGuard::new(
                        self.clone(),
                        key,
                        fingerprint,
                        token,
                        won,
                        policy,
                    )));
                }
                Ok(ClaimOutcome::Existing(found)) => found,
                Err(e) => break Err(self.unavailable(e, &key, policy)),
            };
            match classify(record, fingerprint, now) {
                Verdict::Expired { expires_at } => {
                    self.record(Outcome::Expired, &key, policy);
                    break Err(Rejection::Expired {
                        expired_at: expires_at,
                    });
                }
                Verdict::Mismatch { expires_at } => {
                    self.record(Outcome::Mismatch, &key, policy);
                    break Err(Rejection::Mismatch { expires_at });
                }
                Verdict::Completed {
                    response,
                    expires_at,
                } => {
                    if wait.waited() {
                        self.record(Outcome::Waited, &key, policy);
                    }
                    self.record(Outcome::Replayed, &key, policy);
                    break Ok(Begin::Replay(Replay {
                        response,
                        expires_at,
                    }));
                }
                Verdict::InFlight { lease_until } => {
                    let at = timers.now();
                    let deadline = *deadline.get_or_insert(at + policy.wait);
                    if at >= deadline {
                        self.record(Outcome::Conflict, &key, policy);
                        break Err(Rejection::InFlight {
                            retry_after: IN_FLIGHT_RETRY_AFTER,
                        });
                    }
                    // Wake on completion or release, when the lease runs out (takeover), or at
                    // the deadline; never on a polling tick. The lease's remaining time is the
                    // store's (its `now` against its `lease_until`), counted down on this timer.
                    let wake = deadline.min(at + now.until(lease_until));
                    let subscribe = || store.subscribe(&key);
                    let announce = || self.call("announce", store.announce_waiter(&key));
                    if let Err(e) = wait.step(subscribe, announce, wake, timers).await {
                        break Err(self.unavailable(e, &key, policy));
                    }
                }
            }
        };
        if let Some(waited) = wait.waited_for(timers) {
            self.inner.metrics.waited(policy.handler, waited);
        }
        decided
    }
}

/// A won claim on its way to its request: dropped without [`taken`](Self::taken) (its request went
/// away, before or after the answer was sent), it gives the claim back in the background.
struct Handoff(Option<(Arc<dyn Store>, RecordKey, FencingToken, TaskTracker)>);

impl Handoff {
    /// The request has the claim: nothing to give back.
    fn taken(mut self) {
        self.0 = None;
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        let Some((store, key, token, tasks)) = self.0.take() else {
            return;
        };
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let work = async move { give_back(store.as_ref(), &key, token, true).await };
            tasks.spawn_on(work, &runtime);
        }
    }
}

/// Releases a claim nobody will run, trying a few times while the store is unreachable (the
/// connection that lost the claim's answer may be the one that failed). `landed`: the claim is known
/// to hold the key, so a failure to release it is worth a warning.
async fn give_back(store: &dyn Store, key: &RecordKey, token: FencingToken, landed: bool) {
    // Once more at once (a client that lost its connection reconnects on its next call), then once
    // after a pause.
    for (attempt, pause) in [(1, None), (2, None), (3, Some(COMPLETION_BACKOFF.0))] {
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        match store.release(key, token).await {
            Ok(()) => {
                tracing::debug!(target: "idem", scope = %key.scope(), key = %key.key(),
                    "released a claim nobody waited for");
                return;
            }
            Err(error) if error.kind() == StoreErrorKind::Fenced => return,
            Err(error) if attempt == 3 => {
                if landed {
                    tracing::warn!(target: "idem", scope = %key.scope(), key = %key.key(), %error,
                        "could not release a claim its request no longer waited for; a retry can run once its lease runs out");
                }
            }
            Err(_) => {}
        }
    }
}

/// Where a claim stands after the store refused it as not in flight under its token.
enum Standing {
    /// In flight under its token (again).
    Held,
    /// Completed under its token: an earlier attempt whose answer was lost did store it.
    Completed,
    /// Another claim holds the key.
    Lost,
}

pub(crate) enum Verdict {
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
/// original's response or waits for it.
pub(crate) fn classify(record: Record, fingerprint: Fingerprint, now: Timestamp) -> Verdict {
    let expires_at = record.expires_at;
    if now >= expires_at {
        Verdict::Expired { expires_at }
    } else if record.fingerprint != fingerprint {
        Verdict::Mismatch { expires_at }
    } else {
        match record.state {
            RecordState::Completed { response } => Verdict::Completed {
                response,
                expires_at,
            },
            RecordState::InFlight { lease_until } => Verdict::InFlight { lease_until },
            // A conforming store never returns a released record from a claim (the claim resumes or
            // replaces it): treat it as a lease that ran out, so the next claim settles it.
            RecordState::Released => Verdict::InFlight { lease_until: now },
        }
    }
}

/// The right to run the handler for one key. Run the work under [`keep_alive`](Self::keep_alive),
/// then [`complete`](Self::complete) with the response, or [`release`](Self::release) so that a
/// retry runs again.
///
/// Dropped without either while a panic unwinds, it releases the claim in the background. Dropped
/// otherwise (its task aborted, the process stopping) it is left to its lease, as after a crash:
/// the work may have had effects, so a retry takes the key over only once the lease has run out,
/// and sees [`taken_over`](Self::taken_over).
#[derive(Debug)]
pub struct ClaimGuard {
    engine: Engine,
    key: RecordKey,
    fingerprint: Fingerprint,
    token: FencingToken,
    /// The record's creation and expiry, on the store's clock.
    created_at: Timestamp,
    expires_at: Timestamp,
    /// The policy's durations, for renewals and for claiming the record again.
    lease: Duration,
    ttl: Duration,
    retain: Duration,
    taken_over: bool,
    handler: &'static str,
    /// Completed or released: nothing is left to do on drop.
    settled: bool,
}

impl ClaimGuard {
    fn new(
        engine: Engine,
        key: RecordKey,
        fingerprint: Fingerprint,
        token: FencingToken,
        won: Claimed,
        policy: &Policy,
    ) -> Self {
        Self {
            engine,
            key,
            fingerprint,
            token,
            created_at: won.created_at,
            expires_at: won.expires_at,
            lease: policy.lease,
            ttl: policy.ttl,
            retain: policy.retain,
            taken_over: won.taken_over,
            handler: policy.handler,
            settled: false,
        }
    }

    /// The claimed key.
    pub fn key(&self) -> &RecordKey {
        &self.key
    }

    /// This claim's fencing token.
    pub fn token(&self) -> FencingToken {
        self.token
    }

    /// Until when the key is replayed, on the store's clock.
    pub fn expires_at(&self) -> Timestamp {
        self.expires_at
    }

    /// Whether this claim took over the claim of a worker that stopped renewing it (crashed, or
    /// cut off from the store for a whole lease). Its work may have had effects: pass
    /// [`downstream_key`](Self::downstream_key) to every service that accepts an idempotency key.
    pub fn taken_over(&self) -> bool {
        self.taken_over
    }

    /// A key for the services this work calls, the same on every attempt at this record: see
    /// [`RecordKey::downstream_key`].
    pub fn downstream_key(&self) -> String {
        self.key
            .downstream_key(&self.fingerprint, self.created_at, self.expires_at)
    }

    /// Runs `work` while renewing this claim's lease every third of it, so that a duplicate never
    /// takes over a claim whose work is still running, however long it takes. Renewal stops if the
    /// claim was taken over meanwhile (the store refuses it); a renewal the store fails to answer is
    /// logged and tried again at the next tick.
    pub async fn keep_alive<F: Future>(&self, work: F) -> F::Output {
        let every = (self.lease / 3).max(Duration::from_millis(1));
        let renewing = async {
            let mut holding = true;
            loop {
                tokio::time::sleep(every).await;
                if holding {
                    holding = self.renew().await;
                }
            }
        };
        tokio::select! {
            biased;
            out = work => out,
            () = renewing => unreachable!("renewal never ends"),
        }
    }

    /// One renewal; false once the claim is lost for good.
    async fn renew(&self) -> bool {
        let engine = &self.engine;
        let store = engine.inner.store.as_ref();
        match engine
            .call("renew", store.renew(&self.key, self.token, self.lease))
            .await
        {
            Ok(()) => {
                engine.inner.metrics.record(Outcome::Renewed, self.handler);
                true
            }
            Err(e) if e.kind() == StoreErrorKind::Fenced => {
                matches!(self.reclaim().await, Standing::Held)
            }
            Err(e) => {
                tracing::warn!(target: "idem", handler = self.handler, scope = %self.key.scope(),
                    key = %self.key.key(), error = %e, "could not renew the claim's lease");
                true
            }
        }
    }

    /// The store no longer has this claim in flight. If its record vanished (a store that lost its
    /// data) or was released (by a later holder), claims it again under the same token: the work's
    /// effects happened, so its response must be kept. Says where the claim stands now.
    async fn reclaim(&self) -> Standing {
        let engine = &self.engine;
        let store = engine.inner.store.as_ref();
        let found = match engine.call("get", store.get(&self.key)).await {
            Ok(found) => found,
            Err(_) => return Standing::Held,
        };
        match found {
            // The key is dead anyway: it answers "expired" until it is purged.
            Some(Found { now, .. }) if now >= self.expires_at => Standing::Lost,
            // An attempt whose answer was lost had stored the response after all.
            Some(Found { record, .. })
                if record.token == self.token
                    && matches!(record.state, RecordState::Completed { .. }) =>
            {
                Standing::Completed
            }
            Some(Found { record, .. }) if record.state != RecordState::Released => {
                tracing::error!(target: "idem", handler = self.handler, scope = %self.key.scope(),
                    key = %self.key.key(), "the claim was taken over while its work was running (its lease could not be renewed)");
                Standing::Lost
            }
            _ => {
                let claim = Claim {
                    key: &self.key,
                    fingerprint: self.fingerprint,
                    token: self.token,
                    lease: self.lease,
                    ttl: self.ttl,
                    retain: self.retain,
                };
                match engine.call("claim", store.claim(&claim)).await {
                    Ok(ClaimOutcome::Claimed(_)) => {
                        tracing::warn!(target: "idem", handler = self.handler, scope = %self.key.scope(),
                            key = %self.key.key(), "the store lost a running claim's record; claimed it again");
                        Standing::Held
                    }
                    Ok(ClaimOutcome::Existing(_)) => Standing::Lost,
                    Err(_) => Standing::Held,
                }
            }
        }
    }

    /// One attempt to store `response` for replay, waking waiting duplicates. On a failure the
    /// claim is kept, neither completed nor released: call it again, or [`complete`](Self::complete).
    /// Fails with [`StoreErrorKind::Fenced`] if another request took the key over.
    pub async fn try_complete(&self, response: &StoredResponse) -> Result<(), StoreError> {
        let engine = &self.engine;
        let store = engine.inner.store.as_ref();
        let complete = || store.complete(&self.key, self.token, response);
        let mut result = engine.call("complete", complete()).await;
        if result
            .as_ref()
            .is_err_and(|e| e.kind() == StoreErrorKind::Fenced)
        {
            match self.reclaim().await {
                Standing::Held => result = engine.call("complete", complete()).await,
                Standing::Completed => result = Ok(()),
                Standing::Lost => {}
            }
        }
        if let Err(e) = &result {
            engine
                .inner
                .metrics
                .record(Outcome::CompletionFailed, self.handler);
            tracing::warn!(target: "idem", handler = self.handler, scope = %self.key.scope(),
                key = %self.key.key(), error = %e, "response could not be stored");
        }
        result
    }

    /// Stores `response` for replay, retrying with backoff while the store is unavailable and
    /// keeping the lease alive meanwhile, until it lands. The work has had its effects, so its
    /// response must not be lost to a blip: if the process stops before it lands, the record stays
    /// in flight until its lease runs out and a retry then takes it over. Fails only if another
    /// request took the key over ([`StoreErrorKind::Fenced`]) or the record is corrupt.
    pub async fn complete(mut self, response: &StoredResponse) -> Result<(), StoreError> {
        let result = self
            .keep_alive(async {
                let mut backoff = COMPLETION_BACKOFF.0;
                loop {
                    match self.try_complete(response).await {
                        Err(e)
                            if matches!(
                                e.kind(),
                                StoreErrorKind::Unavailable | StoreErrorKind::Busy
                            ) =>
                        {
                            tokio::time::sleep(backoff).await;
                            backoff = (backoff * 2).min(COMPLETION_BACKOFF.1);
                        }
                        result => return result,
                    }
                }
            })
            .await;
        self.settled = true;
        result
    }

    /// Marks the claim as settled elsewhere (completed in a transaction, or given up): nothing is
    /// left to do when it is dropped.
    #[cfg(any(
        feature = "axum",
        feature = "sqlite",
        feature = "postgres",
        feature = "mysql"
    ))]
    pub(crate) fn settle(mut self) {
        self.settled = true;
    }

    /// Gives the key up: the record is deleted and the next request with this key runs the handler.
    pub async fn release(mut self) -> Result<(), StoreError> {
        self.settled = true;
        self.engine
            .inner
            .metrics
            .record(Outcome::Released, self.handler);
        let store = self.engine.inner.store.as_ref();
        self.engine
            .call("release", store.release(&self.key, self.token))
            .await
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if self.settled || !std::thread::panicking() {
            return;
        }
        self.engine
            .inner
            .metrics
            .record(Outcome::Released, self.handler);
        let store = self.engine.inner.store.clone();
        let key = std::mem::replace(&mut self.key, RecordKey::new("", ""));
        let token = self.token;
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.release(&key, token).await {
                    tracing::debug!(target: "idem", error = %e, "background release failed; the lease will run out");
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{ManualClock, TokioClock};
    use crate::store::memory::MemoryStore;
    use tokio::time::Instant;

    fn tokio_clock() -> TokioClock {
        TokioClock::new()
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

    #[tokio::test(start_paused = true)]
    async fn a_waiting_duplicate_is_woken_by_the_completion_not_by_time() {
        let clock = ManualClock::new(Timestamp::from_millis(0));
        let store = Arc::new(MemoryStore::new().with_clock(clock));
        let engine = Engine::from_arc(store.clone());
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
        let store = Arc::new(MemoryStore::new().with_clock(tokio_clock()));
        let start = Instant::now();
        let engine = Engine::from_arc(store.clone());
        let policy = Policy::new()
            .lease(Duration::from_secs(5))
            .wait(Duration::from_secs(60));
        let key = RecordKey::new("s", "k");
        let Ok(Begin::Execute(dead)) = engine.begin(key.clone(), fp(), &policy).await else {
            panic!("first request executes")
        };
        drop(dead); // the worker stops without releasing (not a panic): left to its lease
        let Ok(Begin::Execute(heir)) = engine.begin(key, fp(), &policy).await else {
            panic!("the duplicate takes over")
        };
        assert!(heir.taken_over());
        // It woke exactly when the lease ran out, not at the 60 s bound and not on a polling tick.
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_kept_alive_is_never_taken_over_however_long_the_work() {
        let store = Arc::new(MemoryStore::new().with_clock(tokio_clock()));
        let engine = Engine::from_arc(store.clone());
        let policy = Policy::new()
            .lease(Duration::from_secs(3))
            .wait(Duration::from_secs(1));
        let key = RecordKey::new("s", "k");
        let Ok(Begin::Execute(guard)) = engine.begin(key.clone(), fp(), &policy).await else {
            panic!("first request executes")
        };
        let duplicates = async {
            let mut conflicts = 0;
            // Ten leases long: a duplicate every 1.5 s finds the key held every time.
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                match engine.begin(key.clone(), fp(), &policy).await {
                    Err(Rejection::InFlight { .. }) => conflicts += 1,
                    other => panic!("a duplicate got {other:?} while the work ran"),
                }
            }
            conflicts
        };
        let conflicts = guard.keep_alive(duplicates).await;
        assert_eq!(conflicts, 20);
        assert!(engine.metrics().get(Outcome::Renewed) >= 20);
        guard.complete(&response()).await.expect("still held");
        assert_eq!(engine.metrics().get(Outcome::TakenOver), 0);
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

    #[tokio::test]
    async fn a_panic_releases_the_claim() {
        let store = Arc::new(MemoryStore::new());
        let engine = Engine::from_arc(store.clone());
        let policy = Policy::new();
        let key = RecordKey::new("s", "k");
        let Ok(Begin::Execute(guard)) = engine.begin(key.clone(), fp(), &policy).await else {
            panic!("first request executes")
        };
        let panicked = engine
            .spawn(async move {
                let _guard = guard;
                panic!("the handler panics");
            })
            .await;
        assert!(panicked.is_err());
        // The release runs in the background; wait for the key to be free.
        let released = |found: Option<Found>| {
            found.is_some_and(|found| found.record.state == RecordState::Released)
        };
        while !released(store.get(&key).await.unwrap()) {
            tokio::task::yield_now().await;
        }
        assert!(matches!(
            engine.begin(key, fp(), &policy).await,
            Ok(Begin::Execute(_))
        ));
    }

    #[tokio::test]
    async fn shutdown_waits_for_running_work_and_refuses_new_claims() {
        let engine = Engine::new(MemoryStore::new());
        let policy = Policy::new();
        let Ok(Begin::Execute(guard)) = engine.begin(RecordKey::new("s", "a"), fp(), &policy).await
        else {
            panic!("first request executes")
        };
        let (go, gate) = tokio::sync::oneshot::channel::<()>();
        let running = engine.spawn(async move {
            let _ = gate.await;
            guard.complete(&response()).await
        });
        let stopping = engine.clone();
        let stopped = tokio::spawn(async move { stopping.shutdown(Duration::from_secs(60)).await });
        // Closing is immediate: a new key is refused while the running work still holds its own.
        while !engine.inner.tasks.is_closed() {
            tokio::task::yield_now().await;
        }
        assert!(matches!(
            engine.begin(RecordKey::new("s", "b"), fp(), &policy).await,
            Err(Rejection::Unavailable { .. })
        ));
        assert!(!stopped.is_finished());
        go.send(()).expect("the work waits");
        assert!(stopped.await.expect("shutdown"), "the work finished");
        running.await.expect("join").expect("completed");
    }
}
