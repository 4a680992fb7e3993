//! The function face of the engine: any async work, run once per key.
//!
//! A queue consumer, a job runner or a service calling another service hears the same retry as an
//! HTTP server: a redelivered message, a job run again, a call repeated after a timeout. With
//! [`Engine::once`] the work runs once per [`RecordKey`]; its output is stored (as JSON, through
//! serde) and returned to every later call with the key, and a call made while the first one runs
//! waits for it and gets the same output. The rules are the HTTP path's ([`Engine::begin`]):
//!
//! | the store finds | `once` |
//! |---|---|
//! | nothing | runs the work, renewing the claim's lease while it runs, and stores its `Ok` output |
//! | a stored output, same input | returns it without running anything |
//! | the key used with another input | [`OnceError::Rejected`] with [`Rejection::Mismatch`] |
//! | a running call, same input | waits up to `policy.wait`, then returns its output ([`Rejection::InFlight`] at the bound) |
//! | a call whose worker died (lease run out) | takes it over and runs the work again, with [`Attempt::taken_over`] and the same [`Attempt::downstream_key`] |
//! | the key past its ttl | [`Rejection::Expired`] |
//! | the store unreachable | [`Rejection::Unavailable`]: the work never runs |
//!
//! **Errors of the work release the key.** An `Err` means the work did not finish; the key is
//! given back and the next call with it runs the work again, with the same downstream key. A
//! failure that is the final answer (a card declined, an unknown account) is an output: make it a
//! variant of the `Ok` type (`enum Charge { Captured { .. }, Declined { .. } }`), and it is stored
//! and returned to every retry like any other. This is [`ServerErrors::Release`](crate::policy::ServerErrors)'s
//! rule; `server_errors`, `client_errors` and the HTTP options of the [`Policy`] do not apply to a
//! function. Its output is stored whole, whatever `max_stored_body` says.
//!
//! The `#[idempotent]` attribute (feature `macros`, on by default) with `key = ...` writes the call for an
//! `async fn` (`#[idempotent(engine = self.engine, scope = msg.user, key = msg.id, input = msg)]`):
//! see its section "On plain async functions".
//!
//! ```
//! use idem_runtime::function::Attempt;
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::{Engine, Fingerprint, Policy, RecordKey};
//!
//! #[derive(serde::Serialize)]
//! struct Order { item: &'static str, quantity: u32 }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::new(MemoryStore::new());
//! let order = Order { item: "apple", quantity: 2 };
//! let key = RecordKey::new("orders", "message-7f3a");
//! let runs = &std::sync::atomic::AtomicU32::new(0);
//! let place = |attempt: Attempt| async move {
//!     // Pass attempt.downstream_key() to every service that takes an idempotency key.
//!     let n = runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
//!     Ok::<_, std::io::Error>(format!("order {n} under {}", attempt.downstream_key()))
//! };
//! let first: String = engine.once(key.clone(), Fingerprint::of_input(&order)?, &Policy::new(), place).await?;
//! // The redelivery gets the stored output; its work does not run.
//! let again: String = engine.once(key, Fingerprint::of_input(&order)?, &Policy::new(), place).await?;
//! assert_eq!(first, again);
//! assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
//! # Ok(()) }
//! ```

use crate::engine::{Begin, ClaimGuard, Engine, Rejection, Replay};
use crate::fingerprint::Fingerprint;
use crate::policy::Policy;
use crate::record::{RecordKey, StoredResponse};
use crate::store::StoreError;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::future::Future;

/// The status a stored function output carries in its record, so that an operator reading the
/// record (`idem inspect`) tells it from an HTTP response at a glance.
const OUTPUT_STATUS: u16 = 200;

/// What the work learns about the claim it runs under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    downstream_key: String,
    taken_over: bool,
}

impl Attempt {
    /// A key for the services the work calls (a card network, another idempotent API), the same on
    /// every attempt at this record, the takeover of a dead worker's claim included: see
    /// [`RecordKey::downstream_key`].
    pub fn downstream_key(&self) -> &str {
        &self.downstream_key
    }

    /// Whether this attempt took over the claim of a worker that stopped renewing it (crashed, or
    /// cut off from the store for a whole lease). The earlier attempt may have had effects: the
    /// downstream key is what keeps them from happening twice.
    pub fn taken_over(&self) -> bool {
        self.taken_over
    }
}

/// Why [`Engine::once`] returned no output, besides the work's own error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OnceError {
    /// The engine refused to run the work: the key is used with another input, still running
    /// elsewhere, expired, or the store is unavailable. See [`Rejection`].
    #[error(transparent)]
    Rejected(#[from] Rejection),
    /// The work ran and returned its output, but the output could not be stored: another worker
    /// took the key over meanwhile, or the store refused the record. The work's effects happened;
    /// a later call takes the key over once its lease runs out and runs the work again with the
    /// same downstream key.
    #[error("the work ran but its output could not be stored")]
    NotStored(#[source] StoreError),
    /// The input or the output could not be turned into JSON.
    #[error("could not encode the call as JSON")]
    Encode(#[source] serde_json::Error),
    /// The stored output does not read as the output type (the type changed since it was stored,
    /// or another function uses the same scope and key).
    #[error("the stored output does not read as this function's output")]
    Decode(#[source] serde_json::Error),
}

impl OnceError {
    /// Whether the same call may succeed later, with the same key: the key is still running
    /// elsewhere, the store is unavailable, or the output could not be stored. A queue consumer
    /// requeues such a message and dead-letters the others.
    pub fn is_retryable(&self) -> bool {
        match self {
            OnceError::Rejected(rejection) => matches!(
                rejection,
                Rejection::InFlight { .. } | Rejection::Unavailable { .. }
            ),
            OnceError::NotStored(_) => true,
            OnceError::Encode(_) | OnceError::Decode(_) => false,
        }
    }
}

impl From<serde_json::Error> for OnceError {
    /// An input that could not be fingerprinted ([`Fingerprint::of_input`]).
    fn from(e: serde_json::Error) -> Self {
        OnceError::Encode(e)
    }
}

/// The error of [`Engine::once`]: the work's own, or the engine's.
#[derive(Debug, thiserror::Error)]
pub enum CallError<E> {
    /// The work ran and failed; the key was released, so the next call runs it again.
    #[error("the work failed")]
    Failed(#[source] E),
    /// The work did not run, or its output was not stored.
    #[error(transparent)]
    Once(#[from] OnceError),
}

impl<E> CallError<E> {
    /// The engine's error, or `None` for the work's own.
    pub fn into_once_error(self) -> Option<OnceError> {
        match self {
            CallError::Once(e) => Some(e),
            CallError::Failed(_) => None,
        }
    }

    /// Whether the same call may succeed later with the same key: every failure of the work (it
    /// released the key), and the engine's retryable ones ([`OnceError::is_retryable`]).
    pub fn is_retryable(&self) -> bool {
        match self {
            CallError::Failed(_) => true,
            CallError::Once(e) => e.is_retryable(),
        }
    }
}

impl Engine {
    /// Runs `work` once per `key`: see [the module](crate::function). `fingerprint` tells a retry
    /// of this call ([`Fingerprint::of_input`] of its input) from another call under the same key.
    ///
    /// The work gets the [`Attempt`] it runs as. Its `Ok` output is stored and returned; its `Err`
    /// releases the key and is returned as [`CallError::Failed`]. A stored output is returned
    /// without running `work`. Dropping the returned future while the work runs leaves the claim
    /// to its lease, as a crash would.
    pub async fn once<O, E, W, Fut>(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
        work: W,
    ) -> Result<O, CallError<E>>
    where
        O: Serialize + DeserializeOwned,
        W: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<O, E>>,
    {
        let begun = self.begin(key, fingerprint, policy).await;
        run(begun, work).await
    }

    /// [`once`](Self::once) with time standing still, as
    /// [`begin_without_timers`](Self::begin_without_timers): for the loom models only.
    #[cfg(loom)]
    #[doc(hidden)]
    pub async fn once_without_timers<O, E, W, Fut>(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
        work: W,
    ) -> Result<O, CallError<E>>
    where
        O: Serialize + DeserializeOwned,
        W: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Result<O, E>>,
    {
        let begun = self.begin_without_timers(key, fingerprint, policy).await;
        run(begun, work).await
    }
}

/// Carries out the engine's decision: replays, or runs the work under the claim and settles it.
async fn run<O, E, W, Fut>(begun: Result<Begin, Rejection>, work: W) -> Result<O, CallError<E>>
where
    O: Serialize + DeserializeOwned,
    W: FnOnce(Attempt) -> Fut,
    Fut: Future<Output = Result<O, E>>,
{
    let claim = match begun.map_err(OnceError::from)? {
        Begin::Replay(replay) => return replayed(&replay),
        Begin::Execute(claim) => claim,
    };
    let result = claim.keep_alive(work(attempt(&claim))).await;
    let stored = match output(result) {
        Ok(stored) => stored,
        Err(e) => {
            give_back(claim).await;
            return Err(e);
        }
    };
    match claim.complete(&stored.1).await {
        Ok(()) => Ok(stored.0),
        Err(e) => Err(OnceError::NotStored(e).into()),
    }
}

/// The output a replay carries.
fn replayed<O: DeserializeOwned, E>(replay: &Replay) -> Result<O, CallError<E>> {
    serde_json::from_slice(&replay.response.body).map_err(|e| OnceError::Decode(e).into())
}

fn attempt(claim: &ClaimGuard) -> Attempt {
    Attempt {
        downstream_key: claim.downstream_key(),
        taken_over: claim.taken_over(),
    }
}

/// The work's output with the record that stores it, or why there is nothing to store.
fn output<O: Serialize, E>(result: Result<O, E>) -> Result<(O, StoredResponse), CallError<E>> {
    let output = result.map_err(CallError::Failed)?;
    let body = serde_json::to_vec(&output).map_err(OnceError::Encode)?;
    let stored = StoredResponse {
        status: OUTPUT_STATUS,
        headers: Vec::new(),
        body: body.into(),
    };
    Ok((output, stored))
}

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
impl<S: crate::transaction::TransactionalStore> crate::Transactional<S> {
    /// [`Engine::once`] in transactional mode: the work writes through the [`Tx`](crate::Tx) it is
    /// given, and those writes commit in one transaction with the stored output, on the database
    /// that holds the records (see [`transaction`](crate::transaction)). A crash before that commit
    /// leaves none of the writes and the claim to its lease; after it, writes and output exist
    /// together. An `Err` of the work rolls the writes back and releases the key.
    ///
    /// Make the foreign calls (with [`Attempt::downstream_key`]) before the first
    /// [`Tx::conn`](crate::Tx::conn): a transaction begun earlier holds its connection while
    /// they wait.
    ///
    /// ```no_run
    /// use idem_runtime::store::sqlite::SqliteStore;
    /// use idem_runtime::{sqlx, Fingerprint, Policy, RecordKey, Transactional};
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let txn = Transactional::new(SqliteStore::connect("sqlite://app.db?mode=rwc").await?);
    /// let input = ("apple", 2);
    /// let key = RecordKey::new("orders", "message-7f3a");
    /// let id: i64 = txn
    ///     .once(key, Fingerprint::of_input(&input)?, &Policy::new(), |_attempt, mut tx| async move {
    ///         let row: (i64,) = sqlx::query_as("INSERT INTO orders (item, qty) VALUES (?, ?) RETURNING id")
    ///             .bind(input.0)
    ///             .bind(input.1)
    ///             .fetch_one(tx.conn().await?)
    ///             .await?;
    ///         Ok::<_, sqlx::Error>(row.0)
    ///     })
    ///     .await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub async fn once<O, E, W, Fut>(
        &self,
        key: RecordKey,
        fingerprint: Fingerprint,
        policy: &Policy,
        work: W,
    ) -> Result<O, CallError<E>>
    where
        O: Serialize + DeserializeOwned,
        W: FnOnce(Attempt, crate::Tx<S::Database>) -> Fut,
        Fut: Future<Output = Result<O, E>>,
    {
        use crate::transaction::TxBegin;
        let mut claim = match self.begin(key, fingerprint, policy).await {
            Err(rejection) => return Err(OnceError::from(rejection).into()),
            Ok(TxBegin::Replay(replay)) => return replayed(&replay),
            Ok(TxBegin::Execute(claim)) => claim,
        };
        let (lent, home) = claim.tx.lend();
        let result = claim
            .guard
            .keep_alive(work(attempt(&claim.guard), lent))
            .await;
        if !home.restore(&mut claim.tx) {
            tracing::error!(target: "idem", key = %claim.guard.key(),
                "the work kept its idem transaction past its end; nothing was committed");
            let kept = StoreError::unavailable("the work kept its transaction past its end");
            let _ = claim.rollback().await;
            return Err(OnceError::NotStored(kept).into());
        }
        let stored = match output(result) {
            Ok(stored) => stored,
            Err(e) => {
                if let Err(error) = claim.rollback().await {
                    tracing::warn!(target: "idem", %error,
                        "could not release the key of a failed call; it is taken over after its lease");
                }
                return Err(e);
            }
        };
        match claim.complete(&stored.1).await {
            Ok(()) => Ok(stored.0),
            Err(e) => Err(OnceError::NotStored(e).into()),
        }
    }
}

/// Releases a claim whose work did not finish. A release the store misses leaves the record to
/// its lease: the next call takes it over then, so the failure is only logged.
async fn give_back(claim: ClaimGuard) {
    let key = claim.key().clone();
    if let Err(e) = claim.release().await {
        tracing::warn!(target: "idem", scope = %key.scope(), key = %key.key(), error = %e,
            "could not release the key of a failed call; it is taken over after its lease");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::TokioClock;
    use crate::metrics::Outcome;
    use crate::store::memory::MemoryStore;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Receipt {
        charge: u32,
        downstream: String,
    }

    fn charge_input(amount: u32) -> Fingerprint {
        Fingerprint::of_input(&serde_json::json!({"amount": amount, "currency": "KRW"}))
            .expect("JSON input")
    }

    /// A work that counts its runs and answers with its run number and downstream key.
    type Charging<'a> = std::pin::Pin<Box<dyn Future<Output = Result<Receipt, String>> + 'a>>;

    fn charging<'a>(runs: &'a AtomicU32) -> impl FnOnce(Attempt) -> Charging<'a> {
        move |attempt| {
            Box::pin(async move {
                let charge = runs.fetch_add(1, Ordering::SeqCst) + 1;
                Ok(Receipt {
                    charge,
                    downstream: attempt.downstream_key().to_owned(),
                })
            })
        }
    }

    #[tokio::test]
    async fn the_work_runs_once_and_every_retry_gets_its_output() {
        let engine = Engine::new(MemoryStore::new());
        let (runs, policy, key) = (AtomicU32::new(0), Policy::new(), RecordKey::new("q", "m-1"));
        let first = engine
            .once(key.clone(), charge_input(1000), &policy, charging(&runs))
            .await
            .expect("runs");
        for _ in 0..3 {
            let again = engine
                .once(key.clone(), charge_input(1000), &policy, charging(&runs))
                .await
                .expect("replays");
            assert_eq!(again, first);
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(engine.metrics().get(Outcome::Replayed), 3);
    }

    #[tokio::test]
    async fn another_input_under_the_same_key_is_refused_without_running() {
        let engine = Engine::new(MemoryStore::new());
        let (runs, policy, key) = (AtomicU32::new(0), Policy::new(), RecordKey::new("q", "m-1"));
        engine
            .once(key.clone(), charge_input(1000), &policy, charging(&runs))
            .await
            .expect("runs");
        let other = engine
            .once(key, charge_input(2000), &policy, charging(&runs))
            .await;
        assert!(matches!(
            other,
            Err(CallError::Once(OnceError::Rejected(
                Rejection::Mismatch { .. }
            )))
        ));
        assert!(!other.is_err_and(|e| e.is_retryable()));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_failed_work_releases_the_key_and_the_next_call_runs_with_the_same_downstream_key() {
        let engine = Engine::new(MemoryStore::new());
        let (policy, key) = (Policy::new(), RecordKey::new("q", "m-1"));
        let mut seen = Vec::new();
        let failed = engine
            .once(key.clone(), charge_input(1000), &policy, |a: Attempt| {
                seen.push(a.downstream_key().to_owned());
                async { Err::<Receipt, _>("card network down") }
            })
            .await;
        assert!(matches!(
            failed,
            Err(CallError::Failed("card network down"))
        ));
        let runs = AtomicU32::new(0);
        let retried = engine
            .once(key, charge_input(1000), &policy, charging(&runs))
            .await
            .expect("the retry runs");
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(seen, [retried.downstream]);
    }

    #[tokio::test(start_paused = true)]
    async fn concurrent_duplicates_wait_for_the_one_run_and_share_its_output() {
        let engine = Engine::new(MemoryStore::new());
        let policy = Policy::new().wait(Duration::from_secs(60));
        let runs = Arc::new(AtomicU32::new(0));
        let calls = (0..10).map(|_| {
            let (engine, runs) = (engine.clone(), runs.clone());
            tokio::spawn(async move {
                let key = RecordKey::new("q", "m-1");
                engine
                    .once(key, charge_input(1000), &policy, |a: Attempt| async move {
                        // The paused clock moves only once every duplicate is parked waiting.
                        tokio::time::sleep(Duration::from_secs(2)).await;
                        let charge = runs.fetch_add(1, Ordering::SeqCst) + 1;
                        Ok::<_, String>(Receipt {
                            charge,
                            downstream: a.downstream_key().to_owned(),
                        })
                    })
                    .await
            })
        });
        let calls: Vec<_> = calls.collect();
        let mut outputs = Vec::new();
        for call in calls {
            outputs.push(
                call.await
                    .expect("no panic")
                    .expect("every call gets the output"),
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert!(outputs.iter().all(|o| *o == outputs[0]));
        assert_eq!(engine.metrics().get(Outcome::Waited), 9);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_workers_call_is_taken_over_after_its_lease_with_the_same_downstream_key() {
        let engine = Engine::new(MemoryStore::new().with_clock(TokioClock::new()));
        let policy = Policy::new()
            .lease(Duration::from_secs(5))
            .wait(Duration::from_secs(60));
        let key = RecordKey::new("q", "m-1");
        let started = tokio::sync::Notify::new();
        let mut first_key = String::new();
        let dying = engine.once(key.clone(), charge_input(1000), &policy, |a: Attempt| {
            first_key = a.downstream_key().to_owned();
            async {
                started.notify_one();
                std::future::pending::<Result<Receipt, String>>().await
            }
        });
        // The worker dies mid-work: its future is dropped, its claim left to its lease.
        tokio::select! {
            _ = dying => unreachable!("the work never ends"),
            () = started.notified() => {}
        }
        let start = tokio::time::Instant::now();
        let mut heir_taken_over = false;
        let runs = AtomicU32::new(0);
        let output = engine
            .once(key, charge_input(1000), &policy, |a: Attempt| {
                heir_taken_over = a.taken_over();
                charging(&runs)(a)
            })
            .await
            .expect("the heir runs");
        assert!(heir_taken_over);
        assert_eq!(output.downstream, first_key);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(engine.metrics().get(Outcome::TakenOver), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_running_call_keeps_its_claim_however_long_its_work() {
        let engine = Engine::new(MemoryStore::new().with_clock(TokioClock::new()));
        let policy = Policy::new()
            .lease(Duration::from_secs(3))
            .wait(Duration::from_secs(1));
        let key = RecordKey::new("q", "m-1");
        let runs = AtomicU32::new(0);
        let long = engine.once(
            key.clone(),
            charge_input(1000),
            &policy,
            |a: Attempt| async {
                // Ten leases long.
                tokio::time::sleep(Duration::from_secs(30)).await;
                charging(&runs)(a).await
            },
        );
        let duplicates = async {
            let mut conflicts = 0;
            // Each finds the key held (1.5 s apart plus its 1 s wait: done within 25 s).
            for _ in 0..10 {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                let dup = engine
                    .once(key.clone(), charge_input(1000), &policy, charging(&runs))
                    .await;
                match dup {
                    Err(CallError::Once(OnceError::Rejected(Rejection::InFlight { .. }))) => {
                        conflicts += 1
                    }
                    other => panic!("a duplicate got {other:?} while the work ran"),
                }
            }
            conflicts
        };
        let (output, conflicts) = tokio::join!(long, duplicates);
        assert_eq!(conflicts, 10);
        assert_eq!(output.expect("the long call stores its output").charge, 1);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        assert_eq!(engine.metrics().get(Outcome::TakenOver), 0);
    }

    #[tokio::test]
    async fn a_worker_taken_over_while_alive_cannot_store_its_output() {
        // Record time is the manual clock's; tokio's real clock never reaches a renewal here.
        let clock = crate::clock::ManualClock::new(crate::clock::Timestamp::from_millis(1_000_000));
        let engine = Engine::new(MemoryStore::new().with_clock(clock.clone()));
        let policy = Policy::new()
            .lease(Duration::from_secs(30))
            .wait(Duration::ZERO);
        let key = RecordKey::new("q", "m-1");
        let (runs, started, go_on) = (
            AtomicU32::new(0),
            tokio::sync::Notify::new(),
            tokio::sync::Notify::new(),
        );
        let slow = engine.once(
            key.clone(),
            charge_input(1000),
            &policy,
            |a: Attempt| async {
                started.notify_one();
                go_on.notified().await;
                charging(&runs)(a).await
            },
        );
        let heir = async {
            // The slow worker's lease runs out on the store's clock; an identical call takes over.
            started.notified().await;
            clock.advance(Duration::from_secs(31));
            let output = engine
                .once(key.clone(), charge_input(1000), &policy, charging(&runs))
                .await;
            go_on.notify_one();
            output
        };
        let (slow, heir) = tokio::join!(slow, heir);
        let heir = heir.expect("the heir runs and stores its output");
        assert!(
            matches!(slow, Err(CallError::Once(OnceError::NotStored(_)))),
            "the fenced worker's output is refused: {slow:?}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2);
        let replay = engine
            .once(key, charge_input(1000), &policy, charging(&runs))
            .await
            .expect("the heir's output is kept");
        assert_eq!(replay, heir);
    }

    #[tokio::test]
    async fn a_stored_output_of_another_type_is_a_decode_error_not_a_panic() {
        let engine = Engine::new(MemoryStore::new());
        let (runs, policy, key) = (AtomicU32::new(0), Policy::new(), RecordKey::new("q", "m-1"));
        engine
            .once(key.clone(), charge_input(1000), &policy, charging(&runs))
            .await
            .expect("runs");
        let other: Result<Vec<u8>, CallError<String>> = engine
            .once(key, charge_input(1000), &policy, |_| async { Ok(vec![1]) })
            .await;
        assert!(matches!(other, Err(CallError::Once(OnceError::Decode(_)))));
    }
}
