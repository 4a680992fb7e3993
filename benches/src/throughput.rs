//! Throughput and latency: the same handler plain and with `#[idempotent]` over HTTP, and the store
//! operations through idem's engine beside the store's direct floor, at 1, 16 and 64 concurrent
//! connections, for new keys and for replays. Cells are interleaved round by round so that noise from
//! the shared machine falls on every column alike; each figure is the median over the rounds. The
//! cells a target compares are interleaved within each round as well, in slices ([`interleaved`]):
//! the plain handler with the memory store's HTTP paths (new keys, replays, new keys with records
//! held) and the memory floor's (the same three, the claim and completion written by hand around
//! the plain handler: `setup::floor`), and each store's engine operations with its floor's. A round's ratio then compares paths
//! that ran under the same conditions.
//!
//! The memory store's HTTP cells each run on a store made for the cell ([`memory_server`]): empty,
//! or holding as many completed records as the scale section's large point (and the floor's on a
//! map made the same way); its engine and floor
//! cells on a store and a map made for each concurrency of each round
//! ([`memory_engine_and_floor`]). One store shared by every cell would hold whatever the cells
//! before it wrote (by the last rounds, tens of millions of records, most from the engine-level
//! cells), so a cell's figure would depend on its place in the run, and a claim's cost grows with
//! the table once it outgrows the caches. The other stores keep one database for the run: a round
//! trip to them costs far more than their tables' growth.

use crate::floors::{self, Floor};
use crate::load::{self, Bounds, Connections, Keys, Ops, Sample, Sliced};
use crate::report::{self, dur, median, pct, pct1, rate, Config};
use crate::scale;
use crate::setup::{self, Backend, Handle, Served};
use idem_runtime::clock::{Clock, SystemClock};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::Engine;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

pub(crate) const CONCURRENCY: [usize; 3] = [1, 16, 64];
const REPLAY_KEYS: usize = 256;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Path {
    Plain,
    HttpNew,
    HttpReplay,
    /// The memory store only: a new key with [`Config::scale`] records already held.
    HttpNewHeld,
    /// The memory store's HTTP floor (`setup::floor`, the plain handler with a `Mutex<HashMap>`
    /// claim and completion written by hand): a new key, a replay, a new key with
    /// [`Config::scale`] records held.
    HttpFloorNew,
    HttpFloorReplay,
    HttpFloorNewHeld,
    EngineNew,
    EngineReplay,
    FloorNew,
    /// Redis only: the floor's new request with an unconditional completion.
    FloorNewUnfenced,
    FloorReplay,
    /// PostgreSQL and Redis: a replay through idem's claim statement or command, issued directly.
    StatementReplay,
}

impl Path {
    /// The floor of a replay on `backend`: the operation idem issues for it, issued directly. On
    /// PostgreSQL and Redis that is the claim, which finds the record (one round trip for a new
    /// request's claim and a replay alike); on SQLite and the memory store, a read.
    fn replay_floor(backend: Backend) -> Path {
        match backend {
            Backend::Postgres | Backend::Redis => Path::StatementReplay,
            Backend::Memory | Backend::Sqlite => Path::FloorReplay,
        }
    }
}

type Cells = BTreeMap<(Option<&'static str>, Path, usize), Vec<Sample>>;

struct Target {
    backend: Backend,
    addr: SocketAddr,
    engine: Engine,
    floor: Floor,
}

pub(crate) async fn run(handles: &[(Backend, Handle)], cfg: &Config) {
    let mut targets = Vec::new();
    for (backend, handle) in handles {
        let engine = Engine::from_arc(handle.store());
        let addr = setup::serve(setup::router(engine.clone(), Arc::default())).await;
        let floor = Floor::for_handle(handle);
        // Completed keys for the replay cells, on each path.
        seed_http(addr, "/idem").await;
        seed_replays(&engine, &floor).await;
        targets.push(Target {
            backend: *backend,
            addr,
            engine,
            floor,
        });
    }
    if targets.is_empty() {
        eprintln!("throughput: no store selected or reachable (IDEM_BENCH_STORES)");
        return;
    }
    let replay_keys = http_replay_keys();
    let bounds = Bounds {
        time: cfg.cell(),
        requests: 2_000_000,
    };
    let mut cells: Cells = BTreeMap::new();
    let mut run_id = 0u64;
    for round in 0..cfg.rounds {
        for &c in &CONCURRENCY {
            eprintln!(
                "throughput: round {} of {}, {c} connections",
                round + 1,
                cfg.rounds
            );
            run_id += 1;
            // The plain handler and the memory store's HTTP paths, interleaved in slices.
            let memory = targets.iter().any(|t| t.backend == Backend::Memory);
            let (own, held) = if memory {
                (
                    Some(memory_server(0).await),
                    Some(memory_server(cfg.scale).await),
                )
            } else {
                (None, None)
            };
            let fresh = |path: &str| Keys::Fresh(format!("{path}-{run_id}").into());
            let plain = targets[0].addr;
            let mut loads = vec![(
                (None, Path::Plain),
                http(plain, "/plain", fresh("plain"), c).await,
            )];
            if let (Some(own), Some(held)) = (&own, &held) {
                let name = Some(Backend::Memory.name());
                let (own, held) = (own.served.addr, held.served.addr);
                for (route, new, replay, new_held) in [
                    ("/idem", Path::HttpNew, Path::HttpReplay, Path::HttpNewHeld),
                    (
                        "/floor",
                        Path::HttpFloorNew,
                        Path::HttpFloorReplay,
                        Path::HttpFloorNewHeld,
                    ),
                ] {
                    let replays = Keys::Replay(replay_keys.clone());
                    let label = &route[1..];
                    loads.push(((name, new), http(own, route, fresh(label), c).await));
                    loads.push(((name, replay), http(own, route, replays, c).await));
                    let keys = fresh(&format!("{label}-held"));
                    loads.push(((name, new_held), http(held, route, keys, c).await));
                }
            }
            interleaved(&mut loads, bounds).await;
            for ((name, path), load) in loads {
                put(&mut cells, name, path, c, load.into_sample());
            }
            for server in own.into_iter().chain(held) {
                server.retire().await;
            }
            for t in &targets {
                run_id += 1;
                let name = Some(t.backend.name());
                let memory = t.backend == Backend::Memory;
                if !memory {
                    let keys = Keys::Fresh(format!("new-{run_id}").into());
                    let s = load::http(t.addr, "/idem", keys, c, bounds).await;
                    put(&mut cells, name, Path::HttpNew, c, s);
                    let replays = Keys::Replay(replay_keys.clone());
                    let s = load::http(t.addr, "/idem", replays, c, bounds).await;
                    put(&mut cells, name, Path::HttpReplay, c, s);
                }

                if http_only() {
                    continue;
                }
                // The memory store's engine and floor, like its HTTP cells, start empty each time.
                let (engine, floor) = if memory {
                    memory_engine_and_floor().await
                } else {
                    (t.engine.clone(), t.floor.clone())
                };
                // The engine's operations and the floor's, interleaved in slices as the HTTP
                // paths above are: the ratios compare what ran under the same conditions.
                let mut loads = store_loads(t.backend, &engine, &floor, run_id, c);
                interleaved(&mut loads, bounds).await;
                for (path, load) in loads {
                    put(&mut cells, name, path, c, load.into_sample());
                }
            }
        }
    }
    print(&targets, &cells, cfg.scale);
}

/// How many slices [`interleaved`] cuts each path's cell into: at the default 1 s per cell, 100 ms
/// each, long enough for thousands of requests at one connection.
const SLICES: u32 = 10;

/// Runs every load for `bounds.time` in all, in [`SLICES`] turns: each turn runs each load for a
/// slice of that time, one after the other, starting one load further on at each turn. A cell is
/// then the sum of its slices, spread over the whole round, instead of one stretch of it: a slow
/// second of the shared machine (another tenant, a stolen core) lands on every path in the
/// comparison, not on the one cell that happened to run then. The connections stay open between
/// slices (opened before the first), so no slice pays for a handshake.
async fn interleaved<K>(loads: &mut [(K, Box<dyn Sliced>)], bounds: Bounds) {
    let slice = Bounds {
        time: bounds.time / SLICES,
        requests: bounds.requests,
    };
    for turn in 0..SLICES as usize {
        for i in 0..loads.len() {
            let (_, load) = &mut loads[(i + turn) % loads.len()];
            load.run_slice(slice).await;
        }
    }
}

/// HTTP connections to `addr`, opened now, for [`interleaved`].
async fn http(addr: SocketAddr, path: &'static str, keys: Keys, c: usize) -> Box<dyn Sliced> {
    Box::new(Connections::open(addr, path, keys, c).await)
}

/// The store-level cells of `backend` at `c` connections: new requests and replays through the
/// engine and on the floor (on Redis also the unfenced floor, on PostgreSQL and Redis also the
/// replay through the claim statement), each a load for [`interleaved`].
fn store_loads(
    backend: Backend,
    engine: &Engine,
    floor: &Floor,
    run_id: u64,
    c: usize,
) -> Vec<(Path, Box<dyn Sliced>)> {
    let mut paths = vec![
        Path::EngineNew,
        Path::EngineReplay,
        Path::FloorNew,
        Path::FloorReplay,
    ];
    if backend == Backend::Redis {
        paths.push(Path::FloorNewUnfenced);
    }
    if matches!(backend, Backend::Postgres | Backend::Redis) {
        paths.push(Path::StatementReplay);
    }
    paths
        .into_iter()
        .filter_map(|path| Some((path, store_load(path, engine, floor, run_id, c)?)))
        .collect()
}

/// One store-level path from `c` connections, as a load that runs in slices (`None` for the HTTP
/// paths): through the engine, or issued directly on the floor. `run_id` keeps the fresh keys of
/// one cell apart from every other's. A path the store does not have (the claim statement on
/// SQLite, the unfenced completion outside Redis) is built all the same and counts every operation
/// as an error.
pub(crate) fn store_load(
    path: Path,
    engine: &Engine,
    floor: &Floor,
    run_id: u64,
    c: usize,
) -> Option<Box<dyn Sliced>> {
    let (e, f) = (engine.clone(), floor.clone());
    let load: Box<dyn Sliced> = match path {
        Path::Plain
        | Path::HttpNew
        | Path::HttpReplay
        | Path::HttpNewHeld
        | Path::HttpFloorNew
        | Path::HttpFloorReplay
        | Path::HttpFloorNewHeld => return None,
        Path::EngineNew => {
            let scope: Arc<str> = format!("engine-{run_id}").into();
            Box::new(Ops::new(c, move |w, n| {
                let (e, scope) = (e.clone(), scope.clone());
                async move { floors::engine_new(&e, &scope, format!("{w}-{n}")).await }
            }))
        }
        Path::EngineReplay => Box::new(Ops::new(c, move |_, n| {
            let e = e.clone();
            async move { floors::engine_replay(&e, "engine-replay", replay_key(n)).await }
        })),
        Path::FloorNew | Path::FloorNewUnfenced => {
            // The unfenced floor completes unconditionally ([`Floor::new_request_unfenced`]).
            let fenced = path == Path::FloorNew;
            let prefix: Arc<str> = format!("{}{run_id}", if fenced { "f" } else { "u" }).into();
            Box::new(Ops::new(c, move |w, n| {
                let f = f.clone();
                let key = format!("{prefix}-{w}-{n}");
                async move {
                    if fenced {
                        f.new_request(&key).await
                    } else {
                        f.new_request_unfenced(&key).await
                    }
                }
            }))
        }
        Path::FloorReplay => Box::new(Ops::new(c, move |_, n| {
            let f = f.clone();
            async move { f.replay(&replay_key(n)).await }
        })),
        Path::StatementReplay => Box::new(Ops::new(c, move |_, n| {
            let f = f.clone();
            async move { f.replay_via_claim_statement(&replay_key(n)).await }
        })),
    };
    Some(load)
}

/// A server on a memory store and a memory floor of its own, for the memory-store HTTP cells.
struct MemoryServer {
    served: Served,
    store: Arc<MemoryStore>,
    floor: Arc<floors::MemoryMap>,
}

/// A [`MemoryServer`] whose store and floor each hold `held` completed records (the store's in scope
/// `held`, a day's retention) and the completed keys the HTTP replay cells read.
async fn memory_server(held: u64) -> MemoryServer {
    let store = Arc::new(MemoryStore::new());
    hold(&store, held).await;
    let floor = Arc::new(floors::MemoryMap::default());
    floors::memory_hold(&floor, held);
    let router = setup::router(Engine::from_arc(store.clone()), floor.clone());
    let served = Served::start(router).await;
    seed_http(served.addr, "/idem").await;
    seed_http(served.addr, "/floor").await;
    MemoryServer {
        served,
        store,
        floor,
    }
}

/// Fills `store` with `held` completed records (scope `held`, a day's retention): what the "records
/// held" cells, and `profile-http` under `IDEM_BENCH_HELD`, start from.
pub(crate) async fn hold(store: &Arc<MemoryStore>, held: u64) {
    if held > 0 {
        let now = SystemClock.now().as_millis();
        let handle = Handle::Memory(store.clone());
        scale::bulk(&handle, "held", 0, held, now, now + scale::DAY_MS).await;
    }
}

impl MemoryServer {
    /// Stops the server and frees its store and floor here, between cells: left to the last
    /// connection task to close, freeing a million records would land on a worker thread during
    /// the next cell.
    async fn retire(self) {
        let MemoryServer {
            served,
            store,
            floor,
        } = self;
        served.stop().await;
        // The connection tasks let go of the router as the load generator's connections close.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let shared = || Arc::strong_count(&store) > 1 || Arc::strong_count(&floor) > 1;
        while shared() && std::time::Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
        if shared() {
            eprintln!("throughput: a memory store outlived its server's connections by 10 s");
        }
        drop(store);
        drop(floor);
    }
}

/// An engine on a new, empty memory store and a new memory floor, each holding the completed keys
/// the store-level replay cells read.
async fn memory_engine_and_floor() -> (Engine, Floor) {
    let handle = Handle::Memory(Arc::new(MemoryStore::new()));
    let engine = Engine::from_arc(handle.store());
    let floor = Floor::for_handle(&handle);
    seed_replays(&engine, &floor).await;
    (engine, floor)
}

/// The keys the HTTP replay cells send, completed beforehand by [`seed_http`].
pub(crate) fn http_replay_keys() -> Arc<Vec<String>> {
    Arc::new((0..REPLAY_KEYS).map(|i| format!("replay-{i}")).collect())
}

/// Completes, through `route` at `addr`, the keys the HTTP replay cells send.
pub(crate) async fn seed_http(addr: SocketAddr, route: &str) {
    let mut sender = load::connect(addr).await.expect("connect");
    for key in http_replay_keys().iter() {
        let status = load::send(&mut sender, load::post(route, key)).await;
        assert!(status.is_some_and(|s| s.is_success()), "seeding {addr}");
    }
}

/// Adds one sample to the cell of `name`'s `path` at `c` connections.
fn put(cells: &mut Cells, name: Option<&'static str>, path: Path, c: usize, s: Sample) {
    cells.entry((name, path, c)).or_default().push(s);
}

/// Completes the keys the store-level replay cells read ([`replay_key`]), through the engine (scope
/// `engine-replay`) and through the floor.
pub(crate) async fn seed_replays(engine: &Engine, floor: &Floor) {
    for i in 0..REPLAY_KEYS as u64 {
        assert!(floors::engine_new(engine, "engine-replay", replay_key(i)).await);
        assert!(floor.new_request(&replay_key(i)).await);
    }
}

/// The `n`th request's key among the completed keys every replay cell reads.
pub(crate) fn replay_key(n: u64) -> String {
    format!("r{}", n as usize % REPLAY_KEYS)
}

#[derive(Debug, Clone, Copy, Default)]
struct Med {
    rps: f64,
    p50: f64,
    p99: f64,
    errors: u64,
}

fn med(cells: &Cells, key: (Option<&'static str>, Path, usize)) -> Med {
    let Some(samples) = cells.get(&key) else {
        return Med::default();
    };
    Med {
        rps: median(samples.iter().map(Sample::throughput).collect()),
        p50: median(samples.iter().map(|s| s.p50().as_secs_f64()).collect()),
        p99: median(samples.iter().map(|s| s.p99().as_secs_f64()).collect()),
        errors: samples.iter().map(|s| s.errors).sum(),
    }
}

/// `1M`, `10k`, `1500`.
fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1000 && n % 1000 == 0 => format!("{}k", n / 1000),
        n => n.to_string(),
    }
}

fn d(secs: f64) -> String {
    dur(std::time::Duration::from_secs_f64(secs))
}

fn print(targets: &[Target], cells: &Cells, held: u64) {
    let per_second = held as f64 * 1000.0 / scale::DAY_MS as f64;
    let held = count(held);
    println!("\n## HTTP: the same handler plain and with `#[idempotent]`\n");
    println!("Throughput (requests/s), p50 / p99 latency, and throughput as a ratio of the plain handler at the same concurrency. Medians of the rounds.\n");
    print!("| path |");
    for c in CONCURRENCY {
        print!(" {c} conn: req/s | p50 / p99 | vs plain |");
    }
    println!();
    println!("|---|{}", "---|---|---|".repeat(CONCURRENCY.len()));
    let row = |label: String, key: &dyn Fn(usize) -> (Option<&'static str>, Path, usize)| {
        let mut line = format!("| {label} |");
        let mut errors = 0;
        for c in CONCURRENCY {
            let m = med(cells, key(c));
            let plain = med(cells, (None, Path::Plain, c));
            errors += m.errors;
            line += &format!(
                " {} | {} / {} | {} |",
                rate(m.rps),
                d(m.p50),
                d(m.p99),
                pct(m.rps / plain.rps.max(1e-9))
            );
        }
        if errors > 0 {
            line += &format!(" ({errors} errors)");
        }
        println!("{line}");
    };
    row("plain handler".into(), &|c| (None, Path::Plain, c));
    for t in targets {
        let n = t.backend.name();
        row(format!("{n}, new key"), &|c| (Some(n), Path::HttpNew, c));
        row(format!("{n}, replay"), &|c| (Some(n), Path::HttpReplay, c));
        if t.backend == Backend::Memory {
            row(format!("{n}, new key, {held} records held"), &|c| {
                (Some(n), Path::HttpNewHeld, c)
            });
            for (label, path) in floor_paths(&held) {
                row(format!("memory floor by hand, {label}"), &|c| {
                    (Some(n), path, c)
                });
            }
        }
    }
    if targets.iter().any(|t| t.backend == Backend::Memory) {
        println!("\nThe memory store's rows each ran on a store made for the cell: empty (its table grows, and resizes, during the cell), or holding {held} completed records (`IDEM_BENCH_SCALE`), what a day's retention keeps at {per_second:.0} new keys a second. Plain keeps nothing. The memory floor's rows are the plain handler with the memory floor's claim and completion written around it by hand (`Mutex<HashMap>`, the store-level table's floor; no fingerprint, no header, nothing expires), on a map made for the cell as the store is: what keeping a record per request costs with no framework.");
        print_memory_floor(cells, &held);
    }

    if http_only() {
        // The store-level cells were not measured: no table of zeros, no targets judged on them.
        report_memory_targets(targets, cells, &held);
        return;
    }
    println!("\n## Store level: idem's engine against the store's direct floor\n");
    println!("One new request = claim + complete; one replay = the operation that answers it. The floor issues the same operations directly (a `Mutex<HashMap>`, raw sqlx statements on the store's own pool and table, raw Redis commands); the engine goes through `Engine::begin` and `ClaimGuard::complete`, without HTTP. A replay's floor is what idem sends for it: on PostgreSQL and Redis the claim (idem's claim statement with sqlx, same binds, same decoded columns; `SET … NX GET PX`), which answers a new key and a replay in one round trip alike, on SQLite and the memory store a read. Ratio = engine throughput / floor throughput. The memory store's engine and its floor start from an empty store and an empty map at each concurrency of each round, as its HTTP cells do.\n");
    print!("| store, operation |");
    for c in CONCURRENCY {
        print!(" {c}: floor req/s (p50) | {c}: engine req/s (p50) | ratio |");
    }
    println!();
    println!("|---|{}", "---|---|---|".repeat(CONCURRENCY.len()));
    for t in targets {
        let n = t.backend.name();
        let unfenced = (t.backend == Backend::Redis).then_some((
            "new, against an unfenced floor",
            Path::FloorNewUnfenced,
            Path::EngineNew,
        ));
        for (label, floor, engine) in [
            Some(("new", Path::FloorNew, Path::EngineNew)),
            Some(("replay", Path::replay_floor(t.backend), Path::EngineReplay)),
            unfenced,
        ]
        .into_iter()
        .flatten()
        {
            let mut line = format!("| {n}, {label} |");
            for c in CONCURRENCY {
                let f = med(cells, (Some(n), floor, c));
                let e = med(cells, (Some(n), engine, c));
                line += &format!(
                    " {} ({}) | {} ({}) | {} |",
                    rate(f.rps),
                    d(f.p50),
                    rate(e.rps),
                    d(e.p50),
                    pct(e.rps / f.rps.max(1e-9))
                );
            }
            println!("{line}");
        }
    }

    if targets.iter().any(|t| t.backend == Backend::Redis) {
        println!("\nEvery floor's completion is fenced, as idem's is: it stores the response only if the record is still the claim's own in-flight record (the token compared under the map's lock or in the SQL `WHERE`; on Redis, whose 7.0 has no `SET` conditional on a value, by a short script: `GET`, compare, `SET … KEEPTTL`). The Redis row \"new, against an unfenced floor\" divides the same engine figures by a floor that completes with a plain `SET … XX`, which would overwrite a record another claim took over; its floor column beside the fenced floor's shows what the fence costs on this Redis.");
    }

    let split: Vec<&Target> = targets
        .iter()
        .filter(|t| matches!(t.backend, Backend::Postgres | Backend::Redis))
        .collect();
    if !split.is_empty() {
        println!("\nWhat answering a replay with a command that can also claim costs: the claim issued directly (the replay floor above) against a bare read of the record (`SELECT … WHERE scope = $1 AND key = $2`, `GET`). A design that read first would replay at the bare read's cost and make every new request 3 round trips.\n");
        print!("| replay |");
        for c in CONCURRENCY {
            print!(" {c}: bare read, req/s (p50) | claim vs bare read |");
        }
        println!();
        println!("|---|{}", "---|---|".repeat(CONCURRENCY.len()));
        for t in split {
            let n = t.backend.name();
            let mut line = format!("| {n} |");
            for c in CONCURRENCY {
                let st = med(cells, (Some(n), Path::StatementReplay, c));
                let f = med(cells, (Some(n), Path::FloorReplay, c));
                line += &format!(
                    " {} ({}) | {} |",
                    rate(f.rps),
                    d(f.p50),
                    pct(st.rps / f.rps.max(1e-9))
                );
            }
            println!("{line}");
        }
    }

    // Targets.
    report_memory_targets(targets, cells, &held);
    for t in targets {
        let n = t.backend.name();
        match t.backend {
            Backend::Memory | Backend::Sqlite => {}
            Backend::Postgres | Backend::Redis => {
                let what = if t.backend == Backend::Postgres {
                    "PostgreSQL: ≥ 80% of the direct-SQL floor"
                } else {
                    "Redis: ≥ 80% of the direct-command floor"
                };
                for c in CONCURRENCY {
                    let new = med(cells, (Some(n), Path::EngineNew, c)).rps
                        / med(cells, (Some(n), Path::FloorNew, c)).rps.max(1e-9);
                    let replay_rps = med(cells, (Some(n), Path::EngineReplay, c)).rps;
                    let replay = replay_rps
                        / med(cells, (Some(n), Path::replay_floor(t.backend), c))
                            .rps
                            .max(1e-9);
                    let bare =
                        replay_rps / med(cells, (Some(n), Path::FloorReplay, c)).rps.max(1e-9);
                    let mut measured = format!(
                        "new {} / replay {} (replay vs a bare read {})",
                        pct1(new),
                        pct1(replay),
                        pct1(bare)
                    );
                    if t.backend == Backend::Redis {
                        let unfenced = med(cells, (Some(n), Path::EngineNew, c)).rps
                            / med(cells, (Some(n), Path::FloorNewUnfenced, c))
                                .rps
                                .max(1e-9);
                        measured += &format!(" (new vs an unfenced floor {})", pct1(unfenced));
                    }
                    report::target(
                        format!("{what}, {c} conn"),
                        measured,
                        new >= 0.8 && replay >= 0.8,
                    );
                }
            }
        }
    }
}

/// The memory store's HTTP cells, each beside its floor's: (label, idem's path, the floor's path).
fn memory_pairs(held: &str) -> [(String, Path, Path); 3] {
    [
        ("new key".into(), Path::HttpNew, Path::HttpFloorNew),
        ("replay".into(), Path::HttpReplay, Path::HttpFloorReplay),
        (
            format!("new key, {held} records held"),
            Path::HttpNewHeld,
            Path::HttpFloorNewHeld,
        ),
    ]
}

/// The floor's HTTP paths, labelled.
fn floor_paths(held: &str) -> impl Iterator<Item = (String, Path)> {
    memory_pairs(held)
        .into_iter()
        .map(|(label, _, floor)| (label, floor))
}

/// What the memory floor leaves of plain, and what idem reaches of the floor, per cell.
fn print_memory_floor(cells: &Cells, held: &str) {
    let n = Some(Backend::Memory.name());
    println!("\n### The memory store against its HTTP floor\n");
    println!("The floor's throughput as a ratio of plain's (what keeping a record per request leaves, with no framework), and idem's as a ratio of the floor's (what idem adds beyond that). Ratios of the medians.\n");
    print!("| cell |");
    for c in CONCURRENCY {
        print!(" {c}: floor vs plain | {c}: idem vs floor |");
    }
    println!();
    println!("|---|{}", "---|---|".repeat(CONCURRENCY.len()));
    for (label, idem, floor) in memory_pairs(held) {
        let mut line = format!("| {label} |");
        for c in CONCURRENCY {
            let plain = med(cells, (None, Path::Plain, c)).rps;
            let f = med(cells, (n, floor, c)).rps;
            let i = med(cells, (n, idem, c)).rps;
            line += &format!(" {} | {} |", pct(f / plain.max(1e-9)), pct(i / f.max(1e-9)));
        }
        println!("{line}");
    }
}

/// `IDEM_BENCH_HTTP_ONLY`: only the HTTP cells are measured.
fn http_only() -> bool {
    std::env::var_os("IDEM_BENCH_HTTP_ONLY").is_some()
}

/// A memory-store HTTP cell's ratio to another cell at concurrency `c` (plain's, `over` = `None`,
/// or the floor's path), as the target judges it (the ratio of the medians), followed by its
/// per-round ratios: each round's cell divided by the other cell of the same round and concurrency,
/// their median and range, as `89.8% (per round: 90.1%, 85.0–93.2%)` (the per-round part left out
/// with fewer than two rounds). Every figure is rounded down, as [`pct1`] does. The per-round
/// figures show how far single rounds of this machine scatter, and the paired figure that drift
/// between rounds does not move; the target stays judged on the ratio of the medians, as every
/// other ratio in the report.
fn memory_ratio(cells: &Cells, path: Path, over: Option<Path>, c: usize) -> (f64, String) {
    let n = Some(Backend::Memory.name());
    let base = match over {
        None => (None, Path::Plain, c),
        Some(floor) => (n, floor, c),
    };
    let judged = med(cells, (n, path, c)).rps / med(cells, base).rps.max(1e-9);
    let (Some(base), Some(cell)) = (cells.get(&base), cells.get(&(n, path, c))) else {
        return (judged, pct1(judged));
    };
    // One sample per round in each list, pushed in round order.
    debug_assert_eq!(base.len(), cell.len());
    let ratios: Vec<f64> = base
        .iter()
        .zip(cell)
        .map(|(p, s)| s.throughput() / p.throughput().max(1e-9))
        .collect();
    if ratios.len() < 2 {
        return (judged, pct1(judged));
    }
    let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let high = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let paired = median(ratios);
    let text = format!(
        "{} (per round: {}, {}–{})",
        pct1(judged),
        pct1(paired),
        pct1(low).trim_end_matches('%'),
        pct1(high)
    );
    (judged, text)
}

/// The memory store's target, judged on the HTTP cells: on an empty store (what idem adds to a
/// request), and on one holding `held` records (what a large table adds as well). First as the
/// issue states it, against plain, with what the floor by hand reaches of plain beside it; then
/// against that floor, as every other store is judged against its own (BENCHMARKS.md, "Decided").
fn report_memory_targets(targets: &[Target], cells: &Cells, held: &str) {
    if !targets.iter().any(|t| t.backend == Backend::Memory) {
        return;
    }
    let [new, replay, new_held] = memory_pairs(held);
    for (what, over) in [("plain throughput", false), ("its HTTP floor", true)] {
        let ratio = |(_, idem, floor): &(String, Path, Path), c| {
            memory_ratio(cells, *idem, over.then_some(*floor), c)
        };
        let floor_of_plain = |(_, _, floor): &(String, Path, Path), c| {
            let (f, _) = memory_ratio(cells, *floor, None, c);
            if over {
                String::new()
            } else {
                format!("; the floor by hand {} of plain", pct1(f))
            }
        };
        for c in CONCURRENCY {
            let ((n, n_text), (r, r_text)) = (ratio(&new, c), ratio(&replay, c));
            report::target(
                format!("memory store: annotated ≥ 90% of {what}, {c} conn"),
                format!(
                    "new {n_text}{} / replay {r_text}{}",
                    floor_of_plain(&new, c),
                    floor_of_plain(&replay, c)
                ),
                n >= 0.9 && r >= 0.9,
            );
        }
        for c in CONCURRENCY {
            let (n, n_text) = ratio(&new_held, c);
            report::target(
                format!("memory store: annotated ≥ 90% of {what}, {held} records held, {c} conn"),
                format!("new {n_text}{}", floor_of_plain(&new_held, c)),
                n >= 0.9,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A one-second cell that served `ok` requests.
    fn cell(ok: u64) -> Sample {
        Sample {
            ok,
            elapsed: Duration::from_secs(1),
            ..Sample::default()
        }
    }

    /// A load that only logs which slices it was given.
    struct Logged {
        id: usize,
        log: Arc<std::sync::Mutex<Vec<(usize, Duration)>>>,
    }

    impl Sliced for Logged {
        fn run_slice(
            &mut self,
            bounds: Bounds,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
            let log = self.log.clone();
            let id = self.id;
            Box::pin(async move { log.lock().expect("not poisoned").push((id, bounds.time)) })
        }

        fn into_sample(self: Box<Self>) -> Sample {
            Sample::default()
        }
    }

    /// What makes the sliced ratios fair: every load gets [`SLICES`] slices of an equal share of
    /// the cell's time, and the order rotates, so no load always runs first or last in a turn.
    #[tokio::test]
    async fn interleaving_gives_every_load_equal_slices_in_rotating_order() {
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut loads: Vec<(usize, Box<dyn Sliced>)> = (0..3)
            .map(|id| {
                let load: Box<dyn Sliced> = Box::new(Logged {
                    id,
                    log: log.clone(),
                });
                (id, load)
            })
            .collect();
        let bounds = Bounds {
            time: Duration::from_secs(1),
            requests: 10,
        };
        interleaved(&mut loads, bounds).await;
        let log = log.lock().expect("not poisoned").clone();
        assert_eq!(log.len(), 3 * SLICES as usize);
        assert!(log.iter().all(|&(_, t)| t == bounds.time / SLICES));
        for (turn, slices) in log.chunks(3).enumerate() {
            let order: Vec<usize> = slices.iter().map(|&(id, _)| id).collect();
            let expected: Vec<usize> = (0..3).map(|i| (i + turn) % 3).collect();
            assert_eq!(order, expected, "turn {turn}");
        }
    }

    #[test]
    fn per_round_ratios_pair_each_round_with_its_plain_cell_and_round_down() {
        let memory = Some(Backend::Memory.name());
        let mut cells = Cells::new();
        // Plain drifts between rounds; each round's new-key cell is a fixed share of its own plain.
        cells.insert(
            (None, Path::Plain, 16),
            vec![cell(1000), cell(2000), cell(4000)],
        );
        cells.insert(
            (memory, Path::HttpNew, 16),
            vec![cell(899), cell(1900), cell(3000)],
        );
        let (judged, text) = memory_ratio(&cells, Path::HttpNew, None, 16);
        // The judged ratio is of the medians (1900 / 2000), the per-round ones of the pairs.
        assert!((judged - 0.95).abs() < 1e-12);
        assert_eq!(text, "95.0% (per round: 89.9%, 75.0–95.0%)");
        // One round has no spread to show; a missing cell has no pairs.
        cells.insert((None, Path::Plain, 1), vec![cell(1000)]);
        cells.insert((memory, Path::HttpNew, 1), vec![cell(900)]);
        assert_eq!(memory_ratio(&cells, Path::HttpNew, None, 1).1, "90.0%");
        assert_eq!(memory_ratio(&cells, Path::HttpReplay, None, 16).1, "0.0%");
        // Against the floor, each round pairs with the floor's cell of the same round instead.
        cells.insert(
            (memory, Path::HttpFloorNew, 16),
            vec![cell(1000), cell(2000), cell(3750)],
        );
        let (judged, text) = memory_ratio(&cells, Path::HttpNew, Some(Path::HttpFloorNew), 16);
        assert!((judged - 0.95).abs() < 1e-12);
        assert_eq!(text, "95.0% (per round: 89.9%, 80.0–95.0%)");
    }
}
