//! Scale: claim latency with 10k and with 1M existing records (bulk-loaded directly: SQL, Redis
//! pipelines, the memory store's own claims), then the sweeper's throughput and its effect on
//! concurrent claims.

use crate::floors::fingerprint;
use crate::load::Sample;
use crate::report::{self, dur, rate, Config};
use crate::setup::{Backend, Handle};
use idem_runtime::clock::{Clock, SystemClock, Timestamp};
use idem_runtime::store::{Claim, ClaimOutcome, Store};
use idem_runtime::sweeper::Sweeper;
use idem_runtime::{FencingToken, RecordKey};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const PROBES: usize = 2000;
const SMALL: u64 = 10_000;
const EXPIRED: u64 = 200_000;
/// A day, the retention the bulk-loaded records get.
pub(crate) const DAY_MS: i64 = 86_400_000;

/// `count` records `key-<from>`.. in scope `scope`, completed, with the given retention.
pub(crate) async fn bulk(
    handle: &Handle,
    scope: &str,
    from: u64,
    count: u64,
    now: i64,
    retain: i64,
) {
    let to = from + count;
    let expires = retain.min(now + DAY_MS);
    match handle {
        Handle::Memory(store) => {
            let response = crate::floors::response();
            // Claims stamped in the past when the records are expired already, so that the claim's
            // own eviction leaves them for the sweeper.
            let at = Timestamp::from_millis(if retain <= now { retain - 1 } else { now });
            for i in from..to {
                let key = RecordKey::new(scope, format!("key-{i}"));
                let token = FencingToken::generate();
                let claim = Claim {
                    key: &key,
                    fingerprint: fingerprint(),
                    token,
                    now: at,
                    lease_until: at + Duration::from_secs(60),
                    expires_at: Timestamp::from_millis(expires),
                    retain_until: Timestamp::from_millis(retain),
                };
                store.claim(&claim).await.expect("memory claim");
                store
                    .complete(&key, token, &response)
                    .await
                    .expect("memory complete");
            }
        }
        Handle::Sqlite(store) => {
            let mut at = from;
            while at < to {
                let end = (at + 100_000).min(to);
                sqlx::query(
                    "WITH RECURSIVE n(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM n WHERE i < ?2 - 1)
                     INSERT INTO idem_records (scope, key, fingerprint, token, created_at, expires_at, retain_until,
                                               state, lease_until, status, headers, body)
                     SELECT ?3, 'key-' || i, zeroblob(32), i, ?4, ?5, ?6, 'completed', NULL, 201, '[]', zeroblob(64) FROM n",
                )
                .bind(at as i64)
                .bind(end as i64)
                .bind(scope)
                .bind(now - 1)
                .bind(expires)
                .bind(retain)
                .execute(store.pool())
                .await
                .expect("SQLite bulk insert");
                at = end;
            }
        }
        Handle::Postgres(store) => {
            let mut at = from;
            while at < to {
                let end = (at + 200_000).min(to);
                sqlx::query(
                    "INSERT INTO idem.records (scope, key, fingerprint, token, created_at, expires_at, retain_until,
                                               state, lease_until, status, headers, body)
                     SELECT $3, 'key-' || i, decode(repeat('00', 32), 'hex'), i, $4, $5, $6, 'completed', NULL, 201, '[]',
                            decode(repeat('ab', 64), 'hex')
                     FROM generate_series($1::bigint, $2::bigint - 1) AS i",
                )
                .bind(at as i64)
                .bind(end as i64)
                .bind(scope)
                .bind(now - 1)
                .bind(expires)
                .bind(retain)
                .execute(store.pool())
                .await
                .expect("PostgreSQL bulk insert");
                at = end;
            }
        }
        Handle::Redis(store, conn) => {
            // One record written by the store itself, then copied: the bulk load writes exactly
            // the value the store would (its layout is the store's private business), without a
            // script per record. Claimed at least a day before retention ends, so that the template
            // outlives the copying.
            let mut conn = conn.clone();
            let template_key = RecordKey::new(scope, "bulk-template");
            let at = Timestamp::from_millis((now - 1).min(retain - DAY_MS));
            let token = FencingToken::generate();
            let claim = Claim {
                key: &template_key,
                fingerprint: fingerprint(),
                token,
                now: at,
                lease_until: at + Duration::from_secs(60),
                expires_at: Timestamp::from_millis(expires),
                retain_until: Timestamp::from_millis(retain),
            };
            store.claim(&claim).await.expect("Redis template claim");
            let response = idem_runtime::StoredResponse {
                status: 201,
                headers: vec![],
                body: bytes::Bytes::from_static(b"{}"),
            };
            store
                .complete(&template_key, token, &response)
                .await
                .expect("Redis template complete");
            let template: Vec<u8> = redis::cmd("GETDEL")
                .arg(store.redis_key(&template_key))
                .query_async(&mut conn)
                .await
                .expect("Redis template");
            let ttl = (retain - now).max(1);
            let mut at = from;
            while at < to {
                let end = (at + 5_000).min(to);
                let mut pipe = redis::pipe();
                for i in at..end {
                    let key = store.redis_key(&RecordKey::new(scope, format!("key-{i}")));
                    pipe.cmd("SET")
                        .arg(&key)
                        .arg(&template)
                        .arg("PX")
                        .arg(ttl)
                        .ignore();
                }
                pipe.query_async::<()>(&mut conn)
                    .await
                    .expect("Redis bulk load");
                at = end;
            }
        }
    }
}

/// `n` sequential claims of new keys; their latencies.
async fn probe(store: &Arc<dyn Store>, scope: &str, n: usize, stop: Option<&AtomicBool>) -> Sample {
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0.. {
        if stop.map_or(i >= n, |s| s.load(Ordering::Relaxed)) {
            break;
        }
        let key = RecordKey::new(scope, format!("probe-{i}"));
        let now = SystemClock.now();
        let claim = Claim {
            key: &key,
            fingerprint: fingerprint(),
            token: FencingToken::generate(),
            now,
            lease_until: now + Duration::from_secs(60),
            expires_at: now + Duration::from_secs(86_400),
            retain_until: now + Duration::from_secs(86_400),
        };
        let t = Instant::now();
        let outcome = store.claim(&claim).await;
        lat.push(t.elapsed().as_nanos() as u64);
        assert!(
            matches!(outcome, Ok(ClaimOutcome::Claimed { .. })),
            "probe claim"
        );
        if stop.is_some() {
            // The memory store never yields: let the sweeper's task in.
            tokio::task::yield_now().await;
        }
    }
    lat.sort_unstable();
    Sample {
        ok: lat.len() as u64,
        errors: 0,
        elapsed: start.elapsed(),
        latencies: lat,
    }
}

pub(crate) async fn run(handles: &[(Backend, Handle)], cfg: &Config) {
    let large = cfg.scale.max(SMALL);
    println!("\n## Scale: claim latency against the number of records\n");
    println!("{PROBES} sequential claims of new keys (`Store::claim` alone), with {SMALL} and then {large} completed records in the store (bulk-loaded directly).\n");
    println!("| store | {SMALL} records: p50 / p99 / mean | {large} records: p50 / p99 / mean | p50 ratio | mean ratio | bulk load of {} |", large - SMALL);
    println!("|---|---|---|---|---|---|");
    let id = std::process::id();
    let mut sweeps = Vec::new();
    for (backend, handle) in handles {
        let store = handle.store();
        let now = SystemClock.now().as_millis();
        let scope = format!("bulk-{id}");
        bulk(handle, &scope, 0, SMALL, now, now + DAY_MS).await;
        let small = probe(&store, &format!("small-{id}"), PROBES, None).await;
        let t = Instant::now();
        bulk(handle, &scope, SMALL, large - SMALL, now, now + DAY_MS).await;
        let load_time = t.elapsed();
        let big = probe(&store, &format!("large-{id}"), PROBES, None).await;
        let p50 = big.p50().as_secs_f64() / small.p50().as_secs_f64();
        let mean = big.mean().as_secs_f64() / small.mean().as_secs_f64();
        println!(
            "| {} | {} / {} / {} | {} / {} / {} | {p50:.2}× | {mean:.2}× | {} |",
            backend.name(),
            dur(small.p50()),
            dur(small.p99()),
            dur(small.mean()),
            dur(big.p50()),
            dur(big.p99()),
            dur(big.mean()),
            dur(load_time),
        );
        report::target(
            format!(
                "{}: claim latency at {large} records within 1.5× of {SMALL}",
                backend.name()
            ),
            format!("p50 {p50:.2}×, mean {mean:.2}×"),
            p50 <= 1.5,
        );
        if *backend == Backend::Redis {
            continue; // Redis deletes by TTL; its purge is a keyspace scan, not on any request path.
        }
        // The sweeper: expired records on top of the live ones, purged while claims go on.
        let now = SystemClock.now().as_millis();
        bulk(
            handle,
            &format!("expired-{id}"),
            0,
            EXPIRED,
            now,
            now - 3_600_000,
        )
        .await;
        let idle = probe(&store, &format!("idle-{id}"), PROBES, None).await;
        let stop = Arc::new(AtomicBool::new(false));
        let sweeper = Sweeper::new(handle.purge()).batch_size(1000);
        let sweep_scope = format!("sweep-{id}");
        let t = Instant::now();
        let stopper = stop.clone();
        let sweep = tokio::spawn(async move {
            let purged = sweeper.sweep_once().await;
            let elapsed = t.elapsed();
            stopper.store(true, Ordering::Relaxed);
            (purged, elapsed)
        });
        let during = probe(&store, &sweep_scope, 0, Some(&stop)).await;
        let (purged, elapsed) = sweep.await.expect("sweeper task");
        sweeps.push((backend.name(), purged.unwrap_or(0), elapsed, idle, during));
    }
    println!("\n### Sweeper\n");
    println!("{EXPIRED} expired records added beside the live ones, purged by one `Sweeper::sweep_once` (batches of 1000) while one task claims new keys back to back. Redis is not swept: it deletes records by TTL.\n");
    println!("| store | purged | records purged per second | claims meanwhile | claim p50 / p99 idle | claim p50 / p99 during the sweep |");
    println!("|---|---|---|---|---|---|");
    for (name, purged, elapsed, idle, during) in sweeps {
        println!(
            "| {name} | {purged} | {} | {} | {} / {} | {} / {} |",
            rate(purged as f64 / elapsed.as_secs_f64()),
            during.ok,
            dur(idle.p50()),
            dur(idle.p99()),
            dur(during.p50()),
            dur(during.p99()),
        );
    }
}
