//! Model-based property tests: random sequences of claims, completions, releases, crashes, clock
//! jumps and purges from several logical clients on two service instances, run against every store
//! and checked step by step against a reference model of `docs/semantics.md`.
//!
//! The sequential tests drive the engine one call at a time, with the interleaving chosen by
//! proptest: a client may hold several claims at once, renew their leases, complete or release
//! them in any order, or crash holding them (`std::mem::forget`, so the lease must run out). The model predicts every
//! outcome exactly; a failure names the broken guarantee:
//!
//! - never two executions for one (scope, key) within a lease, renewed or not (a renewal that
//!   lands postpones every takeover; one that comes after a takeover is refused),
//! - never a replay of another fingerprint's response, nor across scopes,
//! - never a lost completed record before its ttl (it replays, and `get` returns it, until then).
//!
//! The concurrent tests let real tasks race on a few keys (no clock movement, so a lease never ends)
//! and check the same guarantees from what each task saw.
//!
//! CI runs a fixed seed and 64 cases per store (`PROPTEST_CASES` overrides it); a longer run:
//!
//! ```text
//! PROPTEST_CASES=5000 cargo test -p idem-tests --test proofs model:: -- --test-threads 1
//! IDEM_MODEL_SEED=7 PROPTEST_CASES=5000 cargo test -p idem-tests --test proofs model::   # another seed
//! ```

use crate::proof_support::{engines, instances, racing_runner, runner};
use idem_runtime::clock::{Clock, ManualClock, Timestamp};
use idem_runtime::store::Purge;
use idem_runtime::{
    Begin, ClaimGuard, FencingToken, Fingerprint, Policy, RecordKey, RecordState, Rejection, Store,
    StoreErrorKind, StoredResponse,
};
use idem_tests::conformance::Backend;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);
const LEASE: Duration = Duration::from_secs(30);
const TTL: Duration = Duration::from_secs(3600);
const RETAIN: Duration = Duration::from_secs(4 * 3600);
const CLIENTS: usize = 3;
const KEYS: u8 = 3;
const SCOPES: u8 = 2;
const FINGERPRINTS: u8 = 2;

fn policy() -> Policy {
    Policy::new()
        .ttl(TTL)
        .retain(RETAIN)
        .lease(LEASE)
        .wait(Duration::ZERO)
        .handler("model")
}

fn fingerprint(fp: u8) -> Fingerprint {
    Fingerprint::of_request(
        "POST",
        "/payments",
        Some("application/json"),
        format!(r#"{{"amount":{}}}"#, 1000 + u32::from(fp)).as_bytes(),
    )
}

/// A clock jump, weighted towards the boundaries that matter.
#[derive(Debug, Clone, Copy)]
enum Jump {
    Millis(u64),
    /// One millisecond: onto or just past a boundary the previous jumps approached.
    Tick,
    /// To one millisecond before a fresh lease's end.
    AlmostLease,
    Lease,
    Ttl,
    Retain,
}

impl Jump {
    fn duration(self) -> Duration {
        match self {
            Jump::Millis(ms) => Duration::from_millis(ms),
            Jump::Tick => Duration::from_millis(1),
            Jump::AlmostLease => LEASE - Duration::from_millis(1),
            Jump::Lease => LEASE,
            Jump::Ttl => TTL,
            Jump::Retain => RETAIN - TTL,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A client sends a request: (scope, key, fingerprint).
    Begin {
        client: usize,
        scope: u8,
        key: u8,
        fp: u8,
    },
    /// The holder of the `slot`-th held claim (modulo) finishes with `status`.
    Complete {
        slot: usize,
        status: u16,
    },
    /// The holder gives the claim up (5xx, panic, cancellation).
    Release {
        slot: usize,
    },
    /// The holder's process dies: no completion, no release.
    Crash {
        slot: usize,
    },
    /// The holder (alive, its handler still running) renews its lease to a full lease from now.
    Renew {
        slot: usize,
    },
    Advance(Jump),
    Purge {
        batch: usize,
    },
    Get {
        scope: u8,
        key: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let jump = prop_oneof![
        4 => (0u64..40_000).prop_map(Jump::Millis),
        2 => Just(Jump::Tick),
        2 => Just(Jump::AlmostLease),
        2 => Just(Jump::Lease),
        2 => Just(Jump::Ttl),
        1 => Just(Jump::Retain),
    ];
    prop_oneof![
        8 => (0..CLIENTS, 0..SCOPES, 0..KEYS, 0..FINGERPRINTS)
            .prop_map(|(client, scope, key, fp)| Op::Begin { client, scope, key, fp }),
        4 => (any::<usize>(), prop::sample::select(vec![200u16, 201, 402, 409]))
            .prop_map(|(slot, status)| Op::Complete { slot, status }),
        2 => any::<usize>().prop_map(|slot| Op::Release { slot }),
        1 => any::<usize>().prop_map(|slot| Op::Crash { slot }),
        3 => any::<usize>().prop_map(|slot| Op::Renew { slot }),
        4 => jump.prop_map(Op::Advance),
        1 => (1usize..20).prop_map(|batch| Op::Purge { batch }),
        2 => (0..SCOPES, 0..KEYS).prop_map(|(scope, key)| Op::Get { scope, key }),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..60)
}

/// Which request an execution ran for: encoded in every response, so that a replay shows whose
/// response it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Origin {
    exec: u64,
    scope: u8,
    key: u8,
    fp: u8,
}

fn response(origin: Origin, status: u16, case: &str) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![(
            http::HeaderName::from_static("x-exec"),
            http::HeaderValue::from(origin.exec),
        )],
        body: format!(
            "{case} exec={} scope={} key={} fp={}",
            origin.exec, origin.scope, origin.key, origin.fp
        )
        .into(),
    }
}

fn origin_of(body: &[u8]) -> Option<(u8, u8, u8)> {
    let text = std::str::from_utf8(body).ok()?;
    let field = |name: &str| -> Option<u8> {
        text.split(' ')
            .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))?
            .parse()
            .ok()
    };
    Some((field("scope")?, field("key")?, field("fp")?))
}

#[derive(Debug, Clone)]
enum MState {
    InFlight { lease_until: Timestamp },
    Completed { response: StoredResponse },
    Released,
}

#[derive(Debug, Clone)]
struct MRecord {
    fp: u8,
    token: FencingToken,
    created_at: Timestamp,
    expires_at: Timestamp,
    retain_until: Timestamp,
    state: MState,
}

/// The reference model: `docs/semantics.md`, one record per (scope, key), written as plainly as
/// possible.
#[derive(Default)]
struct Model {
    records: HashMap<(u8, u8), MRecord>,
}

impl Model {
    /// The record as every store must show it at `now`: records past retention count as absent.
    fn live(&self, k: (u8, u8), now: Timestamp) -> Option<&MRecord> {
        self.records.get(&k).filter(|r| r.retain_until > now)
    }
}

#[derive(Debug)]
enum Expect {
    Execute { taken_over: bool },
    Replay(StoredResponse, Timestamp),
    Mismatch(Timestamp),
    InFlight,
    Expired(Timestamp),
}

fn predict(model: &Model, k: (u8, u8), fp: u8, now: Timestamp) -> Expect {
    match model.live(k, now) {
        None => Expect::Execute { taken_over: false },
        // Resumed by its own request before its expiry, replaced by any other claim.
        Some(r) if matches!(r.state, MState::Released) => Expect::Execute { taken_over: false },
        Some(r) if now >= r.expires_at => Expect::Expired(r.expires_at),
        Some(r) if r.fp != fp => Expect::Mismatch(r.expires_at),
        Some(r) => match &r.state {
            MState::Completed { response } => Expect::Replay(response.clone(), r.expires_at),
            MState::InFlight { lease_until } if *lease_until <= now => {
                Expect::Execute { taken_over: true }
            }
            MState::InFlight { .. } => Expect::InFlight,
            MState::Released => unreachable!("handled above"),
        },
    }
}

/// Whether a claim of `fp` at `now` resumes the released record `r` (keeping its times) rather than
/// replacing it.
fn resumes(r: Option<&MRecord>, fp: u8, now: Timestamp) -> bool {
    r.is_some_and(|r| matches!(r.state, MState::Released) && r.fp == fp && now < r.expires_at)
}

struct Held {
    guard: ClaimGuard,
    origin: Origin,
}

fn fail(step: usize, op: &Op, what: String) -> TestCaseError {
    TestCaseError::fail(format!("step {step} ({op:?}): {what}"))
}

/// Runs one generated case against `instances` (two engines' stores over the same records).
async fn run_case<S: Store + Purge>(
    instances: &[Arc<S>],
    clock: &ManualClock,
    ops: &[Op],
    case: &str,
) -> Result<(), TestCaseError> {
    let engines = engines(instances);
    let record_key =
        |(scope, key): (u8, u8)| RecordKey::new(format!("{case}-s{scope}"), format!("k{key}"));
    let mut model = Model::default();
    let mut held: Vec<Held> = Vec::new();
    let mut exec = 0u64;
    let policy = policy();

    let result = async {
        for (step, op) in ops.iter().enumerate() {
            let now = clock.now();
            match *op {
                Op::Begin {
                    client,
                    scope,
                    key,
                    fp,
                } => {
                    let k = (scope, key);
                    let engine = &engines[client % engines.len()];
                    let expected = predict(&model, k, fp, now);
                    let resuming = resumes(model.live(k, now), fp, now);
                    let got = engine.begin(record_key(k), fingerprint(fp), &policy).await;
                    match (&expected, got) {
                        (Expect::Execute { taken_over }, Ok(Begin::Execute(guard))) => {
                            if guard.taken_over() != *taken_over {
                                return Err(fail(step, op, format!(
                                    "taken_over = {}, model says {taken_over}", guard.taken_over()
                                )));
                            }
                            exec += 1;
                            let token = guard.token();
                            let lease_until = now + LEASE;
                            match model.records.get_mut(&k) {
                                Some(r) if *taken_over || resuming => {
                                    r.token = token;
                                    r.state = MState::InFlight { lease_until };
                                }
                                _ => {
                                    model.records.insert(k, MRecord {
                                        fp,
                                        token,
                                        created_at: now,
                                        expires_at: now + TTL,
                                        retain_until: now + RETAIN,
                                        state: MState::InFlight { lease_until },
                                    });
                                }
                            }
                            held.push(Held { guard, origin: Origin { exec, scope, key, fp } });
                        }
                        (_, Ok(Begin::Execute(_))) => {
                            let what = match expected {
                                Expect::InFlight => "two executions for one key within a lease",
                                Expect::Replay(..) => "a completed key executed again before its ttl (its record was lost)",
                                Expect::Mismatch(_) => "a request with another fingerprint executed on a held key",
                                Expect::Expired(_) => "an expired key executed silently within retention",
                                Expect::Execute { .. } => unreachable!(),
                            };
                            return Err(fail(step, op, format!("{what}: expected {expected:?}")));
                        }
                        (Expect::Replay(response, expires_at), Ok(Begin::Replay(replay))) => {
                            if origin_of(&replay.response.body) != Some((scope, key, fp)) {
                                return Err(fail(step, op, format!(
                                    "replayed another request's response (another scope, key or fingerprint): {:?}",
                                    String::from_utf8_lossy(&replay.response.body)
                                )));
                            }
                            if replay.response != *response || replay.expires_at != *expires_at {
                                return Err(fail(step, op, format!(
                                    "replayed {replay:?}, model has {response:?} until {expires_at:?}"
                                )));
                            }
                        }
                        (Expect::Mismatch(at), Err(Rejection::Mismatch { expires_at })) if *at == expires_at => {}
                        (Expect::InFlight, Err(Rejection::InFlight { .. })) => {}
                        (Expect::Expired(at), Err(Rejection::Expired { expired_at })) if *at == expired_at => {}
                        (expected, got) => {
                            if let Ok(Begin::Replay(replay)) = &got {
                                if origin_of(&replay.response.body) != Some((scope, key, fp)) {
                                    return Err(fail(step, op, format!(
                                        "replayed another request's response: {:?}",
                                        String::from_utf8_lossy(&replay.response.body)
                                    )));
                                }
                            }
                            let what = match expected {
                                Expect::Replay(..) => "a completed record was lost or changed before its ttl: ",
                                _ => "",
                            };
                            return Err(fail(step, op, format!("{what}expected {expected:?}, got {got:?}")));
                        }
                    }
                }
                Op::Complete { slot, .. } | Op::Release { slot } if !held.is_empty() => {
                    let status = match op {
                        Op::Complete { status, .. } => *status,
                        _ => 500,
                    };
                    let Held { guard, origin } = held.remove(slot % held.len());
                    let k = (origin.scope, origin.key);
                    let current = model.records.get(&k).is_some_and(|r| {
                        r.token == guard.token() && matches!(r.state, MState::InFlight { .. })
                    });
                    let forgotten = model.live(k, now).is_none();
                    let completing = matches!(op, Op::Complete { .. });
                    let stored = response(origin, status, case);
                    let (token, expires_at) = (guard.token(), guard.expires_at());
                    let result = if completing {
                        guard.complete(&stored).await
                    } else {
                        guard.release().await
                    };
                    match (current, forgotten, result) {
                        (true, _, Ok(())) => {
                            if let Some(r) = model.records.get_mut(&k) {
                                r.state = match completing {
                                    true => MState::Completed { response: stored },
                                    false => MState::Released,
                                };
                            }
                        }
                        // A record past retention may already have been purged (or evicted by a
                        // claim): either way it counts as absent from now on.
                        (true, true, Err(e)) if e.kind() == StoreErrorKind::Fenced => {
                            model.records.remove(&k);
                        }
                        // Released under a live key by a later holder: the completion claims it back
                        // (the same record) and stores its response, since its handler's effects
                        // happened.
                        (false, false, Ok(())) if completing && resumes(model.live(k, now), origin.fp, now) => {
                            if let Some(r) = model.records.get_mut(&k) {
                                r.token = token;
                                r.state = MState::Completed { response: stored };
                            }
                        }
                        (false, _, Err(e)) if e.kind() == StoreErrorKind::Fenced => {}
                        // The record is gone (purged, or lost by the store): the completion claims
                        // a fresh one and stores its response while the key is live...
                        (false, true, Ok(())) if completing && now < expires_at => {
                            model.records.insert(k, MRecord {
                                fp: origin.fp,
                                token,
                                created_at: now,
                                expires_at: now + TTL,
                                retain_until: now + RETAIN,
                                state: MState::Completed { response: stored },
                            });
                        }
                        (current, _, result) => {
                            return Err(fail(step, op, format!(
                                "the claim is {}current, the store answered {result:?}",
                                if current { "" } else { "not " }
                            )));
                        }
                    }
                }
                Op::Crash { slot } if !held.is_empty() => {
                    std::mem::forget(held.remove(slot % held.len()).guard);
                }
                Op::Renew { slot } if !held.is_empty() => {
                    let Held { guard, origin } = &held[slot % held.len()];
                    let k = (origin.scope, origin.key);
                    let current = model.records.get(&k).is_some_and(|r| {
                        r.token == guard.token() && matches!(r.state, MState::InFlight { .. })
                    });
                    let forgotten = model.live(k, now).is_none();
                    let lease_until = now + LEASE;
                    let result = instances[slot % instances.len()]
                        .renew(guard.key(), guard.token(), LEASE)
                        .await;
                    match (current, forgotten, result) {
                        // A renewal that lands moves the lease: no takeover until it runs out.
                        (true, false, Ok(())) => {
                            if let Some(r) = model.records.get_mut(&k) {
                                r.state = MState::InFlight { lease_until };
                            }
                        }
                        // Past retention the record counts as absent, renewed or not.
                        (true, true, Ok(())) => {}
                        (true, true, Err(e)) if e.kind() == StoreErrorKind::Fenced => {
                            model.records.remove(&k);
                        }
                        // A claim taken over (or completed, or released) is never renewed.
                        (false, _, Err(e)) if e.kind() == StoreErrorKind::Fenced => {}
                        (current, _, result) => {
                            return Err(fail(step, op, format!(
                                "renewal of a claim that is {}current: the store answered {result:?}",
                                if current { "" } else { "not " }
                            )));
                        }
                    }
                }
                Op::Complete { .. } | Op::Release { .. } | Op::Crash { .. } | Op::Renew { .. } => {}
                Op::Advance(jump) => clock.advance(jump.duration()),
                Op::Purge { batch } => {
                    let purged = instances[0]
                        .purge_expired(batch)
                        .await
                        .map_err(|e| fail(step, op, format!("purge failed: {e}")))?;
                    if purged > batch as u64 {
                        return Err(fail(step, op, format!("purged {purged} records, more than the batch")));
                    }
                }
                Op::Get { scope, key } => {
                    let k = (scope, key);
                    let got = instances[1 % instances.len()]
                        .get(&record_key(k))
                        .await
                        .map_err(|e| fail(step, op, format!("get failed: {e}")))?;
                    if got.as_ref().is_some_and(|found| found.now != now) {
                        return Err(fail(step, op, format!("get carried another time than the store's: {got:?}")));
                    }
                    let got = got.map(|found| found.record);
                    let expected = model.live(k, now);
                    let same = match (&got, expected) {
                        (None, None) => true,
                        (Some(r), Some(m)) => {
                            r.fingerprint == fingerprint(m.fp)
                                && r.token == m.token
                                && r.created_at == m.created_at
                                && r.expires_at == m.expires_at
                                && r.retain_until == m.retain_until
                                && match (&r.state, &m.state) {
                                    (RecordState::InFlight { lease_until: a }, MState::InFlight { lease_until: b }) => a == b,
                                    (RecordState::Completed { response: a }, MState::Completed { response: b }) => a == b,
                                    (RecordState::Released, MState::Released) => true,
                                    _ => false,
                                }
                        }
                        _ => false,
                    };
                    if !same {
                        let what = match expected {
                            Some(m) if matches!(m.state, MState::Completed { .. }) && now < m.expires_at => {
                                "a completed record was lost or changed before its ttl: "
                            }
                            _ => "",
                        };
                        return Err(fail(step, op, format!("{what}get returned {got:?}, model has {expected:?}")));
                    }
                }
            }
        }
        Ok(())
    }
    .await;
    // The remaining claims belong to this case's scopes only; forgetting them keeps their background
    // releases from running into the next case.
    for h in held {
        std::mem::forget(h.guard);
    }
    result
}

fn sequential<B: Backend>(make: impl std::future::Future<Output = B>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let backend = runtime.block_on(make);
    // One store clock for the whole run: each case starts where the previous one left it, in
    // scopes of its own.
    let clock = ManualClock::new(T0);
    let stores = runtime.block_on(instances(&backend, &clock));
    let run = uuid::Uuid::new_v4().simple().to_string();
    let n = AtomicU64::new(0);
    let result = runner().run(&ops(), |ops| {
        let case = format!("model-{run}-{}", n.fetch_add(1, Ordering::Relaxed));
        runtime.block_on(run_case(&stores, &clock, &ops, &case))
    });
    drop(stores);
    if let Err(e) = result {
        panic!("{e}");
    }
}

/// One racing task's script: (scope, key, fingerprint, what to do once it holds the key).
#[derive(Debug, Clone, Copy)]
enum Then {
    Complete,
    Release,
    Crash,
}

type Script = Vec<(u8, u8, u8, Then, bool)>;

fn scripts() -> impl Strategy<Value = Vec<Script>> {
    let then =
        prop_oneof![6 => Just(Then::Complete), 2 => Just(Then::Release), 1 => Just(Then::Crash)];
    let step = (0..SCOPES, 0..2u8, 0..FINGERPRINTS, then, any::<bool>());
    prop::collection::vec(prop::collection::vec(step, 1..12), 4..7)
}

/// What the racing tasks saw, per (scope, key).
#[derive(Default)]
struct Seen {
    /// The execution currently holding each key, if any. A crashed holder holds it forever: the
    /// clock never moves here, so its lease never ends.
    holder: HashMap<(u8, u8), Origin>,
    /// The response each key completed with.
    completed: HashMap<(u8, u8), StoredResponse>,
}

async fn run_race<S: Store + Purge>(
    instances: &[Arc<S>],
    scripts: Vec<Script>,
    case: &str,
) -> Result<(), TestCaseError> {
    let engines = engines(instances);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let execs = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(scripts.len()));
    let mut tasks = Vec::new();
    for (i, script) in scripts.into_iter().enumerate() {
        let engine = engines[i % engines.len()].clone();
        let (seen, execs, barrier, case) = (
            seen.clone(),
            execs.clone(),
            barrier.clone(),
            case.to_owned(),
        );
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            for (scope, key, fp, then, wait) in script {
                let k = (scope, key);
                let record_key = RecordKey::new(format!("{case}-s{scope}"), format!("k{key}"));
                // A short wait lets duplicates meet the completion's wake-up; its length decides
                // nothing the checks below rely on.
                let policy = policy().wait(if wait { Duration::from_millis(50) } else { Duration::ZERO });
                match engine.begin(record_key, fingerprint(fp), &policy).await {
                    Ok(Begin::Execute(guard)) => {
                        let origin = Origin { exec: execs.fetch_add(1, Ordering::SeqCst) + 1, scope, key, fp };
                        {
                            let mut seen = seen.lock().expect("lock");
                            if let Some(other) = seen.holder.insert(k, origin) {
                                return Err(format!("two executions for one key within a lease: {other:?} and {origin:?}"));
                            }
                            if let Some(done) = seen.completed.get(&k) {
                                return Err(format!("{origin:?} executed a key already completed with {done:?}"));
                            }
                        }
                        match then {
                            Then::Crash => std::mem::forget(guard),
                            Then::Release => {
                                // Give the key up before the store does, so no new holder is
                                // ever recorded while this one still is.
                                seen.lock().expect("lock").holder.remove(&k);
                                guard.release().await.map_err(|e| format!("release: {e}"))?;
                            }
                            Then::Complete => {
                                let stored = response(origin, 201, &case);
                                {
                                    let mut seen = seen.lock().expect("lock");
                                    seen.holder.remove(&k);
                                    seen.completed.insert(k, stored.clone());
                                }
                                guard.complete(&stored).await.map_err(|e| format!("complete: {e}"))?;
                            }
                        }
                    }
                    Ok(Begin::Replay(replay)) => {
                        if origin_of(&replay.response.body) != Some((scope, key, fp)) {
                            return Err(format!(
                                "replayed another request's response: {:?}",
                                String::from_utf8_lossy(&replay.response.body)
                            ));
                        }
                        let seen = seen.lock().expect("lock");
                        if seen.completed.get(&k) != Some(&replay.response) {
                            return Err(format!("replayed {replay:?}, but the key completed with {:?}", seen.completed.get(&k)));
                        }
                    }
                    Err(Rejection::Mismatch { .. } | Rejection::InFlight { .. }) => {}
                    Err(other) => return Err(format!("unexpected rejection: {other:?}")),
                }
            }
            Ok(())
        }));
    }
    for task in tasks {
        task.await
            .map_err(|e| TestCaseError::fail(format!("task panicked: {e}")))?
            .map_err(TestCaseError::fail)?;
    }
    // Afterwards every completed key replays its one response, from either instance.
    let completed = seen.lock().expect("lock").completed.clone();
    for (&(scope, key), stored) in &completed {
        let record_key = RecordKey::new(format!("{case}-s{scope}"), format!("k{key}"));
        let (_, _, fp) = origin_of(&stored.body).expect("our own body");
        for engine in &engines {
            match engine
                .begin(record_key.clone(), fingerprint(fp), &policy())
                .await
            {
                Ok(Begin::Replay(replay)) if replay.response == *stored => {}
                other => {
                    return Err(TestCaseError::fail(format!(
                        "completed key {record_key} lost its response: {other:?}"
                    )))
                }
            }
        }
    }
    Ok(())
}

fn concurrent<B: Backend>(make: impl std::future::Future<Output = B>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let backend = runtime.block_on(make);
    // The store clock never moves here, so a lease never ends.
    let stores = runtime.block_on(instances(&backend, &ManualClock::new(T0)));
    let run = uuid::Uuid::new_v4().simple().to_string();
    let n = AtomicU64::new(0);
    // Racing cases cost real time (tasks, round trips); a quarter of the budget covers the races
    // the sequential cases cannot.
    let mut runner = racing_runner();
    let result = runner.run(&scripts(), |scripts| {
        let case = format!("race-{run}-{}", n.fetch_add(1, Ordering::Relaxed));
        runtime.block_on(run_race(&stores, scripts, &case))
    });
    drop(stores);
    if let Err(e) = result {
        panic!("{e}");
    }
}

macro_rules! model_tests {
    ($($(#[$attr:meta])* $backend:ident),*) => {
        mod sequential {
            $(
                $(#[$attr])*
                #[test]
                fn $backend() {
                    super::sequential(crate::proof_support::$backend());
                }
            )*
        }
        mod concurrent {
            $(
                $(#[$attr])*
                #[test]
                fn $backend() {
                    super::concurrent(crate::proof_support::$backend());
                }
            )*
        }
    };
}

model_tests!(
    memory,
    sqlite,
    #[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
    postgres,
    #[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
    mysql,
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    redis,
    #[cfg_attr(
        skip_redis_cluster,
        ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
    )]
    redis_cluster
);
