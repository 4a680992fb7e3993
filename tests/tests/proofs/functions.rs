//! Property tests of the function face (`Engine::once`): tasks on two instances race random calls
//! on a few keys, each call's work finishing with an output, failing (which releases the key) or
//! dying mid-work (its future dropped, its claim left to a lease that never ends here), and every
//! call's result is checked against what the others saw:
//!
//! - never two works running for one (scope, key) at once, never a work run for a key that has an
//!   output already,
//! - every output returned is the one its key stored, never another input's nor another scope's,
//! - a failed work leaves the key free: a later call runs (or finds another runner in flight),
//! - afterwards, every stored output is returned by either instance without running anything.
//!
//! The same seed and budget as `model.rs` (`PROPTEST_CASES`, `IDEM_MODEL_SEED`).

use crate::proof_support::{engines, instances, racing_runner};
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::function::{Attempt, CallError, OnceError};
use idem_runtime::store::Purge;
use idem_runtime::{Fingerprint, Policy, RecordKey, Rejection};
use idem_tests::conformance::Backend;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SCOPES: u8 = 2;
const KEYS: u8 = 2;
const INPUTS: u8 = 2;

/// What a call's work does.
#[derive(Debug, Clone, Copy)]
enum Work {
    Output,
    Fail,
    /// The worker dies mid-work: the call's future is dropped while the work runs.
    Die,
}

/// One call: (scope, key, input, its work, whether it waits for a running duplicate).
type Call = (u8, u8, u8, Work, bool);

fn scripts() -> impl Strategy<Value = Vec<Vec<Call>>> {
    let work = prop_oneof![6 => Just(Work::Output), 2 => Just(Work::Fail), 1 => Just(Work::Die)];
    let call = (0..SCOPES, 0..KEYS, 0..INPUTS, work, any::<bool>());
    prop::collection::vec(prop::collection::vec(call, 1..10), 3..6)
}

/// A work's output: which execution produced it, for which call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Output {
    exec: u64,
    scope: u8,
    key: u8,
    input: u8,
}

/// What the racing tasks saw, per (scope, key).
#[derive(Default)]
struct Seen {
    /// The execution running each key's work, if any (a dead worker's for ever: no clock moves).
    running: HashMap<(u8, u8), u64>,
    /// The output each key stored.
    stored: HashMap<(u8, u8), Output>,
}

fn input(n: u8) -> Fingerprint {
    Fingerprint::of_input(&serde_json::json!({"amount": 1000 + u32::from(n), "currency": "KRW"}))
        .expect("JSON input")
}

fn policy(wait: bool) -> Policy {
    // A short wait lets duplicates meet the completion's wake-up; its length decides nothing
    // the checks rely on.
    let wait = if wait {
        Duration::from_millis(50)
    } else {
        Duration::ZERO
    };
    Policy::new()
        .lease(Duration::from_secs(30))
        .wait(wait)
        .handler("functions")
}

async fn run_race<S: idem_runtime::Store + Purge>(
    instances: &[Arc<S>],
    scripts: Vec<Vec<Call>>,
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
            for (scope, key, inp, work, wait) in script {
                let k = (scope, key);
                let record_key = RecordKey::new(format!("{case}-s{scope}"), format!("k{key}"));
                let dying = tokio::sync::Notify::new();
                let run = |_: Attempt| {
                    let exec = execs.fetch_add(1, Ordering::SeqCst) + 1;
                    let mut s = seen.lock().expect("lock");
                    let started = match (s.running.get(&k), s.stored.get(&k)) {
                        (Some(other), _) => {
                            Err(format!("two works for one key at once: {other} and {exec}"))
                        }
                        (_, Some(done)) => {
                            Err(format!("execution {exec} ran a key stored with {done:?}"))
                        }
                        _ => Ok(()),
                    };
                    let output = Output {
                        exec,
                        scope,
                        key,
                        input: inp,
                    };
                    match (work, &started) {
                        // Stored before the store has it, so that no later run goes unseen.
                        (Work::Output, Ok(())) => {
                            s.stored.insert(k, output.clone());
                        }
                        (Work::Fail | Work::Die, Ok(())) => {
                            s.running.insert(k, exec);
                        }
                        _ => {}
                    }
                    drop(s);
                    let (dying, seen) = (&dying, &seen);
                    async move {
                        started?;
                        match work {
                            Work::Output => Ok(output),
                            Work::Fail => {
                                // Given up before the store releases it, as the failure returns.
                                seen.lock().expect("lock").running.remove(&k);
                                Err("the work failed".to_owned())
                            }
                            Work::Die => {
                                dying.notify_one();
                                std::future::pending().await
                            }
                        }
                    }
                };
                let policy = policy(wait);
                let call = engine.once(record_key, input(inp), &policy, run);
                let result = tokio::select! {
                    result = call => Some(result),
                    () = dying.notified() => None,
                };
                let Some(result) = result else { continue };
                match result {
                    Ok(output) => {
                        if (output.scope, output.key, output.input) != (scope, key, inp) {
                            return Err(format!("returned another call's output: {output:?}"));
                        }
                        let s = seen.lock().expect("lock");
                        if s.stored.get(&k) != Some(&output) {
                            return Err(format!(
                                "returned {output:?}, the key stored {:?}",
                                s.stored.get(&k)
                            ));
                        }
                    }
                    Err(CallError::Failed(e)) if e == "the work failed" => {}
                    Err(CallError::Failed(e)) => return Err(e),
                    Err(CallError::Once(OnceError::Rejected(
                        Rejection::Mismatch { .. } | Rejection::InFlight { .. },
                    ))) => {}
                    Err(other) => return Err(format!("unexpected error: {other:?}")),
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
    // Afterwards every stored output is returned by either instance, its work not run again.
    let stored = seen.lock().expect("lock").stored.clone();
    for (&(scope, key), output) in &stored {
        let record_key = RecordKey::new(format!("{case}-s{scope}"), format!("k{key}"));
        for engine in &engines {
            let again: Result<Output, CallError<String>> = engine
                .once(
                    record_key.clone(),
                    input(output.input),
                    &policy(false),
                    |_| async { Err("ran again".to_owned()) },
                )
                .await;
            match again {
                Ok(replayed) if replayed == *output => {}
                other => {
                    return Err(TestCaseError::fail(format!(
                        "{record_key} lost its output {output:?}: {other:?}"
                    )))
                }
            }
        }
    }
    Ok(())
}

fn race<B: Backend>(make: impl std::future::Future<Output = B>) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let backend = runtime.block_on(make);
    // The store clock never moves here, so a dead worker's lease never ends.
    let stores = runtime.block_on(instances(
        &backend,
        &ManualClock::new(Timestamp::from_millis(1_800_000_000_000)),
    ));
    let run = uuid::Uuid::new_v4().simple().to_string();
    let n = AtomicU64::new(0);
    let mut runner = racing_runner();
    let result = runner.run(&scripts(), |scripts| {
        let case = format!("fn-{run}-{}", n.fetch_add(1, Ordering::Relaxed));
        runtime.block_on(run_race(&stores, scripts, &case))
    });
    drop(stores);
    if let Err(e) = result {
        panic!("{e}");
    }
}

macro_rules! race_tests {
    ($($(#[$attr:meta])* $backend:ident),*) => {
        $(
            $(#[$attr])*
            #[test]
            fn $backend() {
                race(crate::proof_support::$backend());
            }
        )*
    };
}

race_tests!(
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
