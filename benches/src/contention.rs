//! Contention: 1,000 concurrent identical requests on one key. One runs; the others wait for its
//! completion and replay. Store calls are counted by a wrapper store, for several handler durations:
//! the calls per waiter must not grow with the wait (waiters are woken, they do not poll).

use crate::counting::{Calls, CountingStore};
use crate::floors::{fingerprint, response};
use crate::report::{self, dur};
use crate::setup::{Backend, Handle};
use idem_runtime::policy::Policy;
use idem_runtime::{Begin, Engine, RecordKey};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WAITERS: usize = 1000;
const HOLDS_MS: [u64; 3] = [10, 100, 1000];
const POLICY: Policy = Policy::new()
    .ttl(Duration::from_secs(86_400))
    .wait(Duration::from_secs(30))
    .lease(Duration::from_secs(60))
    .handler("contention")
    .checked();

pub(crate) async fn run(handles: &[(Backend, Handle)]) {
    println!("\n## Contention: {WAITERS} concurrent requests on one key\n");
    println!("Through the engine (no HTTP), released together by a barrier; the one that claims holds the key for the handler time, then completes. \"After completion\" is from the completion to the last answer. Store calls per waiter exclude the executing request's claim and complete.\n");
    println!("| store | handler time | executions | replays / errors | all answered after | after completion | claims per waiter | gets per waiter | subscriptions per waiter | announcements per waiter |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for (backend, handle) in handles {
        let mut per_waiter = Vec::new();
        for hold in HOLDS_MS {
            let calls = Arc::new(Calls::default());
            let engine = Engine::from_arc(Arc::new(CountingStore {
                inner: handle.store(),
                calls: calls.clone(),
            }));
            let key = RecordKey::new(
                "contention",
                format!("{}-{hold}-{}", backend.name(), std::process::id()),
            );
            let barrier = Arc::new(tokio::sync::Barrier::new(WAITERS));
            let executions = Arc::new(AtomicU64::new(0));
            let replays = Arc::new(AtomicU64::new(0));
            let completed_at = Arc::new(Mutex::new(None::<Instant>));
            let start = Arc::new(Mutex::new(None::<Instant>));
            let mut tasks = Vec::with_capacity(WAITERS);
            for _ in 0..WAITERS {
                let (engine, key, barrier) = (engine.clone(), key.clone(), barrier.clone());
                let (executions, replays) = (executions.clone(), replays.clone());
                let (completed_at, start) = (completed_at.clone(), start.clone());
                tasks.push(tokio::spawn(async move {
                    if barrier.wait().await.is_leader() {
                        *start.lock().expect("start") = Some(Instant::now());
                    }
                    match engine.begin(key, fingerprint(), &POLICY).await {
                        Ok(Begin::Execute(claim)) => {
                            executions.fetch_add(1, Relaxed);
                            tokio::time::sleep(Duration::from_millis(hold)).await;
                            let ok = claim.complete(&response()).await.is_ok();
                            *completed_at.lock().expect("completed") = Some(Instant::now());
                            ok
                        }
                        Ok(Begin::Replay(_)) => {
                            replays.fetch_add(1, Relaxed);
                            true
                        }
                        Err(_) => false,
                    }
                    .then(Instant::now)
                }));
            }
            let (last, errors) = answered(tasks).await;
            let start = start.lock().expect("start").unwrap_or_else(Instant::now);
            let done = completed_at.lock().expect("completed").unwrap_or(start);
            let last = last.unwrap_or(start);
            let waiters = (WAITERS - 1) as f64;
            let claims = (calls.claim.load(Relaxed).saturating_sub(1)) as f64 / waiters;
            let gets = calls.get.load(Relaxed) as f64 / waiters;
            let subs = calls.subscribe.load(Relaxed) as f64 / waiters;
            let announces = calls.announce.load(Relaxed) as f64 / waiters;
            per_waiter.push(claims + gets + announces);
            println!(
                "| {} | {hold} ms | {} | {} / {errors} | {} | {} | {claims:.2} | {gets:.2} | {subs:.2} | {announces:.2} |",
                backend.name(),
                executions.load(Relaxed),
                replays.load(Relaxed),
                dur(last - start),
                dur(last.saturating_duration_since(done)),
            );
            if executions.load(Relaxed) != 1 {
                report::target(
                    format!("{}: {WAITERS} requests on one key run once", backend.name()),
                    format!("{} executions", executions.load(Relaxed)),
                    false,
                );
            }
        }
        // A waiter claims, subscribes, announces and claims again, then claims once more when woken:
        // at most 4 store operations, whatever the wait (fewer when it arrives after the completion).
        // Only PostgreSQL's announcement reaches the store; the others' is a no-op, counted anyway.
        let max = per_waiter.iter().copied().fold(0f64, f64::max);
        let listed: Vec<String> = per_waiter.iter().map(|x| format!("{x:.2}")).collect();
        report::target(
            format!(
                "{}: store operations per waiter constant (≤ 4 whether the handler takes {} ms or {} ms)",
                backend.name(),
                HOLDS_MS[0],
                HOLDS_MS[HOLDS_MS.len() - 1]
            ),
            format!("{} per waiter", listed.join(" / ")),
            max <= 4.0 + 1e-9,
        );
    }
}

/// When the last of `tasks` was answered (each returns the instant it was, or `None` for an
/// error), and how many errors there were.
async fn answered(
    tasks: Vec<tokio::task::JoinHandle<Option<Instant>>>,
) -> (Option<Instant>, usize) {
    let mut last = None::<Instant>;
    let mut errors = 0;
    for t in tasks {
        match t.await.expect("waiter panicked") {
            Some(at) => last = Some(last.map_or(at, |l| l.max(at))),
            None => errors += 1,
        }
    }
    (last, errors)
}

/// The transactional storm's handler times: the last outlasts the pool's acquire timeout
/// (`DEFAULT_ACQUIRE_TIMEOUT`, 3 s), which is where duplicates holding connections turned into 503s.
const TX_HOLDS_MS: [u64; 3] = [10, 1000, 4000];

/// The same storm in transactional mode on PostgreSQL (`Transactional::begin`, the store's default
/// pool), with one request on another key sent halfway through the original's handler: the pool
/// in use at that moment and how long that request takes show whether the waiting duplicates hold
/// connections (they wait for the key's turn instead, `transaction::turns`).
pub(crate) async fn transactional(handles: &[(Backend, Handle)]) {
    use idem_runtime::transaction::{Transactional, TxBegin};
    let Some(store) = handles.iter().find_map(|(_, h)| match h {
        Handle::Postgres(s) => Some(s.clone()),
        _ => None,
    }) else {
        return;
    };
    println!("\n### Transactional mode (PostgreSQL): {WAITERS} concurrent requests on one key\n");
    println!("Through `Transactional::begin` on the store's default pool; the one that claims holds its transaction open for the handler time, then completes and commits. Halfway through, one request on another key is sent through the same engine.\n");
    println!("| handler time | executions | replays / errors | all answered after | connections in use when the other key is sent | the other key answered after |");
    println!("|---|---|---|---|---|---|");
    let id = std::process::id();
    for hold in TX_HOLDS_MS {
        let txn = Transactional::new(Engine::from_arc(store.clone()), store.clone())
            .expect("the engine's own store");
        let key = RecordKey::new("contention-tx", format!("{hold}-{id}"));
        let barrier = Arc::new(tokio::sync::Barrier::new(WAITERS));
        let executions = Arc::new(AtomicU64::new(0));
        let replays = Arc::new(AtomicU64::new(0));
        let entered = Arc::new(tokio::sync::Notify::new());
        let start = Instant::now();
        let mut tasks = Vec::with_capacity(WAITERS);
        for _ in 0..WAITERS {
            let (txn, key, barrier) = (txn.clone(), key.clone(), barrier.clone());
            let (executions, replays) = (executions.clone(), replays.clone());
            let entered = entered.clone();
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                match txn.begin(key, fingerprint(), &POLICY).await {
                    Ok(TxBegin::Execute(claim)) => {
                        executions.fetch_add(1, Relaxed);
                        entered.notify_one();
                        tokio::time::sleep(Duration::from_millis(hold)).await;
                        claim.complete(&response()).await.is_ok()
                    }
                    Ok(TxBegin::Replay(_)) => {
                        replays.fetch_add(1, Relaxed);
                        true
                    }
                    Err(_) => false,
                }
                .then(Instant::now)
            }));
        }
        tokio::time::timeout(Duration::from_secs(60), entered.notified())
            .await
            .expect("one of the requests executes");
        tokio::time::sleep(Duration::from_millis(hold / 2)).await;
        let pool = store.pool();
        // Two separate readings, so a connection may move between them.
        let in_use = (pool.size() as usize).saturating_sub(pool.num_idle());
        let other = RecordKey::new("contention-tx", format!("other-{hold}-{id}"));
        let sent = Instant::now();
        let other_ok = match txn.begin(other, fingerprint(), &POLICY).await {
            Ok(TxBegin::Execute(claim)) => claim.complete(&response()).await.is_ok(),
            _ => false,
        };
        let other_after = sent.elapsed();
        let (last, errors) = answered(tasks).await;
        let last = last.unwrap_or(start);
        let executions = executions.load(Relaxed);
        println!(
            "| {hold} ms | {executions} | {} / {errors} | {} | {in_use} of {} | {}{} |",
            replays.load(Relaxed),
            dur(last - start),
            pool.options().get_max_connections(),
            dur(other_after),
            if other_ok { "" } else { " (failed)" },
        );
        // From a handler of 1 s on, the duplicates' look-ups are over when the other key is sent:
        // only the original's transaction should hold a connection then.
        let settled = hold >= 1000;
        report::target(
            format!(
                "PostgreSQL transactional, {hold} ms handler: {WAITERS} requests on one key run once, the others replay{}",
                if settled { ", waiting without a connection" } else { "" }
            ),
            format!(
                "{executions} executions, {errors} errors; {in_use} connections in use while they wait, another key {} after {}",
                if other_ok { "answered" } else { "failed" },
                dur(other_after)
            ),
            executions == 1 && errors == 0 && other_ok && (!settled || in_use <= 1),
        );
    }
}
