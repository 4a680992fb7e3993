//! The purge under load: records past retention deleted by idem's [`Sweeper`] (on Redis, expired
//! by Redis itself, with the sweeper running beside it as a service runs it) while new keys arrive at a fixed rate, each
//! request's latency counted from when it was due, so a stall delays every request due during it.

use crate::floors;
use crate::load::Sample;
use idem_runtime::sweeper::Sweeper;
use idem_runtime::Engine;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// New keys at `rate` per second from `workers` tasks, each request due at its slot in the
/// schedule and its latency counted from then, until `stop` is set; `done` counts the requests
/// that succeeded (each a record added).
pub(crate) async fn paced(
    engine: Engine,
    rate: f64,
    workers: usize,
    prefix: String,
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
) -> Sample {
    let start = Instant::now();
    let interval = Duration::from_secs_f64(workers as f64 / rate.max(1.0));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (engine, prefix, stop, done) =
            (engine.clone(), prefix.clone(), stop.clone(), done.clone());
        // Workers start staggered across one interval, so the requests are evenly spaced.
        let offset = interval.mul_f64(w as f64 / workers as f64);
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut errors, mut lat) = (0u64, 0u64, Vec::new());
            let mut k = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let due = start + offset + interval * k;
                k += 1;
                tokio::time::sleep_until(due.into()).await;
                let n = u64::from(k) * workers as u64 + w as u64;
                let i = super::mix(n ^ 0x5eed);
                let key = format!("{:08x}-{prefix}-{n}", i & 0xffff_ffff);
                let scope = super::seed::scope(super::seed::Set::Live, i);
                if floors::engine_new(&engine, &scope, key).await {
                    ok += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                    lat.push(due.elapsed().as_nanos() as u64);
                } else {
                    errors += 1;
                }
            }
            (ok, errors, lat)
        }));
    }
    let mut sample = Sample::default();
    for task in tasks {
        let (ok, errors, lat) = task.await.expect("paced worker panicked");
        sample.ok += ok;
        sample.errors += errors;
        sample.latencies.extend(lat);
    }
    sample.elapsed = start.elapsed();
    sample.latencies.sort_unstable();
    sample
}

/// Runs `paced` for `secs` seconds, quietly.
pub(crate) async fn quiet(engine: &Engine, rate: f64, secs: f64, prefix: String) -> Sample {
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(paced(
        engine.clone(),
        rate,
        16,
        prefix,
        stop.clone(),
        Arc::default(),
    ));
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    stop.store(true, Ordering::Relaxed);
    load.await.expect("paced load")
}

/// What one purge measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct Purged {
    /// Records deleted (SQL stores: what the sweeper reported; Redis: gone from the keyspace).
    pub(crate) deleted: u64,
    pub(crate) took: Duration,
    /// The live requests meanwhile.
    pub(crate) live: Sample,
    pub(crate) sweep_error: Option<String>,
    /// Whether it ended by the time limit rather than by deleting everything.
    pub(crate) timed_out: bool,
}

/// The SQL stores: one `sweep_once` (the sweeper's default batches) while the paced load runs; the live requests counted from the sweep's start to its end.
pub(crate) async fn sweep_sql(
    engine: &Engine,
    sweeper: Sweeper,
    rate: f64,
    prefix: String,
) -> Purged {
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn(paced(
        engine.clone(),
        rate,
        16,
        prefix,
        stop.clone(),
        Arc::default(),
    ));
    let start = Instant::now();
    let swept = sweeper.sweep_once().await;
    let took = start.elapsed();
    stop.store(true, Ordering::Relaxed);
    let live = load.await.expect("paced load");
    match swept {
        Ok(deleted) => Purged {
            deleted,
            took,
            live,
            ..Purged::default()
        },
        Err(e) => Purged {
            took,
            live,
            sweep_error: Some(e.to_string()),
            ..Purged::default()
        },
    }
}

/// How often the Redis purge sweeps: the sweeper's default interval, as a service would run it.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Redis: from `due` (when the purge's records' retention ends, and Redis' own expiry may delete
/// them), the paced load runs beside the sweeper (a sweep at once, then every [`SWEEP_EVERY`]),
/// until the keyspace holds no more than `base` keys plus those the load added, or `limit` has
/// passed.
pub(crate) async fn expire_redis<F, Fut>(
    engine: &Engine,
    sweeper: Sweeper,
    rate: f64,
    prefix: String,
    base: u64,
    limit: Duration,
    dbsize: F,
) -> Purged
where
    F: Fn() -> Fut,
    Fut: Future<Output = Option<u64>>,
{
    let stop = Arc::new(AtomicBool::new(false));
    let added = Arc::new(AtomicU64::new(0));
    let before = dbsize().await.unwrap_or(0);
    let load = tokio::spawn(paced(
        engine.clone(),
        rate,
        16,
        prefix,
        stop.clone(),
        added.clone(),
    ));
    let start = Instant::now();
    let sweeping = Arc::new(AtomicBool::new(true));
    let sweeps = {
        let sweeping = sweeping.clone();
        tokio::spawn(async move {
            let mut error = None;
            while sweeping.load(Ordering::Relaxed) {
                if let Err(e) = sweeper.sweep_once().await {
                    error = Some(e.to_string());
                }
                let next = Instant::now() + SWEEP_EVERY;
                while sweeping.load(Ordering::Relaxed) && Instant::now() < next {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            error
        })
    };
    let mut timed_out = false;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let size = dbsize().await.unwrap_or(u64::MAX);
        if size <= base + added.load(Ordering::Relaxed) {
            break;
        }
        if start.elapsed() >= limit {
            timed_out = true;
            break;
        }
    }
    let took = start.elapsed();
    sweeping.store(false, Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let live = load.await.expect("paced load");
    let sweep_error = sweeps.await.ok().flatten();
    let after = dbsize().await.unwrap_or(0);
    Purged {
        deleted: (before + added.load(Ordering::Relaxed)).saturating_sub(after),
        took,
        live,
        sweep_error,
        timed_out,
    }
}
