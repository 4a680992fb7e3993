//! Fault injection end to end: a store that fails one call — before it reaches the store (the
//! connection dropped on the way) or after the store applied it (the answer was lost) — on every
//! backend, through the HTTP layer; a store slower than the engine's timeout; and what a client
//! sees in each case, then on retry, then once the lease has run out.
//!
//! Each case asserts what the client sees and how often the handler ran. The results, with the
//! guarantees they show and the one they do not (a completion lost before it was stored re-runs
//! the handler once the lease ends), are tabled in `docs/reliability.md`.
//!
//! Panicking handlers, response bodies that fail while streaming and cancelled requests are covered
//! by `http/failures.rs` and `http/replay.rs`; real connections cut under a store by
//! `conformance/redis.rs` (a TCP proxy) and `conformance/postgres.rs`.

use crate::http_support::{json_post, router, send, App, Probe, Reply, PAY_1000};
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::store::{Claim, ClaimOutcome, Found, Subscription};
use idem_runtime::{
    Begin, Engine, FencingToken, Fingerprint, Policy, RecordKey, Rejection, Store, StoreError,
    StoreErrorKind, StoredResponse,
};
use idem_tests::conformance::Backend;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

const LEASE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Claim,
    Complete,
    Release,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    /// The call never reached the store (the connection dropped on the way there).
    Before,
    /// The store applied the call, but its answer was lost (the connection dropped on the way back).
    After,
    /// The store takes longer than the engine's timeout; `After` that, it has applied the call.
    SlowBefore,
    SlowAfter,
}

/// A store that fails the next call of one kind, once.
struct Faulty<S> {
    inner: Arc<S>,
    plan: Mutex<Option<(Call, When)>>,
    failed: Mutex<Vec<(Call, When)>>,
}

impl<S> Faulty<S> {
    fn new(inner: Arc<S>) -> Self {
        Self {
            inner,
            plan: Mutex::new(None),
            failed: Mutex::new(Vec::new()),
        }
    }

    fn arm(&self, call: Call, when: When) {
        *self.plan.lock().expect("lock") = Some((call, when));
    }

    fn failed(&self) -> Vec<(Call, When)> {
        self.failed.lock().expect("lock").clone()
    }

    /// Runs `op` as the armed fault says, if it is armed for `call`.
    async fn run<T>(
        &self,
        call: Call,
        op: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let fault = {
            let mut plan = self.plan.lock().expect("lock");
            match *plan {
                Some((c, when)) if c == call => {
                    *plan = None;
                    Some(when)
                }
                _ => None,
            }
        };
        let Some(when) = fault else {
            return op.await;
        };
        self.failed.lock().expect("lock").push((call, when));
        let lost = || {
            Err(StoreError::unavailable(
                "connection reset by peer (injected)",
            ))
        };
        match when {
            When::Before => lost(),
            When::After => {
                let _ = op.await;
                lost()
            }
            // Far beyond any store timeout; under tokio's paused clock this costs no real time.
            When::SlowBefore => {
                tokio::time::sleep(Duration::from_secs(3600)).await;
                op.await
            }
            When::SlowAfter => {
                let result = op.await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
                result
            }
        }
    }
}

#[async_trait::async_trait]
impl<S: Store> Store for Faulty<S> {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.run(Call::Claim, self.inner.claim(claim)).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.run(Call::Complete, self.inner.complete(key, token, response))
            .await
    }
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.run(Call::Release, self.inner.release(key, token))
            .await
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
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

/// An app over a faulty store, on a manual clock, with the handler's gate open.
struct Rig<S> {
    store: Arc<Faulty<S>>,
    clock: ManualClock,
    engine: Engine,
    router: axum::Router,
    probe: Probe,
}

/// The clock a test's store judges time by, standing at the start of every case.
fn start_clock() -> ManualClock {
    ManualClock::new(Timestamp::from_millis(crate::http_support::START_MS))
}

/// A memory store on `clock`.
fn memory(clock: &ManualClock) -> Arc<idem_runtime::store::memory::MemoryStore> {
    Arc::new(idem_runtime::store::memory::MemoryStore::new().with_clock(clock.clone()))
}

impl<S: Store> Rig<S> {
    /// A rig over `inner`, which judges time by `clock`; the clock is set back to the start, so
    /// every case (in a scope of its own) starts there.
    fn new(inner: Arc<S>, clock: &ManualClock, store_timeout: Duration) -> Self {
        let store = Arc::new(Faulty::new(inner));
        let clock = clock.clone();
        clock.set(Timestamp::from_millis(crate::http_support::START_MS));
        let engine = Engine::from_arc(store.clone()).with_store_timeout(Some(store_timeout));
        let probe = Probe {
            calls: Arc::new(AtomicUsize::new(0)),
            started: watch::Sender::new(0),
            open: watch::Sender::new(true),
        };
        let router = router(App {
            engine: engine.clone(),
            probe: probe.clone(),
        });
        Self {
            store,
            clock,
            engine,
            router,
            probe,
        }
    }

    /// POST /gated-no-wait (lease 30 s, no waiting: a duplicate of a held key is 409 at once).
    async fn pay(&self, user: &str) -> Reply {
        send(
            self.router.clone(),
            json_post("/gated-no-wait", user, &["k1"], PAY_1000),
        )
        .await
    }
}

/// What the client saw: first the faulty request, then an immediate retry, then a retry once the
/// lease has run out; and how many times the handler ran in all.
#[derive(Debug, PartialEq, Eq)]
struct Story {
    first: Seen,
    retry: Seen,
    after_lease: Seen,
    executions: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// A fresh 201 with `Idempotency-Expires` (the key is remembered).
    Fresh,
    /// A fresh 201 without `Idempotency-Expires` (the response could not be stored).
    FreshUnremembered,
    Replay,
    Conflict409,
    Unavailable503,
}

fn seen(reply: &Reply) -> Seen {
    match (reply.status.as_u16(), reply.replayed()) {
        (201, true) => Seen::Replay,
        (201, false) if reply.headers.contains_key("idempotency-expires") => Seen::Fresh,
        (201, false) => Seen::FreshUnremembered,
        (409, _) => {
            reply.assert_problem(409, "urn:idem:problem:in-flight");
            Seen::Conflict409
        }
        (503, _) => {
            reply.assert_problem(503, "urn:idem:problem:store-unavailable");
            Seen::Unavailable503
        }
        other => panic!("unexpected reply {other:?}: {:?}", reply.body),
    }
}

async fn story<S: Store>(rig: &Rig<S>, user: &str, call: Call, when: When) -> Story {
    let mut stored = rig.store.subscribe(&RecordKey::new(user, "k1"));
    rig.store.arm(call, when);
    let first = seen(&rig.pay(user).await);
    assert_eq!(rig.store.failed(), [(call, when)], "the fault was injected");
    if call == Call::Complete {
        // The client has its answer; the handler's task keeps storing it until the store takes it.
        stored.changed().await;
    }
    let retry = seen(&rig.pay(user).await);
    rig.clock.advance(LEASE);
    let after_lease = seen(&rig.pay(user).await);
    Story {
        first,
        retry,
        after_lease,
        executions: rig.probe.calls(),
    }
}

/// The expected story of a fault: the same on every backend.
fn expected(call: Call, when: When) -> Story {
    use Seen::*;
    let (first, retry, after_lease, executions) = match (call, when) {
        // Nothing was claimed: the retry simply runs.
        (Call::Claim, When::Before | When::SlowBefore) => (Unavailable503, Fresh, Replay, 1),
        // The claim landed but its answer was lost: the engine releases it, so the retry runs at
        // once (as the same record) instead of waiting for the lease. Nothing ran before that.
        (Call::Claim, When::After) => (Unavailable503, Fresh, Replay, 1),
        // The store has not answered yet when the request gives up: the claim is still on its
        // way, so the key is busy until the lease runs out (or the claim lands and is released),
        // then the next retry runs.
        (Call::Claim, When::SlowAfter) => (Unavailable503, Conflict409, Fresh, 1),
        // The client gets the response at once, without the promise; the completion is retried
        // until the store has it (or, its answer lost, is found stored), and retries replay it.
        (Call::Complete, _) => (FreshUnremembered, Replay, Replay, 1),
        (Call::Release, _) => unreachable!("release faults are checked on the engine"),
    };
    Story {
        first,
        retry,
        after_lease,
        executions,
    }
}

/// What a retry meets after a failed release.
#[derive(Debug, PartialEq, Eq)]
enum AfterRelease {
    /// The release was applied: the retry runs at once.
    RunsAtOnce,
    /// The release never arrived: the key stays claimed (409) until the lease runs out; then the
    /// retry takes it over and runs.
    RunsAfterTheLease,
}

/// A failed release (the handler answered 5xx, or panicked).
async fn release_story<S: Store>(rig: &Rig<S>, user: &str, when: When) -> AfterRelease {
    let policy = Policy::new().wait(Duration::ZERO).lease(LEASE);
    let key = RecordKey::new(user, "k-release");
    let fp = Fingerprint::of_request("POST", "/flaky", None, b"x");
    let Ok(Begin::Execute(guard)) = rig.engine.begin(key.clone(), fp, &policy).await else {
        panic!("a fresh key executes")
    };
    rig.store.arm(Call::Release, when);
    let err = guard.release().await.expect_err("injected");
    assert_eq!(err.kind(), StoreErrorKind::Unavailable);
    // Guards are forgotten, not dropped, so that no background release muddles what follows.
    match rig.engine.begin(key.clone(), fp, &policy).await {
        Ok(Begin::Execute(guard)) => {
            assert!(!guard.taken_over());
            std::mem::forget(guard);
            AfterRelease::RunsAtOnce
        }
        Err(Rejection::InFlight { .. }) => {
            rig.clock.advance(LEASE);
            match rig.engine.begin(key, fp, &policy).await {
                Ok(Begin::Execute(guard)) if guard.taken_over() => {
                    std::mem::forget(guard);
                    AfterRelease::RunsAfterTheLease
                }
                other => panic!("expected a takeover, got {other:?}"),
            }
        }
        other => panic!("unexpected {other:?}"),
    }
}

const FAULTS: [(Call, When); 4] = [
    (Call::Claim, When::Before),
    (Call::Claim, When::After),
    (Call::Complete, When::Before),
    (Call::Complete, When::After),
];

async fn dropped_connections<B: Backend>(backend: B) {
    let clock = start_clock();
    let inner = Arc::new(backend.open(Arc::new(clock.clone())).await);
    for (call, when) in FAULTS {
        // Each case has a clock of its own; a user (scope) of its own keeps cases apart.
        let rig = Rig::new(inner.clone(), &clock, Duration::from_secs(30));
        let user = format!("u-{}", uuid::Uuid::new_v4().simple());
        let got = story(&rig, &user, call, when).await;
        assert_eq!(got, expected(call, when), "{call:?} failing {when:?}");
    }
    for (when, expect) in [
        (When::Before, AfterRelease::RunsAfterTheLease),
        (When::After, AfterRelease::RunsAtOnce),
    ] {
        let rig = Rig::new(inner.clone(), &clock, Duration::from_secs(30));
        let user = format!("u-{}", uuid::Uuid::new_v4().simple());
        assert_eq!(
            release_story(&rig, &user, when).await,
            expect,
            "release failing {when:?}"
        );
    }
}

macro_rules! on_every_backend {
    ($($(#[$attr:meta])* $backend:ident),*) => {
        mod dropped_connection {
            $(
                $(#[$attr])*
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $backend() {
                    super::dropped_connections(crate::proof_support::$backend().await).await;
                }
            )*
        }
    };
}

on_every_backend!(
    memory,
    sqlite,
    #[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
    postgres,
    #[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
    mysql,
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    redis
);

/// A store slower than the engine's 5 s timeout: the claim answers 503 and nothing runs; a slow
/// completion still reaches the client, unremembered. Tokio's paused clock makes the timeout
/// fire without waiting.
#[tokio::test(start_paused = true)]
async fn a_slow_store_times_out_into_the_same_stories() {
    let clock = start_clock();
    let inner = memory(&clock);
    for (call, when) in [
        (Call::Claim, When::SlowBefore),
        (Call::Claim, When::SlowAfter),
        (Call::Complete, When::SlowBefore),
        (Call::Complete, When::SlowAfter),
    ] {
        let rig = Rig::new(inner.clone(), &clock, Duration::from_secs(5));
        let user = format!("u-{}", uuid::Uuid::new_v4().simple());
        let got = story(&rig, &user, call, when).await;
        assert_eq!(got, expected(call, when), "{call:?} {when:?}");
    }
    // The 503 says when to come back.
    let rig = Rig::new(inner.clone(), &clock, Duration::from_secs(5));
    rig.store.arm(Call::Claim, When::SlowBefore);
    let reply = rig.pay("slow").await;
    assert_eq!(reply.header("retry-after"), Some("1"));
}

/// A client that goes away mid-request (its request future dropped, as hyper does when the
/// connection closes) while the handler runs: the handler runs on to the end in its own task and its
/// response is stored, so the retry replays it and nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnecting_mid_request_loses_nothing_and_runs_nothing_twice() {
    let clock = start_clock();
    let rig = Rig::new(memory(&clock), &clock, Duration::from_secs(5));
    rig.probe.open.send_replace(false);
    let router = rig.router.clone();
    let request = tokio::spawn(async move {
        send(
            router,
            json_post("/gated-no-wait", "carol", &["k1"], PAY_1000),
        )
        .await
    });
    rig.probe.wait_started(1).await;
    request.abort(); // the connection closes: hyper drops the request future
    assert!(request.await.expect_err("aborted").is_cancelled());
    let key = RecordKey::new("carol", "k1");
    let mut stored = rig.store.subscribe(&key);
    rig.probe.open.send_replace(true);
    stored.changed().await;
    assert_eq!(seen(&rig.pay("carol").await), Seen::Replay);
    assert_eq!(rig.probe.calls(), 1, "the handler ran once, to its end");
}

/// The engine reports each injected failure as `Unavailable`, never as a mismatch or conflict that
/// would tell the client to give the key up.
#[tokio::test]
async fn an_injected_claim_failure_is_unavailable_with_its_cause() {
    let clock = start_clock();
    let rig = Rig::new(memory(&clock), &clock, Duration::from_secs(5));
    rig.store.arm(Call::Claim, When::Before);
    let fp = Fingerprint::of_request("POST", "/x", None, b"x");
    match rig
        .engine
        .begin(RecordKey::new("s", "k"), fp, &Policy::new())
        .await
    {
        Err(Rejection::Unavailable { source, .. }) => {
            assert_eq!(source.kind(), StoreErrorKind::Unavailable);
            assert!(source.to_string().contains("injected"), "{source}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}
