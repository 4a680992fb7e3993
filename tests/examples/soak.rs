//! Soak run: the payments example under steady load on one idempotency store, with the sweeper
//! running. Not part of `cargo test`; run with:
//!
//! ```text
//! cargo run --release -p idem-tests --example soak -- <memory|sqlite|postgres|redis> [seconds] [workers]
//! ```
//!
//! The load runs in rounds of 30 s. In a round, `workers` clients create payments under fresh keys
//! for 20 users, and of those requests 20 % are followed by a retry (same key, the JSON re-ordered), 10 % are sent
//! twice at once, and 10 % are followed by a mismatch (same key, another amount). Between rounds the
//! load pauses, the store's clock jumps 8 days (past the 7-day retention) and the sweeper, which
//! runs all along, purges the round's records.
//!
//! Checked after every round and printed: every response to a key named the same payment; every
//! mismatch was a 422; the ledger holds exactly one payment per distinct accepted key (each accepted
//! payment once, and as many payments as keys); the store never held more than one round's records
//! and is empty after each sweep; resident memory per round. The soak forgets each round's keys once
//! checked, so its own bookkeeping does not grow; the ledger (SQLite, kept by design) does.

#[path = "../tests/proofs/proof_support.rs"]
mod proof_support;

use idem_runtime::clock::{Clock, SystemClock, Timestamp};
use idem_runtime::store::Purge;
use idem_runtime::sweeper::Sweeper;
use idem_runtime::{Engine, Store};
use idem_tests::conformance::Backend;
use payments::ledger::Ledger;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const USERS: usize = 20;
const ROUND: Duration = Duration::from_secs(30);
const JUMP: Duration = Duration::from_secs(8 * 24 * 3600);

/// The system clock plus an offset that the soak moves between rounds.
#[derive(Debug, Clone, Default)]
struct JumpClock(Arc<AtomicI64>);

impl Clock for JumpClock {
    fn now(&self) -> Timestamp {
        SystemClock.now() + Duration::from_millis(self.0.load(Ordering::SeqCst) as u64)
    }
}

#[derive(Default)]
struct Tally {
    requests: AtomicU64,
    replays: AtomicU64,
    mismatches: AtomicU64,
    conflicts: AtomicU64,
    violations: Mutex<Vec<String>>,
    /// Per key: the payment every 201 for it named.
    accepted: Mutex<HashMap<String, String>>,
}

impl Tally {
    fn violation(&self, what: String) {
        eprintln!("VIOLATION: {what}");
        self.violations.lock().expect("lock").push(what);
    }
}

fn random() -> u128 {
    uuid::Uuid::new_v4().as_u128()
}

async fn post(
    http: &reqwest::Client,
    base: &str,
    user: &str,
    key: &str,
    body: String,
    tally: &Tally,
) -> Option<(u16, bool, serde_json::Value)> {
    tally.requests.fetch_add(1, Ordering::Relaxed);
    let response = http
        .post(format!("{base}/payments"))
        .bearer_auth(user)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            tally.violation(format!("transport error: {e}"));
            return None;
        }
    };
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotency-replayed");
    let json = response.json().await.unwrap_or(serde_json::Value::Null);
    Some((status, replayed, json))
}

/// Checks one 201 against what the key answered before.
fn accept(tally: &Tally, key: &str, got: &(u16, bool, serde_json::Value)) {
    let (status, replayed, json) = got;
    if *replayed {
        tally.replays.fetch_add(1, Ordering::Relaxed);
    }
    match status {
        201 => {
            let id = json["id"].as_str().unwrap_or_default().to_owned();
            let mut accepted = tally.accepted.lock().expect("lock");
            let first = accepted.entry(key.to_owned()).or_insert_with(|| id.clone());
            if *first != id {
                let first = first.clone();
                drop(accepted);
                tally.violation(format!("key {key} named {first} and then {id}"));
            }
        }
        409 => {
            tally.conflicts.fetch_add(1, Ordering::Relaxed);
        }
        other => tally.violation(format!("key {key}: unexpected status {other}: {json}")),
    }
}

async fn worker(http: reqwest::Client, base: String, until: Instant, tally: Arc<Tally>) {
    while Instant::now() < until {
        let r = random();
        let user = format!("soak-user-{}", r % USERS as u128);
        let key = uuid::Uuid::new_v4().to_string();
        let amount = 1 + (r >> 8) % 10_000;
        let body = format!(r#"{{"amount":{amount},"currency":"KRW"}}"#);
        let reordered = format!(r#"{{ "currency": "KRW", "amount": {amount} }}"#);
        match (r >> 40) % 10 {
            0 | 1 => {
                let Some(first) = post(&http, &base, &user, &key, body, &tally).await else {
                    continue;
                };
                accept(&tally, &key, &first);
                let Some(retry) = post(&http, &base, &user, &key, reordered, &tally).await else {
                    continue;
                };
                if first.0 == 201 && !retry.1 {
                    tally.violation(format!("retry of {key} was not a replay: {retry:?}"));
                }
                accept(&tally, &key, &retry);
            }
            2 => {
                let (a, b) = tokio::join!(
                    post(&http, &base, &user, &key, body.clone(), &tally),
                    post(&http, &base, &user, &key, body, &tally)
                );
                for got in [a, b].into_iter().flatten() {
                    accept(&tally, &key, &got);
                }
            }
            3 => {
                let Some(first) = post(&http, &base, &user, &key, body, &tally).await else {
                    continue;
                };
                accept(&tally, &key, &first);
                let other = format!(r#"{{"amount":{},"currency":"KRW"}}"#, amount + 1);
                let Some(mismatch) = post(&http, &base, &user, &key, other, &tally).await else {
                    continue;
                };
                if mismatch.0 == 422 {
                    tally.mismatches.fetch_add(1, Ordering::Relaxed);
                } else {
                    tally.violation(format!("mismatch on {key} answered {}", mismatch.0));
                }
            }
            _ => {
                let Some(first) = post(&http, &base, &user, &key, body, &tally).await else {
                    continue;
                };
                accept(&tally, &key, &first);
            }
        }
    }
}

/// Payments in the ledger, all or those with `id`.
async fn sqlx_count(ledger: &Ledger, id: Option<&String>) -> i64 {
    let query = match id {
        Some(id) => idem_runtime::sqlx::query_scalar("SELECT count(*) FROM payments WHERE id = ?")
            .bind(id.clone()),
        None => idem_runtime::sqlx::query_scalar("SELECT count(*) FROM payments"),
    };
    let payments::ledger::Database::Sqlite(pool) = ledger.database() else {
        panic!("the soak's ledger is SQLite")
    };
    query.fetch_one(pool).await.expect("count payments")
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

type Counter =
    Box<dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = u64> + Send>> + Send + Sync>;

/// Runs the soak on `store`, which judges time by `clock`.
async fn soak<S: Store + Purge>(
    store: Arc<S>,
    clock: JumpClock,
    count: Counter,
    seconds: u64,
    workers: usize,
) -> bool {
    let engine = Engine::from_arc(store.clone());
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::open(&format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("ledger.db").display()
    ))
    .await
    .expect("ledger");
    let card =
        payments::card::CardNetwork::new(ledger.database().clone(), Duration::from_millis(2));
    let router = payments::router(payments::AppState {
        engine,
        ledger: ledger.clone(),
        card,
        webhook_secret: payments::webhooks::WebhookSecret::new(
            payments::webhooks::DEFAULT_WEBHOOK_SECRET,
        )
        .expect("the default secret"),
        // The soak runs its own sweeper, on the clock it moves.
        background: payments::Background::default(),
        // The records are in the store under test, not in the ledger's database: the ordinary path.
        transactional: None,
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, router).await });
    let sweeper = Sweeper::new(store.clone())
        .interval(Duration::from_millis(500))
        .batch_size(500);
    tokio::spawn(sweeper.run());

    let http = reqwest::Client::new();
    let tally = Arc::new(Tally::default());
    let rounds = seconds.div_ceil(ROUND.as_secs()).max(1);
    let mut max_records = 0;
    let mut rss = Vec::new();
    let mut accepted_total = 0i64;
    println!("round | requests | store records at the end of the round | after the jump and sweep | ledger payments | RSS (MiB)");
    for round in 1..=rounds {
        let until = Instant::now() + ROUND.min(Duration::from_secs(seconds));
        let tasks: Vec<_> = (0..workers)
            .map(|_| tokio::spawn(worker(http.clone(), base.clone(), until, tally.clone())))
            .collect();
        for task in tasks {
            task.await.expect("worker");
        }
        let held = count().await;
        max_records = max_records.max(held);
        clock.0.fetch_add(JUMP.as_millis() as i64, Ordering::SeqCst);
        // The running sweeper purges the round's records; wait for it (bounded) rather than sweep here.
        let waited = Instant::now();
        let mut left = count().await;
        while left > 0 && waited.elapsed() < Duration::from_secs(60) {
            tokio::time::sleep(Duration::from_millis(200)).await;
            left = count().await;
        }
        // The ledger now holds exactly one payment per key accepted so far: check this round's
        // keys, then forget them, so that the soak's own bookkeeping does not grow with the run.
        let round_accepted = std::mem::take(&mut *tally.accepted.lock().expect("lock"));
        let ids: std::collections::HashSet<&String> = round_accepted.values().collect();
        if ids.len() != round_accepted.len() {
            tally.violation(format!("round {round}: two keys named one payment"));
        }
        for id in ids {
            let found: i64 = sqlx_count(&ledger, Some(id)).await;
            if found != 1 {
                tally.violation(format!("payment {id} is in the ledger {found} times"));
            }
        }
        accepted_total += round_accepted.len() as i64;
        drop(round_accepted);
        let ledger_total = sqlx_count(&ledger, None).await;
        if ledger_total != accepted_total {
            tally.violation(format!(
                "round {round}: ledger holds {ledger_total} payments for {accepted_total} accepted keys"
            ));
        }
        let mib = rss_kib() / 1024;
        rss.push(mib);
        println!(
            "{round} | {} | {held} | {left} | {ledger_total} | {mib}",
            tally.requests.load(Ordering::Relaxed)
        );
    }

    let violations = tally.violations.lock().expect("lock").clone();
    println!("requests: {}", tally.requests.load(Ordering::Relaxed));
    println!("distinct accepted keys: {accepted_total}");
    println!("ledger payments: {}", sqlx_count(&ledger, None).await);
    println!(
        "replays: {}, mismatches answered 422: {}, 409s: {}",
        tally.replays.load(Ordering::Relaxed),
        tally.mismatches.load(Ordering::Relaxed),
        tally.conflicts.load(Ordering::Relaxed)
    );
    println!(
        "most records held at once: {max_records}; records after the last sweep: {}",
        count().await
    );
    println!("RSS per round (MiB): {rss:?}");
    println!("violations: {}", violations.len());
    let ok = violations.is_empty()
        && sqlx_count(&ledger, None).await == accepted_total
        && count().await == 0;
    println!("{}", if ok { "SOAK OK" } else { "SOAK FAILED" });
    ok
}

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let which = args.next().unwrap_or_else(|| "memory".to_owned());
    let seconds: u64 = args.next().and_then(|s| s.parse().ok()).unwrap_or(180);
    let workers: usize = args.next().and_then(|s| s.parse().ok()).unwrap_or(16);
    println!("soak: {which}, {seconds} s, {workers} workers");
    // The stores judge time by it; the soak moves it between rounds.
    let clock = JumpClock::default();
    let ok = match which.as_str() {
        "memory" => {
            let store =
                Arc::new(idem_runtime::store::memory::MemoryStore::new().with_clock(clock.clone()));
            let s = store.clone();
            soak(
                store,
                clock,
                Box::new(move || {
                    let n = s.len() as u64;
                    Box::pin(async move { n })
                }),
                seconds,
                workers,
            )
            .await
        }
        "sqlite" => {
            let backend = proof_support::sqlite().await;
            let store = Arc::new(backend.open(Arc::new(clock.clone())).await);
            let pool = store.pool().clone();
            let counter: Counter = Box::new(move || {
                let pool = pool.clone();
                Box::pin(async move {
                    idem_runtime::sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem_records")
                        .fetch_one(&pool)
                        .await
                        .expect("count") as u64
                })
            });
            soak(store, clock, counter, seconds, workers).await
        }
        "postgres" => {
            let backend = proof_support::postgres().await;
            let store = Arc::new(backend.open(Arc::new(clock.clone())).await);
            let pool = store.pool().clone();
            let counter: Counter = Box::new(move || {
                let pool = pool.clone();
                Box::pin(async move {
                    idem_runtime::sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem.records")
                        .fetch_one(&pool)
                        .await
                        .expect("count") as u64
                })
            });
            soak(store, clock, counter, seconds, workers).await
        }
        "redis" => {
            let backend = proof_support::redis().await;
            let store = Arc::new(backend.open(Arc::new(clock.clone())).await);
            let (url, pattern) = (backend.url().to_owned(), format!("{}:*", backend.prefix()));
            let counter: Counter = Box::new(move || {
                let (url, pattern) = (url.clone(), pattern.clone());
                Box::pin(async move {
                    let client = redis::Client::open(url.as_str()).expect("url");
                    let mut conn = client
                        .get_multiplexed_async_connection()
                        .await
                        .expect("connect");
                    let mut n = 0u64;
                    let mut cursor = 0u64;
                    loop {
                        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                            .arg(cursor)
                            .arg("MATCH")
                            .arg(&pattern)
                            .arg("COUNT")
                            .arg(1000)
                            .query_async(&mut conn)
                            .await
                            .expect("scan");
                        // The completions channel is not a key; every key under the prefix is a record.
                        n += keys.len() as u64;
                        cursor = next;
                        if cursor == 0 {
                            break n;
                        }
                    }
                })
            });
            let ok = soak(store, clock, counter, seconds, workers).await;
            drop(backend);
            ok
        }
        other => panic!("unknown store {other}: memory, sqlite, postgres or redis"),
    };
    std::process::exit(if ok { 0 } else { 1 });
}
