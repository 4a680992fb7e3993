//! Scale: claim latency with 10k and with 1M existing records (bulk-loaded directly: SQL, Redis
//! pipelines, the memory store's own claims), then the sweeper's throughput and its effect on
//! concurrent claims.

use crate::floors::{self, fingerprint};
use crate::load::Sample;
use crate::report::{self, dur, rate, Config};
use crate::setup::{Backend, Handle};
use idem_runtime::clock::{Clock, SystemClock, Timestamp};
use idem_runtime::store::{Claim, ClaimOutcome, Store};
use idem_runtime::sweeper::Sweeper;
use idem_runtime::{FencingToken, RecordKey};
use std::future::Future;
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

/// `n` sequential claims of new keys on `store` (or, with `stop`, claims until it is set); their
/// latencies.
async fn probe(store: &Arc<dyn Store>, scope: &str, n: usize, stop: Option<&AtomicBool>) -> Sample {
    timed(n, stop, |i| async move {
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
        let took = t.elapsed();
        assert!(
            matches!(outcome, Ok(ClaimOutcome::Claimed { .. })),
            "probe claim"
        );
        took
    })
    .await
}

/// `n` sequential claims of new keys on the memory floor (a `Mutex<HashMap>`); their latencies.
async fn probe_floor(map: &floors::MemoryMap, scope: &str, n: usize) -> Sample {
    timed(n, None, |i| async move {
        let key = format!("{scope}/probe-{i}");
        let (fp, token) = (fingerprint().0, FencingToken::generate().0);
        let t = Instant::now();
        let claimed = floors::memory_claim(map, &key, fp, token);
        let took = t.elapsed();
        assert!(claimed, "floor probe claim");
        took
    })
    .await
}

/// Runs `claim(i)` for i = 0.. until `n` have run (or `stop` is set), one at a time; the durations
/// they report, sorted.
async fn timed<F: Future<Output = Duration>>(
    n: usize,
    stop: Option<&AtomicBool>,
    mut claim: impl FnMut(usize) -> F,
) -> Sample {
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0.. {
        if stop.map_or(i >= n, |s| s.load(Ordering::Relaxed)) {
            break;
        }
        lat.push(claim(i).await.as_nanos() as u64);
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

/// The memory floor's records: `key-<from>`.. in scope `scope`, claimed (the floor's records
/// are as small whether completed or not).
fn bulk_floor(map: &floors::MemoryMap, scope: &str, from: u64, count: u64) {
    let fp = fingerprint().0;
    for i in from..from + count {
        let token = FencingToken::generate().0;
        let key = format!("{scope}/key-{i}");
        assert!(floors::memory_claim(map, &key, fp, token));
    }
}

/// Prints one row of the scale table; returns its p50 ratio.
fn scale_row(name: &str, small: &Sample, big: &Sample, load_time: Duration) -> f64 {
    let p50 = big.p50().as_secs_f64() / small.p50().as_secs_f64();
    let mean = big.mean().as_secs_f64() / small.mean().as_secs_f64();
    println!(
        "| {name} | {} / {} / {} | {} / {} / {} | {p50:.2}× | {mean:.2}× | {} |",
        dur(small.p50()),
        dur(small.p99()),
        dur(small.mean()),
        dur(big.p50()),
        dur(big.p99()),
        dur(big.mean()),
        dur(load_time),
    );
    p50
}

pub(crate) async fn run(handles: &[(Backend, Handle)], cfg: &Config) {
    let large = cfg.scale.max(SMALL);
    println!("\n## Scale: claim latency against the number of records\n");
    println!("{PROBES} sequential claims of new keys (`Store::claim` alone), with {SMALL} and then {large} completed records in the store (bulk-loaded directly). After the memory store, the same probe on its floor, a `Mutex<HashMap<String, _>>` whose claim is `contains_key` then `insert` (the fingerprint and token drawn outside the timing, as for the store), filled the same way: how the machine's caches alone scale a hash table's claim from one size to the other.\n");
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
        let p50 = scale_row(backend.name(), &small, &big, load_time);
        let mean = big.mean().as_secs_f64() / small.mean().as_secs_f64();
        let mut measured = format!("p50 {p50:.2}×, mean {mean:.2}×");
        let mut floor_ratio = None;
        if *backend == Backend::Memory {
            // The same probe on the memory floor, in this process, right after: what the machine's
            // caches make of a hash table's claim at the two sizes, whatever the table.
            let map = floors::MemoryMap::default();
            bulk_floor(&map, &scope, 0, SMALL);
            let floor_small = probe_floor(&map, &format!("small-{id}"), PROBES).await;
            let t = Instant::now();
            bulk_floor(&map, &scope, SMALL, large - SMALL);
            let floor_load = t.elapsed();
            let floor_big = probe_floor(&map, &format!("large-{id}"), PROBES).await;
            let name = "memory floor (`Mutex<HashMap>`)";
            let floor = scale_row(name, &floor_small, &floor_big, floor_load);
            measured += &format!("; the bare map's own p50 ratio {floor:.2}×");
            floor_ratio = Some(floor);
        }
        // In memory a claim is a few cache lines: at 10k records they stay in the core's caches, at
        // 1M they cannot, for any hash table. There the target is judged against the bare map's
        // own ratio, measured just before: idem's claim must not grow more than the floor's does.
        report::target(
            format!(
                "{}: claim latency at {large} records within 1.5× of {SMALL}{}",
                backend.name(),
                if floor_ratio.is_some() {
                    " (in memory: or within the bare map's own ratio)"
                } else {
                    ""
                }
            ),
            measured,
            p50 <= 1.5 || floor_ratio.is_some_and(|floor| p50 <= floor),
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
