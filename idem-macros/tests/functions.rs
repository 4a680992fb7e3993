//! `#[idempotent(key = ...)]` on plain async functions, run against a memory store: each test
//! counts how often the body ran, not only what the calls returned.
#![deny(warnings)]
// The functions are written as the crates users write, where `pub` items are reachable.
#![allow(unreachable_pub)]

use idem_runtime::function::{Attempt, OnceError};
use idem_runtime::policy::Policy;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{idempotent, Engine, Rejection};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct Receipt {
    /// The body's run that produced it.
    run: u32,
    downstream: String,
}

#[derive(Debug, serde::Serialize)]
struct ChargeMessage {
    id: String,
    user: u64,
    amount: u32,
}

fn message(id: &str, amount: u32) -> ChargeMessage {
    ChargeMessage {
        id: id.into(),
        user: 7,
        amount,
    }
}

#[derive(Debug)]
enum ChargeError {
    Network,
    BadAmount(std::num::ParseIntError),
    Idem(OnceError),
}

impl From<OnceError> for ChargeError {
    fn from(e: OnceError) -> Self {
        ChargeError::Idem(e)
    }
}

impl From<std::num::ParseIntError> for ChargeError {
    fn from(e: std::num::ParseIntError) -> Self {
        ChargeError::BadAmount(e)
    }
}

/// A queue consumer, as the issue writes it: the engine is a field, the method takes `&self`.
struct Consumer {
    engine: Engine,
    runs: AtomicU32,
    /// The next run fails (a network error) instead of charging.
    fail_next: AtomicBool,
    /// The downstream key of every run, failed ones included.
    downstream: Mutex<Vec<String>>,
}

impl Consumer {
    fn new() -> Self {
        Consumer {
            engine: Engine::new(MemoryStore::new()),
            runs: AtomicU32::new(0),
            fail_next: AtomicBool::new(false),
            downstream: Mutex::new(Vec::new()),
        }
    }

    /// Charges once per message id.
    #[idempotent(engine = self.engine, scope = msg.user, key = msg.id, input = msg, attempt = attempt, ttl = "24h", lease = "30s")]
    pub async fn charge(&self, msg: ChargeMessage) -> Result<Receipt, ChargeError> {
        let downstream = attempt.downstream_key().to_owned();
        self.downstream
            .lock()
            .expect("no panic")
            .push(downstream.clone());
        if self.fail_next.swap(false, SeqCst) {
            return Err(ChargeError::Network);
        }
        let run = self.runs.fetch_add(1, SeqCst) + 1;
        assert_eq!(msg.amount, 1000);
        Ok(Receipt { run, downstream })
    }

    fn runs(&self) -> u32 {
        self.runs.load(SeqCst)
    }
}

#[tokio::test]
async fn the_body_runs_once_per_key_and_a_retry_gets_its_output() {
    let consumer = Consumer::new();
    let first = consumer.charge(message("m-1", 1000)).await.expect("runs");
    for _ in 0..3 {
        let again = consumer
            .charge(message("m-1", 1000))
            .await
            .expect("replays");
        assert_eq!(again, first);
    }
    assert_eq!(consumer.runs(), 1);
    let other = consumer.charge(message("m-2", 1000)).await.expect("runs");
    assert_eq!(other.run, 2);
    assert_ne!(other.downstream, first.downstream);
    assert_eq!(consumer.runs(), 2);
}

#[tokio::test]
async fn another_input_under_the_same_key_reaches_the_error_type_as_a_mismatch() {
    let consumer = Consumer::new();
    consumer.charge(message("m-1", 1000)).await.expect("runs");
    let other = consumer.charge(message("m-1", 2000)).await;
    assert!(
        matches!(
            other,
            Err(ChargeError::Idem(OnceError::Rejected(
                Rejection::Mismatch { .. }
            )))
        ),
        "{other:?}"
    );
    assert_eq!(consumer.runs(), 1);
}

#[tokio::test]
async fn an_err_releases_the_key_and_the_next_call_runs_with_the_same_downstream_key() {
    let consumer = Consumer::new();
    consumer.fail_next.store(true, SeqCst);
    let failed = consumer.charge(message("m-1", 1000)).await;
    assert!(matches!(failed, Err(ChargeError::Network)), "{failed:?}");
    assert_eq!(consumer.runs(), 0);
    let retried = consumer
        .charge(message("m-1", 1000))
        .await
        .expect("runs again");
    assert_eq!(consumer.runs(), 1);
    // The downstream key is the record's: the same on every attempt at it.
    let seen = consumer.downstream.lock().expect("no panic").clone();
    assert_eq!(seen, [retried.downstream.clone(), retried.downstream]);
}

/// A free function: the engine by reference, a literal scope, no fingerprint check (`input =
/// ()`), `?` converting through `From`, and a policy named once.
const JOBS: Policy = Policy::new().ttl(Duration::from_secs(3600));

#[idempotent(engine = engine, scope = "jobs", key = job, input = (), policy = JOBS, retain = "2h")]
async fn run_job(
    engine: &Engine,
    job: u32,
    amount: &str,
    runs: &AtomicU32,
) -> Result<u64, ChargeError> {
    let amount: u64 = amount.parse()?;
    runs.fetch_add(1, SeqCst);
    Ok(amount * 2)
}

#[tokio::test]
async fn a_free_function_with_a_borrowed_engine_and_no_input_check() {
    let (engine, runs) = (Engine::new(MemoryStore::new()), AtomicU32::new(0));
    assert_eq!(run_job(&engine, 1, "21", &runs).await.expect("runs"), 42);
    // `input = ()`: another amount under the same key is a retry, and gets the first output.
    assert_eq!(run_job(&engine, 1, "50", &runs).await.expect("replays"), 42);
    assert_eq!(runs.load(SeqCst), 1);
    // `?` returns the body's error, which releases the key.
    let bad = run_job(&engine, 2, "x", &runs).await;
    assert!(
        matches!(&bad, Err(ChargeError::BadAmount(e)) if *e.kind() == std::num::IntErrorKind::InvalidDigit),
        "{bad:?}"
    );
    assert_eq!(run_job(&engine, 2, "5", &runs).await.expect("runs"), 10);
    assert_eq!(runs.load(SeqCst), 2);
}

/// Receivers by value and by `&mut`, with the engine in an `Arc`.
struct Mailer {
    engine: Arc<Engine>,
    sent: Vec<String>,
}

impl Mailer {
    #[idempotent(engine = self.engine, scope = "mail", key = to, input = to, attempt = attempt)]
    async fn send(&mut self, to: &str) -> Result<String, ChargeError> {
        self.sent.push(to.to_owned());
        Ok(attempt.downstream_key().to_owned())
    }

    #[idempotent(engine = self.engine, scope = "mail", key = format!("farewell-{to}"), input = to, wait = "0s")]
    async fn farewell(self, to: String) -> Result<usize, ChargeError> {
        Ok(self.sent.len() + to.len())
    }
}

#[tokio::test]
async fn self_by_mut_reference_and_by_value_with_an_arc_engine() {
    let mut mailer = Mailer {
        engine: Arc::new(Engine::new(MemoryStore::new())),
        sent: Vec::new(),
    };
    let first = mailer.send("a@example.com").await.expect("sends");
    let again = mailer.send("a@example.com").await.expect("replays");
    assert_eq!(first, again);
    assert!(!first.is_empty());
    assert_eq!(mailer.sent, ["a@example.com"]);
    let engine = mailer.engine.clone();
    assert_eq!(mailer.farewell("b".into()).await.expect("runs"), 2);
    // The output was stored: a new mailer with nothing sent gets it back.
    let fresh = Mailer {
        engine,
        sent: Vec::new(),
    };
    assert_eq!(fresh.farewell("b".into()).await.expect("replays"), 2);
}

/// Generic functions work too; the attempt is the same type the function face hands out.
#[idempotent(engine = engine, scope = "generic", key = id, input = item, attempt = attempt)]
async fn store_item<T: serde::Serialize + Sync>(
    engine: Engine,
    id: u32,
    item: &T,
) -> Result<bool, ChargeError> {
    let _: &Attempt = &attempt;
    Ok(!attempt.taken_over())
}

#[tokio::test]
async fn a_generic_function_with_the_engine_by_value() {
    let engine = Engine::new(MemoryStore::new());
    assert!(store_item(engine.clone(), 1, &"x").await.expect("runs"));
    let other = store_item(engine, 1, &"y").await;
    assert!(
        matches!(
            other,
            Err(ChargeError::Idem(OnceError::Rejected(
                Rejection::Mismatch { .. }
            )))
        ),
        "{other:?}"
    );
}

#[tokio::test]
async fn concurrent_redeliveries_on_spawned_tasks_share_one_run() {
    // A consumer spawns a task per message: the function's future must be `Send`.
    let consumer = Arc::new(Consumer::new());
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let consumer = consumer.clone();
            tokio::spawn(async move { consumer.charge(message("m-1", 1000)).await })
        })
        .collect();
    let mut outputs = Vec::new();
    for task in tasks {
        outputs.push(
            task.await
                .expect("no panic")
                .expect("runs, waits or replays"),
        );
    }
    assert_eq!(consumer.runs(), 1);
    assert!(outputs.iter().all(|o| *o == outputs[0]), "{outputs:?}");
}
