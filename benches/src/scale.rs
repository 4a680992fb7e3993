//! The `scale` section: how idem's cost grows with the records already stored, and what a purge
//! does to live requests. Not part of `all` (it loads millions of records):
//!
//! ```sh
//! IDEM_SCALE_SIZES=0,1000000,10000000 cargo run --release --manifest-path benches/Cargo.toml -- scale
//! ```
//!
//! For each selected store (SQLite, PostgreSQL, Redis, Redis Cluster; `IDEM_BENCH_STORES`, the
//! cluster's name there `redis-cluster`) and each size, the store is bulk-loaded up to that many
//! records in its own format (`seed.rs`; a larger size extends the smaller one), then new keys and
//! replays run at 16 concurrent operations through idem's engine and on the store's floor
//! (`floor.rs`), interleaved in slices over `IDEM_BENCH_ROUNDS` rounds of `IDEM_BENCH_SECS` per
//! cell. New keys land at random places in the seeded scopes, and replays read random seeded
//! records, so both meet the whole index. Then the same engine behind the HTTP section's handler
//! (`http.rs`'s `idem_router`, served once per store): [`HTTP_KEYS`] keys are completed over HTTP
//! at that size, and new keys and replays of those keys run over 16 keep-alive connections with
//! the HTTP load generator (`load.rs`), judged against the same cell at the smallest size and the
//! store floor's keeps at the largest. Then 16 concurrent duplicates of each of 50 keys. At
//! `IDEM_SCALE_PURGE_AT` records (default 1,000,000, or the first size) `IDEM_SCALE_PURGE` records
//! past retention (default 1,000,000; 0 skips) are added and purged while new keys arrive at half
//! the engine's measured rate, by the sweeper with its defaults (`IDEM_SCALE_BATCH` sets another
//! batch size). First, the SQLite store's tail (`tails.rs`). `IDEM_SCALE_PARTS`
//! (`stores,tails` by default) picks the parts.
//!
//! The Redis Cluster is `IDEM_BENCH_REDIS_CLUSTER_URL` (as in the `cluster` section; without a
//! cluster the section says it skipped it). Its records are loaded to [`CLUSTER_MAX`] at most (the
//! larger sizes are skipped, and the report says so), each primary's share pipelined to it
//! directly; it is not purged, and its keys under [`CLUSTER_PREFIX`] are deleted before and after.

mod floor;
mod instances;
mod purge;
mod seed;
mod tails;

use crate::floors;
use crate::http;
use crate::load::{interleaved, Bounds, Connections, Keys, Ops, Sample, Sliced};
use crate::report::{dur, median, pct, rate, tails, Config};
use crate::stores::{self, Backend, Handle};
use floor::Floor;
use idem_runtime::sweeper::Sweeper;
use idem_runtime::{Begin, Engine, RecordKey};
use seed::Set;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Concurrent operations per cell.
const CONCURRENCY: usize = 16;
/// The fewest records a size is seeded with, so that size 0's replays have records to read.
const MIN_SEEDED: u64 = 4_096;
/// Duplicates: this many keys, each claimed by this many concurrent operations, the winner's work
/// taking [`DUPLICATE_WORK`].
const DUPLICATE_KEYS: usize = 50;
const DUPLICATES: usize = 16;
const DUPLICATE_WORK: Duration = Duration::from_millis(20);
/// How long the Redis purge watches Redis expire the records under load: it deletes them eagerly
/// only while they are a large share of the keys it samples (see the section's prose).
const REDIS_EXPIRY_WINDOW: Duration = Duration::from_secs(60);
/// The quiet run beside each purge, at the same rate.
const QUIET_SECS: f64 = 10.0;
/// Keys completed over HTTP at the start of each size, for the HTTP replays to read.
const HTTP_KEYS: usize = 4_096;
/// The largest size the Redis Cluster is loaded to (its records live in memory, twice with the
/// replicas), and its keys' prefix there (emptied before and after).
const CLUSTER_MAX: u64 = 1_000_000;
const CLUSTER_PREFIX: &str = "idem-scale";
/// The stores the section measures, in its tables' order.
const BACKENDS: [Backend; 4] = [
    Backend::Sqlite,
    Backend::Postgres,
    Backend::Redis,
    Backend::RedisCluster,
];

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn sizes() -> Vec<u64> {
    let list = std::env::var("IDEM_SCALE_SIZES").unwrap_or_else(|_| "0,1000000,10000000".into());
    let mut sizes: Vec<u64> = list
        .split(',')
        .filter_map(|s| s.trim().replace('_', "").parse().ok())
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    if sizes.is_empty() {
        sizes.push(0);
    }
    sizes
}

/// A 64-bit mix (splitmix64's finaliser): spreads consecutive numbers over the key space.
pub(crate) fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The cells of one store at one size.
#[derive(Default)]
struct Cells {
    engine_new: Vec<Sample>,
    engine_replay: Vec<Sample>,
    floor_new: Vec<Sample>,
    floor_replay: Vec<Sample>,
    /// Over HTTP, after the four above: empty if the server could not be served or seeded.
    http_new: Vec<Sample>,
    http_replay: Vec<Sample>,
}

/// One row of results: a store at a size.
struct Row {
    backend: Backend,
    size: u64,
    seeded: Option<(u64, Duration)>,
    cells: Cells,
    duplicates: Duplicates,
}

#[derive(Default)]
struct Duplicates {
    wakeups: Vec<u64>,
    executions: usize,
    errors: usize,
}

struct PurgeRow {
    backend: Backend,
    size: u64,
    records: u64,
    seed_took: Duration,
    rate: f64,
    quiet: Sample,
    purged: purge::Purged,
}

/// The sweeper as a service builds it, with `IDEM_SCALE_BATCH` (when set) as its batch size.
fn sweeper(handle: &Handle) -> Sweeper {
    let sweeper = Sweeper::new(handle.store_purge());
    match std::env::var("IDEM_SCALE_BATCH")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(n) => sweeper.batch_size(n),
        None => sweeper,
    }
}

pub(crate) async fn run(cfg: &Config, services: &str) {
    let started = Instant::now();
    let sizes = sizes();
    let purge_records = env_u64("IDEM_SCALE_PURGE", 1_000_000);
    let purge_at = env_u64(
        "IDEM_SCALE_PURGE_AT",
        if sizes.contains(&1_000_000) {
            1_000_000
        } else {
            sizes[0]
        },
    );
    let parts = std::env::var("IDEM_SCALE_PARTS").unwrap_or_else(|_| "stores,tails".into());
    if parts.trim() == "instances" {
        instances::run(cfg).await;
        return;
    }
    println!("{}", header(cfg, services, &sizes, purge_records, purge_at));
    if parts.split(',').any(|p| p.trim() == "tails") && stores::selected(Backend::Sqlite) {
        print_tails(&tails::run(cfg).await);
    }
    if !parts.split(',').any(|p| p.trim() == "stores") {
        return;
    }
    let mut rows = Vec::new();
    let mut purges = Vec::new();
    let mut notes = Vec::new();
    let mut run_id = 0u64;
    for backend in BACKENDS {
        if !stores::selected(backend) {
            continue;
        }
        let (handle, url) = match open(backend).await {
            Ok(opened) => opened,
            Err(e) => {
                eprintln!("skipping {}: {e}", backend.name());
                notes.push(format!("{}: skipped: {e}.", backend.name()));
                continue;
            }
        };
        let Some(floor) = Floor::for_handle(&handle) else {
            continue;
        };
        let engine = Engine::from_arc(handle.store());
        let server = http::serve(http::idem_router(engine.clone())).await;
        let over: Vec<String> = sizes
            .iter()
            .filter(|&&n| backend == Backend::RedisCluster && n > CLUSTER_MAX)
            .map(|&n| count(n))
            .collect();
        if !over.is_empty() {
            notes.push(format!(
                "{}: loaded to {} records at most (its records live in memory, twice with the \
                 replicas); not run at {}.",
                backend.name(),
                count(CLUSTER_MAX),
                over.join(", ")
            ));
        }
        let mut seeded = 0u64;
        for &size in &sizes {
            if backend == Backend::RedisCluster && size > CLUSTER_MAX {
                continue;
            }
            let target = size.max(MIN_SEEDED);
            let mut took = None;
            if target > seeded {
                let t = Instant::now();
                if let Err(e) = load(&handle, &url, Set::Live, seeded, target, None).await {
                    eprintln!("{}: seeding failed: {e}", backend.name());
                    break;
                }
                took = Some((target - seeded, t.elapsed()));
                seeded = target;
            }
            eprintln!("scale: {} at {size} records", backend.name());
            run_id += 1;
            let mut cells = measure(&engine, &floor, seeded, run_id, cfg).await;
            match &server {
                Ok(addr) => match measure_http(*addr, run_id, cfg).await {
                    Ok((new, replay)) => (cells.http_new, cells.http_replay) = (new, replay),
                    Err(e) => eprintln!("{}: HTTP not measured: {e}", backend.name()),
                },
                Err(e) => eprintln!("{}: HTTP not served: {e}", backend.name()),
            }
            let duplicates = duplicates(&engine, run_id).await;
            let capacity = median(cells.engine_new.iter().map(Sample::throughput).collect());
            rows.push(Row {
                backend,
                size,
                seeded: took,
                cells,
                duplicates,
            });
            if size == purge_at && purge_records > 0 && backend == Backend::RedisCluster {
                notes.push(format!("{}: not purged.", backend.name()));
            } else if size == purge_at && purge_records > 0 {
                run_id += 1;
                match purge(
                    &handle,
                    &url,
                    &engine,
                    purge_records,
                    capacity / 2.0,
                    run_id,
                )
                .await
                {
                    Ok((seed_took, quiet, purged)) => purges.push(PurgeRow {
                        backend,
                        size,
                        records: purge_records,
                        seed_took,
                        rate: capacity / 2.0,
                        quiet,
                        purged,
                    }),
                    Err(e) => eprintln!("{}: purge failed: {e}", backend.name()),
                }
            }
        }
    }
    print(&rows, &purges, &sizes, &notes);
    cleanup().await;
    println!(
        "This run took {:.0} minutes.\n",
        started.elapsed().as_secs_f64() / 60.0
    );
}

/// Frees what the loads took, in the selected stores only: the bench's PostgreSQL table and Redis
/// database are emptied, the cluster's keys under [`CLUSTER_PREFIX`] deleted (the SQLite files go
/// with the scratch directory).
async fn cleanup() {
    if stores::selected(Backend::Postgres) {
        if let Ok(pool) = sqlx::PgPool::connect(&format!(
            "{}/idem_bench?sslmode=disable",
            stores::postgres_base()
        ))
        .await
        {
            let _ = sqlx::query("TRUNCATE idem.records").execute(&pool).await;
        }
    }
    if stores::selected(Backend::Redis) {
        if let Ok(client) = redis::Client::open(stores::redis_url()) {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let _ = redis::cmd("FLUSHDB").query_async::<()>(&mut conn).await;
            }
        }
    }
    if stores::selected(Backend::RedisCluster) {
        if let Ok((_, conn)) = stores::redis_cluster(CLUSTER_PREFIX).await {
            if let Err(e) = seed::clear_cluster(&conn, CLUSTER_PREFIX).await {
                eprintln!("Redis Cluster: keys under {CLUSTER_PREFIX} left: {e}");
            }
        }
    }
}

/// The store, empty, and the URL the loads reach it with; else why not.
async fn open(backend: Backend) -> Result<(Handle, String), String> {
    match backend {
        Backend::Sqlite => {
            let path = stores::scratch().join("scale.db");
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
            let url = format!("sqlite://{}?mode=rwc", path.display());
            let store = idem_runtime::store::sqlite::SqliteStore::connect(&url)
                .await
                .map_err(|e| e.to_string())?;
            Ok((Handle::Sqlite(Arc::new(store)), url))
        }
        Backend::Postgres => Ok((
            Handle::Postgres(stores::postgres(None).await?),
            String::new(),
        )),
        Backend::Redis => {
            let (s, c) = stores::redis(None).await?;
            Ok((Handle::Redis(s, c), String::new()))
        }
        Backend::RedisCluster => {
            let (s, c) = stores::redis_cluster(CLUSTER_PREFIX).await?;
            let left = seed::clear_cluster(&c, CLUSTER_PREFIX).await?;
            if left > 0 {
                eprintln!("Redis Cluster: deleted {left} keys an earlier run left");
            }
            Ok((Handle::RedisCluster(s, c), String::new()))
        }
        // Neither seeded nor measured at scale yet.
        Backend::Memory | Backend::Mysql => Err("not measured at scale".to_owned()),
    }
}

/// Bulk-loads records `from..to` of `set` into the store.
async fn load(
    handle: &Handle,
    url: &str,
    set: Set,
    from: u64,
    to: u64,
    retain_at: Option<i64>,
) -> Result<(), String> {
    match handle {
        Handle::Sqlite(_) => seed::sqlite(url, set, from, to).await,
        Handle::Postgres(s) => seed::postgres(s.pool(), set, from, to).await,
        Handle::Redis(s, conn) => {
            let nodes = [conn.clone()];
            seed::redis(&nodes, |_| 0, s.prefix(), set, from, to, retain_at).await
        }
        Handle::RedisCluster(s, conn) => {
            let (nodes, owner) = seed::primaries(conn).await?;
            let node_of = |key: &[u8]| owner[seed::slot(key)];
            seed::redis(&nodes, node_of, s.prefix(), set, from, to, retain_at).await
        }
        Handle::Memory(_) => Ok(()),
        Handle::Mysql(_) => Err("the scale section does not seed MySQL yet".to_owned()),
    }
}

/// New keys and replays through the engine and on the floor, at [`CONCURRENCY`], interleaved;
/// one sample per cell and round.
async fn measure(engine: &Engine, floor: &Floor, seeded: u64, run_id: u64, cfg: &Config) -> Cells {
    let bounds = Bounds {
        time: cfg.cell(),
        requests: u64::MAX,
    };
    let mut cells = Cells::default();
    for round in 0..cfg.rounds {
        eprintln!("  round {} of {}", round + 1, cfg.rounds);
        let mut loads = loads(engine, floor, seeded, run_id, round as u64);
        interleaved(&mut loads, bounds).await;
        for (id, load) in loads {
            let sample = load.into_sample();
            match id {
                0 => cells.engine_new.push(sample),
                1 => cells.engine_replay.push(sample),
                2 => cells.floor_new.push(sample),
                _ => cells.floor_replay.push(sample),
            }
        }
    }
    cells
}

/// New keys and replays over HTTP at [`CONCURRENCY`] keep-alive connections to `addr`'s idem
/// route, interleaved in each round, after [`HTTP_KEYS`] keys are completed there for the replays
/// (over as many connections); one sample per cell and round. `run_id` keeps the keys apart.
async fn measure_http(
    addr: SocketAddr,
    run_id: u64,
    cfg: &Config,
) -> Result<(Vec<Sample>, Vec<Sample>), String> {
    let keys: Vec<String> = (0..HTTP_KEYS).map(|i| format!("h{run_id}-{i}")).collect();
    let mut seeding = tokio::task::JoinSet::new();
    for chunk in keys.chunks(HTTP_KEYS.div_ceil(CONCURRENCY)) {
        let chunk = chunk.to_vec();
        seeding.spawn(async move { http::complete(addr, "/idem", None, &chunk).await });
    }
    while let Some(done) = seeding.join_next().await {
        done.map_err(|e| e.to_string())??;
    }
    let (keys, bounds) = (
        Arc::new(keys),
        Bounds {
            time: cfg.cell(),
            requests: u64::MAX,
        },
    );
    let (mut new, mut replay) = (Vec::new(), Vec::new());
    for round in 0..cfg.rounds {
        eprintln!("  HTTP round {} of {}", round + 1, cfg.rounds);
        let fresh = Keys::Fresh(format!("n{run_id}.{round}").into());
        let open = |keys| Connections::open(addr, "/idem", keys, CONCURRENCY);
        let mut loads: Vec<(bool, Box<dyn Sliced>)> = vec![
            (false, Box::new(open(fresh).await)),
            (true, Box::new(open(Keys::Replay(keys.clone())).await)),
        ];
        interleaved(&mut loads, bounds).await;
        for (is_replay, load) in loads {
            match is_replay {
                true => replay.push(load.into_sample()),
                false => new.push(load.into_sample()),
            }
        }
    }
    Ok((new, replay))
}

/// One round's four cells: new keys at random places in the seeded scopes (`run_id` and `round`
/// in the key keep every cell's keys apart), replays of random seeded completed records.
fn loads(
    engine: &Engine,
    floor: &Floor,
    seeded: u64,
    run_id: u64,
    round: u64,
) -> Vec<(u8, Box<dyn Sliced>)> {
    let salt = (run_id << 40) ^ (round << 32);
    let (e1, e2, f1, f2) = (engine.clone(), engine.clone(), floor.clone(), floor.clone());
    vec![
        (
            0,
            Box::new(Ops::new(CONCURRENCY, move |_, n| {
                let e = e1.clone();
                let i = mix(n ^ salt);
                async move {
                    let scope = seed::scope(Set::Live, i);
                    let key = format!("{:08x}-e{run_id}.{round}-{n}", i & 0xffff_ffff);
                    floors::engine_new(&e, &scope, key).await
                }
            })),
        ),
        (
            1,
            Box::new(Ops::new(CONCURRENCY, move |_, n| {
                let e = e2.clone();
                let i = seed::completed(n ^ salt, seeded);
                async move { floors::engine_replay(&e, &seed::scope(Set::Live, i), seed::key(i)).await }
            })),
        ),
        (
            2,
            Box::new(Ops::new(CONCURRENCY, move |_, n| {
                let f = f1.clone();
                let i = mix(n ^ salt ^ (1 << 63));
                async move {
                    let scope = seed::scope(Set::Live, i);
                    let key = format!("{:08x}-f{run_id}.{round}-{n}", i & 0xffff_ffff);
                    f.new_request(&scope, &key).await
                }
            })),
        ),
        (
            3,
            Box::new(Ops::new(CONCURRENCY, move |_, n| {
                let f = f2.clone();
                let i = seed::completed(n ^ salt ^ (1 << 62), seeded);
                async move { f.replay(&seed::scope(Set::Live, i), &seed::key(i)).await }
            })),
        ),
    ]
}

/// [`DUPLICATES`] concurrent claims of each of [`DUPLICATE_KEYS`] new keys: the winner works for
/// [`DUPLICATE_WORK`] then completes; each waiter's wake-up is the time from the completion's
/// return to the waiter's replay (0 if it woke first).
async fn duplicates(engine: &Engine, run_id: u64) -> Duplicates {
    let mut out = Duplicates::default();
    for k in 0..DUPLICATE_KEYS {
        let key = RecordKey::new("tenant-dup", format!("d{run_id}-{k}"));
        let completed: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
        let barrier = Arc::new(tokio::sync::Barrier::new(DUPLICATES));
        let mut tasks = Vec::new();
        for _ in 0..DUPLICATES {
            let (engine, key, completed, barrier) = (
                engine.clone(),
                key.clone(),
                completed.clone(),
                barrier.clone(),
            );
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                match engine
                    .begin(key, floors::fingerprint(), &floors::POLICY)
                    .await
                {
                    Ok(Begin::Execute(claim)) => {
                        tokio::time::sleep(DUPLICATE_WORK).await;
                        let ok = claim.complete(&floors::response()).await.is_ok();
                        *completed.lock().expect("not poisoned") = Some(Instant::now());
                        (ok, true, None)
                    }
                    Ok(Begin::Replay(_)) => (true, false, Some(Instant::now())),
                    _ => (false, false, None),
                }
            }));
        }
        let mut woke = Vec::new();
        for task in tasks {
            match task.await {
                Ok((true, executed, at)) => {
                    out.executions += usize::from(executed);
                    woke.extend(at);
                }
                _ => out.errors += 1,
            }
        }
        let done = *completed.lock().expect("not poisoned");
        if let Some(done) = done {
            for at in woke {
                out.wakeups
                    .push(at.saturating_duration_since(done).as_nanos() as u64);
            }
        }
    }
    out.wakeups.sort_unstable();
    out
}

/// Adds `records` past retention, runs new keys at `rate` quietly, then purges them under the same
/// load: the load time, the quiet sample and the purge.
async fn purge(
    handle: &Handle,
    url: &str,
    engine: &Engine,
    records: u64,
    rate: f64,
    run_id: u64,
) -> Result<(Duration, Sample, purge::Purged), String> {
    let t = Instant::now();
    match handle {
        Handle::Redis(_, conn) => {
            let base = dbsize(conn).await.unwrap_or(0);
            // Retained until a moment after the load, the quiet run and a margin: Redis then
            // expires them itself, under the load.
            let estimate = 5.0 + records as f64 / 100_000.0;
            let due = now_ms() + ((estimate + QUIET_SECS + 5.0) * 1000.0) as i64;
            load(handle, url, Set::Expired, 0, records, Some(due)).await?;
            let seed_took = t.elapsed();
            eprintln!("purge: quiet run at {rate:.0}/s");
            let quiet = purge::quiet(engine, rate, QUIET_SECS, format!("q{run_id}")).await;
            let wait = due - now_ms();
            if wait < 0 {
                eprintln!(
                    "purge: the records' retention ended {} ms before the purge's measurement",
                    -wait
                );
            }
            tokio::time::sleep(Duration::from_millis(wait.max(0) as u64)).await;
            eprintln!("purge: expiring {records} records under load");
            let base = base + quiet.ok;
            let c = conn.clone();
            let purged = purge::expire_redis(
                engine,
                sweeper(handle),
                rate,
                format!("p{run_id}"),
                base,
                REDIS_EXPIRY_WINDOW,
                move || {
                    let c = c.clone();
                    async move { dbsize(&c).await }
                },
            )
            .await;
            Ok((seed_took, quiet, purged))
        }
        _ => {
            load(handle, url, Set::Expired, 0, records, None).await?;
            let seed_took = t.elapsed();
            eprintln!("purge: quiet run at {rate:.0}/s");
            let quiet = purge::quiet(engine, rate, QUIET_SECS, format!("q{run_id}")).await;
            eprintln!("purge: sweeping {records} records under load");
            let purged =
                purge::sweep_sql(engine, sweeper(handle), rate, format!("p{run_id}")).await;
            Ok((seed_took, quiet, purged))
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

async fn dbsize(conn: &redis::aio::ConnectionManager) -> Option<u64> {
    let mut conn = conn.clone();
    redis::cmd("DBSIZE")
        .query_async::<u64>(&mut conn)
        .await
        .ok()
}

impl Handle {
    /// The store as the sweeper takes it.
    fn store_purge(&self) -> Arc<dyn idem_runtime::store::Purge> {
        match self {
            Handle::Memory(s) => s.clone(),
            Handle::Sqlite(s) => s.clone(),
            Handle::Postgres(s) => s.clone(),
            Handle::Redis(s, _) => s.clone(),
            Handle::Mysql(s) => s.clone(),
            Handle::RedisCluster(s, _) => s.clone(),
        }
    }
}

/// The section's opening: what it measures, how to run it, the machine and the date.
fn header(
    cfg: &Config,
    services: &str,
    sizes: &[u64],
    purge_records: u64,
    purge_at: u64,
) -> String {
    let sizes: Vec<String> = sizes.iter().map(|s| count(*s)).collect();
    format!(
        "## At scale

How idem's cost grows with its work: with records already stored, while a purge runs, and in
its latency tails. From one run of

```sh
IDEM_SCALE_SIZES={} IDEM_SCALE_PURGE={purge_records} IDEM_BENCH_SECS={} IDEM_BENCH_ROUNDS={} \\
  cargo run --release --manifest-path benches/Cargo.toml -- scale
```

{}; {}. Run on {}; sizes {}; the purge at {} records.
",
        std::env::var("IDEM_SCALE_SIZES").unwrap_or_else(|_| "0,1000000,10000000".into()),
        cfg.secs,
        cfg.rounds,
        crate::report::machine(),
        services,
        utc_now(),
        sizes.join(", "),
        count(purge_at),
    )
}

/// The date and time now, UTC, as `2026-12-07 23:59 UTC`.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        rem % 3600 / 60
    )
}

/// A record count: 0, 4096, 1M, 10M.
fn count(n: u64) -> String {
    if n >= 1_000_000 && n % 1_000_000 == 0 {
        format!("{}M", n / 1_000_000)
    } else if n >= 1_000_000 {
        format!("{:.1}M", n as f64 / 1e6)
    } else if n >= 10_000 {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    }
}

/// The HTTP rows: each store's engine behind the HTTP section's handler, at each size.
fn print_http(rows: &[Row], sizes: &[u64]) {
    println!("### Records already stored, over HTTP\n");
    println!(
        "Requests per second at {CONCURRENCY} keep-alive connections (median of the rounds), with \
         p50 / p99 / p99.9 latency over every round's requests, to the HTTP section's \
         `#[idempotent]` handler served on the engine of the store above, at each size after its \
         store-level cells (new keys and replays interleaved with each other only). A new key is a \
         `POST` under a key never sent. A replay sends one of {HTTP_KEYS} keys completed over HTTP \
         at the start of that size: records that exist at that size, but the newest, written by \
         this process moments before, all in the handler's one scope (`scope = \"global\"`), as \
         are the new keys, where the store-level cells spread over the seeded scopes. On SQLite a \
         key this process claimed lately may take the store's faster path (its claim reads first, \
         without the write lock), which the bulk-loaded records the store-level replays read never \
         take: the HTTP replays show a client's retry of a recent request, not the replay of an \
         old record. \"Keeps\" is the cell's rate at this size against the same cell on the \
         smallest; the goal at the largest size is that it keeps at least what the store's floor \
         keeps in the table above, less 5 points.\n"
    );
    println!("| store, cell | records | req/s | p50 / p99 / p99.9 | keeps | floor keeps | goal | failed |");
    println!("|---|---|---|---|---|---|---|---|");
    let mut verdicts = Vec::new();
    for (label, floor_of, _, http_of) in OPERATIONS {
        for backend in BACKENDS {
            let store_rows: Vec<&Row> = rows.iter().filter(|r| r.backend == backend).collect();
            let Some(first) = store_rows.first() else {
                continue;
            };
            let (h0, f0) = (
                throughput(http_of(&first.cells)),
                throughput(floor_of(&first.cells)),
            );
            for row in &store_rows {
                let hs = http_of(&row.cells);
                let name = format!("{}, HTTP {label}", backend.name());
                if hs.is_empty() {
                    println!("| {name} | {} | not run | | | | | |", count(row.size));
                    continue;
                }
                let h = throughput(hs);
                let (hk, fk) = (
                    h / h0.max(1e-9),
                    throughput(floor_of(&row.cells)) / f0.max(1e-9),
                );
                let goal = if row.size == largest(backend, sizes) && row.size != first.size {
                    let (word, line) = goal(&name, hk, fk);
                    verdicts.push(line);
                    word
                } else {
                    ""
                };
                println!(
                    "| {name} | {} | {} | {} | {} | {} | {goal} | {} |",
                    count(row.size),
                    rate(h),
                    tails(&Sample::pooled(hs)),
                    pct(hk),
                    pct(fk),
                    hs.iter().map(|s| s.errors).sum::<u64>(),
                );
            }
        }
    }
    println!();
    for v in &verdicts {
        println!("- {v}");
    }
    if !verdicts.is_empty() {
        println!();
    }
}

fn print_tails(variants: &[Vec<Sample>]) {
    println!("### SQLite new keys: the batching writer's tail\n");
    println!(
        "New keys through idem's engine at 16 concurrent operations on fresh SQLite files, no HTTP \
         (median of the rounds; latencies over every round's operations): the store as it ships \
         beside the same store `unbatched`.\n"
    );
    println!("| store | ops/s | vs the default | p50 | p99 | p99.9 | p99 ÷ p50 | errors |");
    println!("|---|---|---|---|---|---|---|---|");
    let base = variants.first().map_or(0.0, |v| throughput(v));
    for (name, samples) in tails::VARIANTS.iter().zip(variants) {
        let all = Sample::pooled(samples);
        let (p50, p99) = (all.quantile(0.5), all.quantile(0.99));
        println!(
            "| {name} | {} | {} | {} | {} | {} | {:.1} | {} |",
            rate(throughput(samples)),
            pct(throughput(samples) / base.max(1e-9)),
            dur(p50),
            dur(p99),
            dur(all.quantile(0.999)),
            p99.as_secs_f64() / p50.as_secs_f64().max(1e-9),
            all.errors
        );
    }
    println!();
}

fn throughput(samples: &[Sample]) -> f64 {
    median(samples.iter().map(Sample::throughput).collect())
}

/// The largest size `backend` is measured at.
fn largest(backend: Backend, sizes: &[u64]) -> u64 {
    let cap = if backend == Backend::RedisCluster {
        CLUSTER_MAX
    } else {
        u64::MAX
    };
    sizes
        .iter()
        .copied()
        .filter(|&n| n <= cap)
        .max()
        .unwrap_or(0)
}

/// The goal at a store's largest size: a cell keeps at least what the floor keeps less 5 points.
/// The table's word for it, and the verdict line.
fn goal(what: &str, keeps: f64, floor_keeps: f64) -> (&'static str, String) {
    let need = floor_keeps - 0.05;
    let word = if keeps >= need { "met" } else { "**not met**" };
    let line = format!(
        "{what} keeps {} against the floor's {} (needs {}): {word}",
        pct(keeps),
        pct(floor_keeps),
        pct(need)
    );
    (word, line)
}

type CellOf = fn(&Cells) -> &Vec<Sample>;

/// The store-level cells, as (label, floor, engine, over HTTP).
const OPERATIONS: [(&str, CellOf, CellOf, CellOf); 2] = [
    (
        "new key",
        |c| &c.floor_new,
        |c| &c.engine_new,
        |c| &c.http_new,
    ),
    (
        "replay",
        |c| &c.floor_replay,
        |c| &c.engine_replay,
        |c| &c.http_replay,
    ),
];

fn print(rows: &[Row], purges: &[PurgeRow], sizes: &[u64], notes: &[String]) {
    println!("### Records already stored\n");
    println!(
        "Operations per second at {CONCURRENCY} concurrent operations, no HTTP (median of the rounds), \
         with p50 / p99 / p99.9 latency over every round's operations. A new key is idem's claim and \
         completion through its engine, against the floor: the claim's insert and the fenced \
         completing update written directly on the store's own pool. A replay reads a random \
         seeded completed record: through idem's engine, against the floor's own read of it (on \
         PostgreSQL and Redis, the claim command idem sends; on the Redis Cluster, the same \
         commands through the same cluster client). \"Keeps\" is the cell's rate at this size \
         against the same cell on the smallest; the goal at the largest size is that idem keeps at \
         least what its floor keeps less 5 points, and at least 85% where the floor keeps 95% or \
         more. Size 0 holds the replays' {MIN_SEEDED} records.\n"
    );
    println!(
        "| store, cell | records | floor, ops/s | floor p50 / p99 / p99.9 | idem, ops/s | idem p50 / p99 / p99.9 | idem vs floor | floor keeps | idem keeps | goal | failed: floor, idem |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let failed = |v: &[Sample]| v.iter().map(|s| s.errors).sum::<u64>();
    let mut verdicts = Vec::new();
    for (label, floor_of, engine_of, _) in OPERATIONS {
        for backend in BACKENDS {
            let store_rows: Vec<&Row> = rows.iter().filter(|r| r.backend == backend).collect();
            let Some(first) = store_rows.first() else {
                continue;
            };
            let (f0, e0) = (
                throughput(floor_of(&first.cells)),
                throughput(engine_of(&first.cells)),
            );
            for row in &store_rows {
                let (fs, es) = (floor_of(&row.cells), engine_of(&row.cells));
                let (f, e) = (throughput(fs), throughput(es));
                let (fk, ek) = (f / f0.max(1e-9), e / e0.max(1e-9));
                let goal = if row.size == largest(backend, sizes) && row.size != first.size {
                    let (word, line) = goal(&format!("{}, {label}: idem", backend.name()), ek, fk);
                    verdicts.push(line);
                    word
                } else {
                    ""
                };
                println!(
                    "| {}, {label} | {} | {} | {} | {} | {} | {} | {} | {} | {goal} | {}, {} |",
                    backend.name(),
                    count(row.size),
                    rate(f),
                    tails(&Sample::pooled(fs)),
                    rate(e),
                    tails(&Sample::pooled(es)),
                    pct(e / f.max(1e-9)),
                    pct(fk),
                    pct(ek),
                    failed(fs),
                    failed(es),
                );
            }
        }
    }
    let errors: u64 = rows
        .iter()
        .flat_map(|r| {
            [
                &r.cells.engine_new,
                &r.cells.engine_replay,
                &r.cells.floor_new,
                &r.cells.floor_replay,
            ]
        })
        .flatten()
        .map(|s| s.errors)
        .sum();
    println!("\nFailed operations in all cells: {errors}.");
    for v in &verdicts {
        println!("- {v}");
    }
    for n in notes {
        println!("- {n}");
    }
    println!();
    print_http(rows, sizes);

    println!("### Loading the records\n");
    println!("Each store's bulk load in its own format (a larger size extends the smaller one).\n");
    println!("| store | records added | took | records/s |");
    println!("|---|---|---|---|");
    for row in rows {
        if let Some((n, took)) = row.seeded {
            println!(
                "| {} | {} | {:.1} s | {} |",
                row.backend.name(),
                count(n),
                took.as_secs_f64(),
                rate(seed::rate(n, took))
            );
        }
    }
    println!();

    println!("### Duplicates: the waiters' wake-up\n");
    println!(
        "{DUPLICATES} concurrent claims of each of {DUPLICATE_KEYS} new keys, the winner working \
         {} ms before it completes; a waiter's wake-up is the time from the completion's return to \
         its replay (0 when it woke before the completion returned).\n",
        DUPLICATE_WORK.as_millis()
    );
    println!("| store | records | executions | wake-up p50 | p99 | p99.9 | errors |");
    println!("|---|---|---|---|---|---|---|");
    for row in rows {
        let d = &row.duplicates;
        let s = Sample {
            latencies: d.wakeups.clone(),
            ..Sample::default()
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} |",
            row.backend.name(),
            count(row.size),
            d.executions,
            dur(s.quantile(0.5)),
            dur(s.quantile(0.99)),
            dur(s.quantile(0.999)),
            d.errors
        );
    }
    println!();

    if purges.is_empty() {
        return;
    }
    println!("### Purging under load\n");
    println!(
        "Records past retention added to the store, then purged while new keys arrive at half the \
         rate idem's new-key cell measured at that size (16 tasks, each request's latency counted \
         from when it was due). SQLite and PostgreSQL: one `Sweeper::sweep_once` with the \
         sweeper's defaults. Redis: the records' own expiry (their TTL is their retention, all \
         at one instant here), with the sweeper running beside it as a service runs it (a sweep, \
         then one a minute), watched for {} s or until they are gone. Redis deletes expired keys \
         eagerly only while they are a large share of the keys its expiry cycle samples (a tenth \
         by default); the rest go when touched or sampled, and idem counts them as absent \
         meanwhile, so Redis keeps up by design and its row shows only what the expiry costs the \
         live requests. \"Quiet\" is the same load for {QUIET_SECS} s just before. A SQL \
         store's purge keeps up if it deletes faster than the load adds records: an hour's worth \
         of records at the load's rate is then purged in under an hour.\n",
        REDIS_EXPIRY_WINDOW.as_secs()
    );
    println!(
        "| store | records stored | purged | took | purged/s | load, req/s | quiet p50 / p99 | during the purge p50 / p99 | p99 ratio | errors | an hour's records purged in |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for p in purges {
        let per_sec = seed::rate(p.purged.deleted, p.purged.took);
        let hour = 3600.0 * p.purged.live.throughput();
        let errors = p.purged.live.errors + p.quiet.errors;
        let note = match (&p.purged.sweep_error, p.purged.timed_out) {
            (Some(e), _) => format!(" (sweep error: {e})"),
            (None, true) if p.backend == Backend::Redis => " (in the window)".into(),
            (None, true) => " (stopped at the time limit)".into(),
            _ => String::new(),
        };
        println!(
            "| {} | {} | {}{note} | {:.1} s | {} | {} | {} / {} | {} / {} | {:.2}× | {errors} | {} |",
            p.backend.name(),
            count(p.size),
            count(p.purged.deleted),
            p.purged.took.as_secs_f64(),
            rate(per_sec),
            rate(p.rate),
            dur(p.quiet.quantile(0.5)),
            dur(p.quiet.quantile(0.99)),
            dur(p.purged.live.quantile(0.5)),
            dur(p.purged.live.quantile(0.99)),
            p.purged.live.quantile(0.99).as_secs_f64() / p.quiet.quantile(0.99).as_secs_f64().max(1e-9),
            if p.backend == Backend::Redis {
                "by Redis' expiry".into()
            } else if per_sec > 0.0 {
                dur(Duration::from_secs_f64(hour / per_sec))
            } else {
                "never".into()
            },
        );
        let _ = p.records;
        let _ = p.seed_took;
    }
    println!();
}
