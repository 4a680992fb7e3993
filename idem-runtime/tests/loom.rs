//! Schedule exploration with loom: every interleaving of the memory store's and the wake-up
//! registry's locks and the registry's count of waited-on keys, and of the engine's duplicate
//! protocol over them (two models only up to a bound of preemptions).
//!
//! Run with (about a minute once built, a few minutes from cold; `--nocapture` prints each model's
//! schedule count; see "Schedule exploration (loom)" in docs/reliability.md):
//!
//! ```sh
//! RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
//!   cargo test -p idem-runtime --release --no-default-features --test loom -- --nocapture
//! ```
//!
//! Under `--cfg loom`, `idem_runtime`'s `crate::sync` is loom's, so each lock taken by
//! `MemoryStore` and `Waiters`, and each operation on `Waiters`' count of waited-on keys, is a point
//! where loom may switch threads (a fence is not, but loom orders by it); each model below runs once
//! per distinct schedule (all of them, unless the model says it is bounded). A wake-up that is lost
//! leaves a thread parked in `block_on` with nobody left to wake it, which loom reports as a
//! deadlock; every other property is an assertion that must hold in every schedule. What loom does
//! not reach (tokio's timers, the database stores) is listed in docs/reliability.md.
#![cfg(loom)]

use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::metrics::Outcome;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::{
    Claim, ClaimOutcome, Claimed, Found, Store, StoreError, StoreErrorKind, Subscription, Waiters,
};
use idem_runtime::{
    Begin, Engine, FencingToken, Fingerprint, Policy, Record, RecordKey, RecordState,
    StoredResponse,
};
use loom::future::block_on;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::sync::PoisonError;
use std::task::{Context, Wake, Waker};
use std::time::{Duration, Instant};

/// Runs `model` under every schedule loom distinguishes, reports how many there were, and checks
/// that the schedules took each of the `expected` ways through the model (so a model cannot pass by
/// never reaching the interleaving it is about).
///
/// The search is exhaustive unless `LOOM_MAX_PREEMPTIONS` bounds it.
fn explore(name: &str, expected: &[&str], model: impl Fn(&Tally) + Sync + Send + 'static) {
    check(name, loom::model::Builder::new(), expected, model);
}

/// [`explore`] for a model too large to search exhaustively on every run: only the schedules that
/// preempt a running thread at most `preemptions` times (a thread blocking on a lock or in
/// `block_on` does not count). Most concurrency bugs need two or three.
fn explore_bounded(
    name: &str,
    preemptions: usize,
    expected: &[&str],
    model: impl Fn(&Tally) + Sync + Send + 'static,
) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = builder.preemption_bound.or(Some(preemptions));
    check(name, builder, expected, model);
}

fn check(
    name: &str,
    builder: loom::model::Builder,
    expected: &[&str],
    model: impl Fn(&Tally) + Sync + Send + 'static,
) {
    let tally = std::sync::Arc::new(Tally::default());
    let shared = tally.clone();
    let bound = builder.preemption_bound;
    let start = Instant::now();
    builder.check(move || {
        shared.saw("schedule");
        model(&shared);
    });
    let seen = tally.0.lock().unwrap_or_else(PoisonError::into_inner);
    let bound = bound.map_or("exhaustive".to_owned(), |b| {
        format!("at most {b} preemptions")
    });
    println!("loom {name} ({bound}): {:.2?}, {seen:?}", start.elapsed());
    for way in expected {
        assert!(
            seen.contains_key(way),
            "{name}: no schedule went `{way}`: {seen:?}"
        );
    }
}

/// How many schedules took each way through a model.
#[derive(Default)]
struct Tally(std::sync::Mutex<BTreeMap<&'static str, usize>>);

impl Tally {
    fn saw(&self, way: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(way)
            .or_default() += 1;
    }
}

const NOW: Timestamp = Timestamp::from_millis(1_000_000);
const LEASE: Duration = Duration::from_secs(30);

fn key() -> RecordKey {
    RecordKey::new("user-7", "order-42")
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of_request("POST", "/orders", None, b"two apples")
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: "created".into(),
    }
}

/// A claim of [`key`] with `token`.
fn claim(key: &RecordKey, token: i64) -> Claim<'_> {
    Claim {
        key,
        fingerprint: fingerprint(),
        token: FencingToken(token),
        lease: LEASE,
        ttl: Duration::from_secs(3600),
        retain: Duration::from_secs(7200),
    }
}

/// An empty store judging time by a clock standing at [`NOW`] (a std atomic, set only before a
/// model's threads start), and the clock.
fn store_at_now() -> (Arc<MemoryStore>, ManualClock) {
    let clock = ManualClock::new(NOW);
    (
        Arc::new(MemoryStore::new().with_clock(clock.clone())),
        clock,
    )
}

/// A store holding [`key`] in flight under token 1, and its clock.
fn store_in_flight() -> (Arc<MemoryStore>, ManualClock) {
    let (store, clock) = store_at_now();
    let k = key();
    let claimed = block_on(store.claim(&claim(&k, 1)));
    assert!(matches!(
        claimed,
        Ok(ClaimOutcome::Claimed(Claimed {
            taken_over: false,
            ..
        }))
    ));
    (store, clock)
}

/// The record of [`key`], if any.
fn record(store: &MemoryStore) -> Option<Record> {
    let found = block_on(store.get(&key())).expect("the memory store does not fail");
    found.map(|found| found.record)
}

fn is_completed(store: &MemoryStore) -> bool {
    match block_on(store.get(&key())).map(|found| found.map(|found| found.record)) {
        Ok(Some(record)) => matches!(record.state, RecordState::Completed { .. }),
        Ok(None) => false,
        Err(e) => panic!("the memory store failed: {e}"),
    }
}

/// A waker that counts how often it is woken (it is only read after the threads are joined).
#[derive(Default)]
struct CountingWaker(std::sync::atomic::AtomicUsize);

impl Wake for CountingWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl CountingWaker {
    fn count(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

// ---------------------------------------------------------------------------------------------
// The wake-up registry
// ---------------------------------------------------------------------------------------------

/// No lost wake-up, through the store: a duplicate subscribes, then re-reads the record, then waits;
/// the original completes (writes, then notifies). Whatever the interleaving, the duplicate either
/// sees the completion when it re-reads or is woken, and then sees it.
#[test]
fn a_subscriber_that_rechecks_never_misses_a_completion() {
    explore(
        "subscribe-recheck vs complete",
        &["seen on re-check", "woken"],
        |tally| {
            let (store, _clock) = store_in_flight();
            let completer = {
                let store = store.clone();
                thread::spawn(move || {
                    block_on(store.complete(&key(), FencingToken(1), &response()))
                        .expect("the holder completes its own claim");
                })
            };
            let mut subscription = store.subscribe(&key());
            if is_completed(&store) {
                tally.saw("seen on re-check");
            } else {
                block_on(subscription.changed());
                assert!(
                    is_completed(&store),
                    "woken before the completion was written"
                );
                tally.saw("woken");
            }
            completer.join().expect("the completer does not panic");
        },
    );
}

/// The waiter's side of the flag models: subscribes to the key, then re-reads `done` (`Acquire`), and
/// waits for a notification only if the flag was not yet set; woken, it must find the flag set.
/// Returns which way it went.
fn subscribe_and_recheck(waiters: &Waiters, done: &AtomicBool) -> &'static str {
    let mut subscription = waiters.subscribe(&key());
    if done.load(Ordering::Acquire) {
        return "seen on re-check";
    }
    block_on(subscription.changed());
    assert!(done.load(Ordering::Acquire), "woken before the write");
    "woken"
}

/// The writer's side of the flag models, on a thread of its own: sets `done` (`Release`), then
/// wakes the key's waiters through `wake`.
fn set_then_wake(
    waiters: &Arc<Waiters>,
    done: &Arc<AtomicBool>,
    wake: fn(&Waiters),
) -> thread::JoinHandle<()> {
    let (waiters, done) = (waiters.clone(), done.clone());
    thread::spawn(move || {
        done.store(true, Ordering::Release);
        wake(&waiters);
    })
}

/// One waiter ([`subscribe_and_recheck`]) against one writer that wakes it through `wake`
/// ([`set_then_wake`]); both ways through must occur.
fn one_waiter_rechecks_a_flag(name: &str, wake: fn(&Waiters)) {
    explore(name, &["seen on re-check", "woken"], move |tally| {
        let waiters = Arc::new(Waiters::new());
        let done = Arc::new(AtomicBool::new(false));
        let notifier = set_then_wake(&waiters, &done, wake);
        tally.saw(subscribe_and_recheck(&waiters, &done));
        notifier.join().expect("the notifier does not panic");
    });
}

/// The same through `notify_all`, the path PostgreSQL's and Redis's listeners take after a
/// reconnect: a waiter on one key is woken by a notification addressed to every key.
#[test]
fn notify_all_wakes_a_subscriber_that_rechecks() {
    one_waiter_rechecks_a_flag("subscribe-recheck vs notify_all", Waiters::notify_all);
}

/// No lost wake-up when nothing but an atomic orders the write and the re-read: the writer sets a
/// flag with `Release` and notifies; the waiter subscribes, then reads the flag with `Acquire`. No
/// lock is shared between them, and `notify` skips the registry's lock when it counts no waited-on
/// key, so only `Waiters`' two `SeqCst` fences keep each side from missing the other's write (the
/// store-buffering pattern). Without either fence, a schedule deadlocks.
#[test]
fn a_subscriber_that_rechecks_a_flag_never_misses_a_notify() {
    one_waiter_rechecks_a_flag("subscribe-recheck vs notify, lock-free flag", |waiters| {
        waiters.notify(&key())
    });
}

/// The same with two waiters on one key: the second subscription joins the entry the first made,
/// so it does not change the count of waited-on keys itself, and must still not miss the notify (it
/// is the one model that fails if `subscribe` fences only when it made the entry). **Bounded** to
/// schedules with at most 3 preemptions (exhaustive, an earlier shape of it did not finish in 7
/// minutes).
#[test]
fn two_subscribers_that_recheck_a_flag_never_miss_a_notify() {
    explore_bounded(
        "2 subscribe-recheck vs notify, lock-free flag",
        3,
        &["seen on re-check", "woken"],
        |tally| {
            let waiters = Arc::new(Waiters::new());
            let done = Arc::new(AtomicBool::new(false));
            let other = {
                let (waiters, done) = (waiters.clone(), done.clone());
                thread::spawn(move || subscribe_and_recheck(&waiters, &done))
            };
            let notifier = set_then_wake(&waiters, &done, |waiters| waiters.notify(&key()));
            tally.saw(subscribe_and_recheck(&waiters, &done));
            tally.saw(other.join().expect("a waiter does not panic"));
            notifier.join().expect("the notifier does not panic");
            assert_eq!(
                waiters.waiting_keys(),
                0,
                "no entry outlives its subscriptions"
            );
        },
    );
}

/// Registry hygiene while someone waits: another task subscribing and dropping its subscription
/// (twice, so its entry would be created and removed again if ours were not counted) never removes
/// the entry a live subscription holds, so a concurrent notify still reaches it; once the last
/// subscription drops, no entry is left.
#[test]
fn churn_never_removes_an_entry_someone_holds() {
    explore("subscribe/drop churn vs notify, one holder", &[], |_| {
        let waiters = Arc::new(Waiters::new());
        let mut held = waiters.subscribe(&key());
        let churn = {
            let waiters = waiters.clone();
            thread::spawn(move || {
                for _ in 0..2 {
                    let passing = waiters.subscribe(&key());
                    drop(passing);
                }
            })
        };
        let notifier = {
            let waiters = waiters.clone();
            thread::spawn(move || waiters.notify(&key()))
        };
        // The notify comes after `held` subscribed, so it must reach it.
        block_on(held.changed());
        churn.join().expect("churn does not panic");
        notifier.join().expect("the notifier does not panic");
        assert_eq!(
            waiters.waiting_keys(),
            1,
            "the held subscription keeps its entry"
        );
        drop(held);
        assert_eq!(
            waiters.waiting_keys(),
            0,
            "the last subscription takes the entry"
        );
    });
}

/// Registry hygiene with nobody holding on: two tasks subscribe and drop concurrently with a notify.
/// While a task holds its subscription the entry exists; after all have dropped, none is left.
#[test]
fn concurrent_subscribers_leave_no_entry_behind() {
    explore("subscribe/drop x2 vs notify", &[], |_| {
        let waiters = Arc::new(Waiters::new());
        let subscriber = |waiters: Arc<Waiters>| {
            thread::spawn(move || {
                let subscription = waiters.subscribe(&key());
                assert_eq!(
                    waiters.waiting_keys(),
                    1,
                    "an entry exists while it is held"
                );
                drop(subscription);
            })
        };
        let first = subscriber(waiters.clone());
        let second = subscriber(waiters.clone());
        waiters.notify(&key());
        first.join().expect("a subscriber does not panic");
        second.join().expect("a subscriber does not panic");
        assert_eq!(
            waiters.waiting_keys(),
            0,
            "no entry outlives its subscriptions"
        );
    });
}

/// Polls `subscription.changed()` once with `waker`, then drops it, as `tokio::select!` does when
/// another branch wins. Returns the subscription and whether the poll was pending.
fn poll_once_and_cancel(mut subscription: Subscription, waker: &Waker) -> (Subscription, bool) {
    let pending = pin!(subscription.changed())
        .poll(&mut Context::from_waker(waker))
        .is_pending();
    (subscription, pending)
}

/// Cancel safety, part one: a notification that arrives around a cancelled `changed()` is not lost
/// for that subscription, and still reaches another subscriber blocked on the same key.
#[test]
fn a_cancelled_changed_loses_no_notification() {
    explore(
        "cancelled changed vs waiter vs notify",
        &["cancelled while pending", "notified before the poll"],
        |tally| {
            let waiters = Arc::new(Waiters::new());
            let cancelled = waiters.subscribe(&key());
            let mut waiting = waiters.subscribe(&key());
            let canceller = thread::spawn(move || {
                let witness = Waker::from(std::sync::Arc::new(CountingWaker::default()));
                poll_once_and_cancel(cancelled, &witness)
            });
            let waiter = thread::spawn(move || block_on(waiting.changed()));
            waiters.notify(&key());
            let (mut cancelled, pending) = canceller.join().expect("the canceller does not panic");
            waiter.join().expect("the other subscriber is woken");
            if pending {
                // The notify came after the poll that returned pending, so nothing consumed it:
                // the subscription's next `changed` resolves at once.
                let waker = Waker::from(std::sync::Arc::new(CountingWaker::default()));
                let ready = pin!(cancelled.changed()).poll(&mut Context::from_waker(&waker));
                assert!(ready.is_ready(), "the cancellation lost the notification");
                tally.saw("cancelled while pending");
            } else {
                tally.saw("notified before the poll");
            }
            drop(cancelled);
            assert_eq!(waiters.waiting_keys(), 0);
        },
    );
}

/// Cancel safety, part two: a cancelled `changed()` takes its waker out of the registry, racing
/// another subscriber that registers its own on the same key, so a later notify wakes only the
/// live waiter and never the dropped future's waker.
#[test]
fn a_cancelled_changed_leaves_no_waker_behind() {
    explore("cancelled changed vs waiter, then notify", &[], |_| {
        let waiters = Arc::new(Waiters::new());
        let cancelled = waiters.subscribe(&key());
        let mut waiting = waiters.subscribe(&key());
        let witness = std::sync::Arc::new(CountingWaker::default());
        let canceller = {
            let witness = Waker::from(witness.clone());
            thread::spawn(move || poll_once_and_cancel(cancelled, &witness))
        };
        let waiter = thread::spawn(move || block_on(waiting.changed()));
        let (cancelled, pending) = canceller.join().expect("the canceller does not panic");
        assert!(pending, "nothing was notified yet");
        waiters.notify(&key());
        waiter.join().expect("the other subscriber is woken");
        assert_eq!(
            witness.count(),
            0,
            "the dropped future's waker was left registered"
        );
        drop(cancelled);
        assert_eq!(waiters.waiting_keys(), 0);
    });
}

// ---------------------------------------------------------------------------------------------
// The memory store
// ---------------------------------------------------------------------------------------------

/// The claim is atomic: three requests claiming one fresh key, exactly one holds it.
#[test]
fn three_claims_of_one_key_one_wins() {
    explore(
        "claim x3",
        &["token 1 won", "token 2 won", "token 3 won"],
        |tally| {
            let (store, _clock) = store_at_now();
            let claimants: Vec<_> = (1..=3)
                .map(|token| {
                    let store = store.clone();
                    thread::spawn(move || {
                        let k = key();
                        match block_on(store.claim(&claim(&k, token))) {
                            Ok(ClaimOutcome::Claimed(won)) => {
                                assert!(!won.taken_over, "nothing to take over");
                                Some(token)
                            }
                            Ok(ClaimOutcome::Existing(Found { record, .. })) => {
                                assert_eq!(
                                    record.state,
                                    RecordState::InFlight {
                                        lease_until: NOW + LEASE
                                    }
                                );
                                None
                            }
                            Err(e) => panic!("the memory store failed: {e}"),
                        }
                    })
                })
                .collect();
            let winners: Vec<i64> = claimants
                .into_iter()
                .filter_map(|claimant| claimant.join().expect("a claimant does not panic"))
                .collect();
            assert_eq!(winners.len(), 1, "exactly one claim wins, got {winners:?}");
            tally.saw(["token 1 won", "token 2 won", "token 3 won"][(winners[0] - 1) as usize]);
            let record = record(&store).expect("the winner's record is there");
            assert_eq!(
                record.token,
                FencingToken(winners[0]),
                "the record is the winner's"
            );
        },
    );
}

/// Complete, release and a fresh claim race on an in-flight key. Exactly one of complete and release
/// applies; a completed record is never overwritten by the claim; the claim wins only after the
/// release; and a released key that the racing claim missed is claimable again.
#[test]
fn complete_release_and_claim_keep_the_record_consistent() {
    explore(
        "complete vs release vs claim",
        &[
            "completed",
            "released, then claimed",
            "released, claim missed it",
        ],
        |tally| {
            let (store, _clock) = store_in_flight();
            let completer = {
                let store = store.clone();
                thread::spawn(move || {
                    block_on(store.complete(&key(), FencingToken(1), &response()))
                })
            };
            let releaser = {
                let store = store.clone();
                thread::spawn(move || block_on(store.release(&key(), FencingToken(1))))
            };
            let k = key();
            let claimed = match block_on(store.claim(&claim(&k, 2))) {
                Ok(ClaimOutcome::Claimed(won)) => {
                    assert!(!won.taken_over, "a live lease is never taken over");
                    true
                }
                Ok(ClaimOutcome::Existing(_)) => false,
                Err(e) => panic!("the memory store failed: {e}"),
            };
            let completed = completer.join().expect("the completer does not panic");
            let released = releaser.join().expect("the releaser does not panic");
            let fenced = |result: &Result<(), StoreError>| matches!(result, Err(e) if e.kind() == StoreErrorKind::Fenced);
            let record = record(&store);
            match (completed.is_ok(), released.is_ok()) {
                (true, false) => {
                    assert!(
                        fenced(&released),
                        "the release was refused by its token: {released:?}"
                    );
                    assert!(
                        !claimed,
                        "a claim never overwrites an in-flight or completed record"
                    );
                    let record = record.expect("a completed record stays");
                    assert_eq!(record.token, FencingToken(1));
                    assert_eq!(
                        record.state,
                        RecordState::Completed {
                            response: response()
                        }
                    );
                    tally.saw("completed");
                }
                (false, true) => {
                    assert!(
                        fenced(&completed),
                        "the completion was refused by its token: {completed:?}"
                    );
                    if claimed {
                        let record = record.expect("the new claim's record");
                        assert_eq!(record.token, FencingToken(2));
                        assert!(matches!(record.state, RecordState::InFlight { .. }));
                        tally.saw("released, then claimed");
                    } else {
                        let record = record.expect("a released record stays for its request");
                        assert_eq!(record.state, RecordState::Released);
                        let again = block_on(store.claim(&claim(&k, 3)));
                        assert!(matches!(
                            again,
                            Ok(ClaimOutcome::Claimed(Claimed {
                                taken_over: false,
                                ..
                            }))
                        ));
                        tally.saw("released, claim missed it");
                    }
                }
                both => panic!("exactly one of complete and release applies, got {both:?}"),
            }
        },
    );
}

/// A takeover after the lease ran out races the old holder's late completion: exactly one wins.
/// Either the completion lands first and the takeover finds a completed record, or the takeover
/// lands first and fences the completion out.
#[test]
fn a_takeover_and_a_late_completion_exactly_one_wins() {
    explore(
        "takeover vs late complete",
        &["took over", "completion first"],
        |tally| {
            let (store, clock) = store_in_flight();
            clock.set(NOW + LEASE);
            let late = {
                let store = store.clone();
                thread::spawn(move || {
                    block_on(store.complete(&key(), FencingToken(1), &response()))
                })
            };
            let k = key();
            let took_over = match block_on(store.claim(&claim(&k, 2))) {
                Ok(ClaimOutcome::Claimed(won)) => {
                    assert!(won.taken_over, "the only way in is a takeover");
                    true
                }
                Ok(ClaimOutcome::Existing(Found { record, .. })) => {
                    assert!(matches!(record.state, RecordState::Completed { .. }));
                    false
                }
                Err(e) => panic!("the memory store failed: {e}"),
            };
            let completed = late.join().expect("the completer does not panic");
            assert_eq!(
                completed.is_ok(),
                !took_over,
                "exactly one of takeover and completion wins"
            );
            let record = record(&store).expect("the record stays");
            let winner = if took_over { 2 } else { 1 };
            assert_eq!(record.token, FencingToken(winner));
            tally.saw(if took_over {
                "took over"
            } else {
                "completion first"
            });
        },
    );
}

/// A renewal races a takeover at the moment the lease runs out: exactly one wins. Either the
/// renewal lands first and the claim finds a live lease (no takeover), or the takeover lands first
/// and the renewal is refused. A claim taken over is never renewed, and a takeover never happens
/// once a renewal has landed.
#[test]
fn a_renewal_and_a_takeover_exactly_one_wins() {
    explore(
        "renewal vs takeover",
        &["renewed first", "took over"],
        |tally| {
            let (store, clock) = store_in_flight();
            let at_lease_end = NOW + LEASE;
            clock.set(at_lease_end);
            let renewal = {
                let store = store.clone();
                thread::spawn(move || block_on(store.renew(&key(), FencingToken(1), LEASE)))
            };
            let k = key();
            let took_over = match block_on(store.claim(&claim(&k, 2))) {
                Ok(ClaimOutcome::Claimed(won)) => {
                    assert!(won.taken_over, "the only way in is a takeover");
                    true
                }
                Ok(ClaimOutcome::Existing(Found { record, .. })) => {
                    assert_eq!(
                        record.state,
                        RecordState::InFlight {
                            lease_until: at_lease_end + LEASE
                        },
                        "a claim refused only by the renewed lease"
                    );
                    false
                }
                Err(e) => panic!("the memory store failed: {e}"),
            };
            let renewed = renewal.join().expect("the renewer does not panic");
            assert_eq!(
                renewed.is_ok(),
                !took_over,
                "exactly one of renewal and takeover wins"
            );
            let record = record(&store).expect("the record stays");
            assert_eq!(record.token, FencingToken(if took_over { 2 } else { 1 }));
            tally.saw(if took_over {
                "took over"
            } else {
                "renewed first"
            });
        },
    );
}

// ---------------------------------------------------------------------------------------------
// The engine's duplicate protocol
// ---------------------------------------------------------------------------------------------

/// An engine over `store` on a clock that stands still, without a tokio timeout around store calls.
fn engine(store: std::sync::Arc<MemoryStore>) -> Engine {
    Engine::from_arc(store)
        .with_clock(ManualClock::new(NOW))
        .with_store_timeout(None)
}

fn begin_first(engine: &Engine, policy: &Policy) -> idem_runtime::ClaimGuard {
    match block_on(engine.begin(key(), fingerprint(), policy)) {
        Ok(Begin::Execute(guard)) => guard,
        other => panic!("the first request runs, got {other:?}"),
    }
}

/// The real `Engine::begin` loop (claim, subscribe, claim again, wait, claim again) for a duplicate
/// racing the original's completion, with time standing still: the duplicate can only finish by
/// seeing the completion, never by a timer. It replays the stored response in every schedule.
#[test]
fn a_waiting_duplicate_replays_the_completion() {
    explore(
        "engine: duplicate vs complete",
        &["replayed at once", "replayed after subscribing"],
        |tally| {
            let store = std::sync::Arc::new(MemoryStore::new());
            let engine = engine(store.clone());
            let policy = Policy::new().wait(Duration::from_secs(60));
            let original = begin_first(&engine, &policy);
            let duplicate = {
                let engine = engine.clone();
                thread::spawn(move || {
                    let policy = Policy::new().wait(Duration::from_secs(60));
                    block_on(engine.begin_without_timers(key(), fingerprint(), &policy))
                })
            };
            block_on(original.complete(&response())).expect("the original completes");
            match duplicate.join().expect("the duplicate does not panic") {
                Ok(Begin::Replay(replay)) => assert_eq!(replay.response, response()),
                other => panic!("the duplicate replays, got {other:?}"),
            }
            tally.saw(match engine.metrics().get(Outcome::Waited) {
                0 => "replayed at once",
                _ => "replayed after subscribing",
            });
            assert_eq!(store.len(), 1);
        },
    );
}

/// The same race with a release (the original answered 5xx or panicked): the duplicate runs the
/// handler itself, in every schedule, and nobody else holds the key meanwhile.
#[test]
fn a_waiting_duplicate_runs_after_a_release() {
    explore("engine: duplicate vs release", &[], |_| {
        let store = std::sync::Arc::new(MemoryStore::new());
        let engine = engine(store.clone());
        let policy = Policy::new().wait(Duration::from_secs(60));
        let original = begin_first(&engine, &policy);
        let duplicate = {
            let engine = engine.clone();
            thread::spawn(move || {
                let policy = Policy::new().wait(Duration::from_secs(60));
                match block_on(engine.begin_without_timers(key(), fingerprint(), &policy)) {
                    Ok(Begin::Execute(guard)) => {
                        assert!(!guard.taken_over(), "the key was free, not taken over");
                        block_on(guard.complete(&response())).expect("the duplicate completes");
                    }
                    other => panic!("the duplicate runs, got {other:?}"),
                }
            })
        };
        block_on(original.release()).expect("the original releases");
        duplicate.join().expect("the duplicate does not panic");
        assert!(is_completed(&store));
    });
}

/// Two duplicates wait on one key while the original completes: the one notify wakes both, and both
/// replay, in every schedule.
#[test]
fn two_waiting_duplicates_both_replay() {
    explore_bounded("engine: 2 duplicates vs complete", 4, &[], |_| {
        let store = std::sync::Arc::new(MemoryStore::new());
        let engine = engine(store.clone());
        let policy = Policy::new().wait(Duration::from_secs(60));
        let original = begin_first(&engine, &policy);
        let duplicates: Vec<_> = (0..2)
            .map(|_| {
                let engine = engine.clone();
                thread::spawn(move || {
                    let policy = Policy::new().wait(Duration::from_secs(60));
                    block_on(engine.begin_without_timers(key(), fingerprint(), &policy))
                })
            })
            .collect();
        block_on(original.complete(&response())).expect("the original completes");
        for duplicate in duplicates {
            match duplicate.join().expect("a duplicate does not panic") {
                Ok(Begin::Replay(replay)) => assert_eq!(replay.response, response()),
                other => panic!("every duplicate replays, got {other:?}"),
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// The function face (`Engine::once`) over the same protocol
// ---------------------------------------------------------------------------------------------

/// Two identical calls race on one key: one runs the work, the other waits for it (or finds its
/// output) and returns the same output, in every schedule; the work runs once.
#[test]
fn two_identical_calls_run_the_work_once() {
    explore(
        "function: call vs call",
        &["returned at once", "returned after waiting"],
        |tally| {
            let store = std::sync::Arc::new(MemoryStore::new());
            let engine = engine(store.clone());
            let runs = Arc::new(loom::sync::atomic::AtomicUsize::new(0));
            let call = |engine: Engine, runs: Arc<loom::sync::atomic::AtomicUsize>| {
                let policy = Policy::new().wait(Duration::from_secs(60));
                let work = |_| async move {
                    let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    Ok::<_, String>(format!("run {run}"))
                };
                block_on(engine.once_without_timers(key(), fingerprint(), &policy, work))
            };
            let other = {
                let (engine, runs) = (engine.clone(), runs.clone());
                thread::spawn(move || call(engine, runs))
            };
            let mine = call(engine.clone(), runs.clone());
            let theirs = other.join().expect("the other call does not panic");
            assert_eq!(mine.expect("my call returns"), "run 1");
            assert_eq!(theirs.expect("the other call returns"), "run 1");
            assert_eq!(runs.load(Ordering::SeqCst), 1);
            tally.saw(match engine.metrics().get(Outcome::Waited) {
                0 => "returned at once",
                _ => "returned after waiting",
            });
        },
    );
}

/// A call whose work fails races an identical one whose work succeeds: the failure releases the
/// key, so the succeeding call runs (or its output is what the failing call finds), and the key
/// ends completed with its output in every schedule.
#[test]
fn a_failed_call_leaves_the_key_to_its_duplicate() {
    explore(
        "function: failing call vs call",
        &["failed first", "succeeded first"],
        |tally| {
            let store = std::sync::Arc::new(MemoryStore::new());
            let engine = engine(store.clone());
            let failing = {
                let engine = engine.clone();
                thread::spawn(move || {
                    let policy = Policy::new().wait(Duration::from_secs(60));
                    let work = |_| async { Err::<String, _>("declined by a dependency") };
                    block_on(engine.once_without_timers(key(), fingerprint(), &policy, work))
                })
            };
            let policy = Policy::new().wait(Duration::from_secs(60));
            let work = |_| async { Ok::<_, &str>("charged".to_owned()) };
            let mine = block_on(engine.once_without_timers(key(), fingerprint(), &policy, work));
            assert_eq!(
                mine.expect("the succeeding call returns its output"),
                "charged"
            );
            let theirs = failing.join().expect("the failing call does not panic");
            tally.saw(match theirs {
                Err(idem_runtime::function::CallError::Failed(_)) => "failed first",
                Ok(output) => {
                    assert_eq!(output, "charged", "it found the other call's output");
                    "succeeded first"
                }
                Err(other) => panic!("the failing call got {other:?}"),
            });
            assert!(is_completed(&store));
        },
    );
}
