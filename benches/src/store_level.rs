//! The store-level section: new keys and replays through idem's engine (no HTTP) beside the same
//! work issued directly on each store (its floor, `floors`), interleaved in slices within each
//! round, each figure the median over the rounds.
//!
//! The memory store's engine and its floor start empty at each concurrency of each round: one store
//! kept for the run would hold whatever the cells before it wrote, and a claim's cost grows with
//! the table once it outgrows the caches. The other stores keep one database for the run: a round
//! trip to them costs far more than their tables' growth.

use crate::floors::{self, Floor};
use crate::load::{interleaved, Bounds, Ops, Sample, Sliced};
use crate::report::{median, pct, rate, tails, Config};
use crate::stores::{Backend, Handle};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::Engine;
use std::collections::BTreeMap;
use std::sync::Arc;

const CONCURRENCY: [usize; 2] = [1, 16];
const REPLAY_KEYS: usize = 256;
/// What idem on the memory store must reach of its floor.
const MEMORY_TARGET: f64 = 0.9;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    EngineNew,
    EngineReplay,
    FloorNew,
    FloorReplay,
}

type Cells = BTreeMap<(&'static str, Path, usize), Vec<Sample>>;

pub(crate) async fn run(handles: &[(Backend, Handle)], cfg: &Config) {
    let mut targets = Vec::new();
    for (backend, handle) in handles {
        let engine = Engine::from_arc(handle.store());
        let floor = Floor::for_handle(handle);
        if *backend != Backend::Memory {
            seed_replays(&engine, &floor).await;
        }
        targets.push((*backend, engine, floor));
    }
    let bounds = Bounds {
        time: cfg.cell(),
        requests: u64::MAX,
    };
    let mut cells = Cells::new();
    let mut run_id = 0u64;
    for round in 0..cfg.rounds {
        for &c in &CONCURRENCY {
            eprintln!(
                "store level: round {} of {}, {c} connections",
                round + 1,
                cfg.rounds
            );
            for (backend, engine, floor) in &targets {
                run_id += 1;
                let (engine, floor) = if *backend == Backend::Memory {
                    let handle = Handle::Memory(Arc::new(MemoryStore::new()));
                    let (e, f) = (Engine::from_arc(handle.store()), Floor::for_handle(&handle));
                    seed_replays(&e, &f).await;
                    (e, f)
                } else {
                    (engine.clone(), floor.clone())
                };
                let claim_replays = matches!(backend, Backend::Postgres | Backend::Redis);
                let mut loads = loads(&engine, &floor, claim_replays, run_id, c);
                interleaved(&mut loads, bounds).await;
                for (path, load) in loads {
                    let key = (backend.name(), path, c);
                    cells.entry(key).or_default().push(load.into_sample());
                }
            }
        }
    }
    print(&targets, &cells);
}

/// The four cells of one store at `c` concurrent operations; `run_id` keeps each cell's new keys
/// apart from every other's. With `claim_replays` the floor replays through idem's claim statement
/// issued directly (PostgreSQL and Redis answer a replay from the claim), otherwise by a read.
fn loads(
    engine: &Engine,
    floor: &Floor,
    claim_replays: bool,
    run_id: u64,
    c: usize,
) -> Vec<(Path, Box<dyn Sliced>)> {
    let (e1, e2, f1, f2) = (engine.clone(), engine.clone(), floor.clone(), floor.clone());
    let scope: Arc<str> = format!("engine-{run_id}").into();
    let prefix: Arc<str> = format!("f{run_id}").into();
    vec![
        (
            Path::EngineNew,
            Box::new(Ops::new(c, move |w, n| {
                let (e, scope) = (e1.clone(), scope.clone());
                async move { floors::engine_new(&e, &scope, format!("{w}-{n}")).await }
            })),
        ),
        (
            Path::EngineReplay,
            Box::new(Ops::new(c, move |_, n| {
                let e = e2.clone();
                async move { floors::engine_replay(&e, "engine-replay", replay_key(n)).await }
            })),
        ),
        (
            Path::FloorNew,
            Box::new(Ops::new(c, move |w, n| {
                let (f, key) = (f1.clone(), format!("{prefix}-{w}-{n}"));
                async move { f.new_request(&key).await }
            })),
        ),
        (
            Path::FloorReplay,
            Box::new(Ops::new(c, move |_, n| {
                let f = f2.clone();
                async move {
                    if claim_replays {
                        f.replay_via_claim_statement(&replay_key(n)).await
                    } else {
                        f.replay(&replay_key(n)).await
                    }
                }
            })),
        ),
    ]
}

/// Completes the keys the replay cells read, through the engine and on the floor.
async fn seed_replays(engine: &Engine, floor: &Floor) {
    for i in 0..REPLAY_KEYS as u64 {
        assert!(floors::engine_new(engine, "engine-replay", replay_key(i)).await);
        assert!(floor.new_request(&replay_key(i)).await);
    }
}

/// The `n`th operation's key among the completed keys every replay cell reads.
fn replay_key(n: u64) -> String {
    format!("r{}", n as usize % REPLAY_KEYS)
}

fn print(targets: &[(Backend, Engine, Floor)], cells: &Cells) {
    println!("## Store level: idem's engine against the store's direct floor\n");
    println!(
        "Operations per second (median over the rounds), with p50 / p99 / p99.9 latency over every \
         round's operations, without HTTP: a new key is \
         idem's claim then completion through its engine, against the floor, the same claim and \
         fenced completion written directly (a `Mutex<HashMap>` for memory, raw SQL on the store's \
         own pool and table, raw Redis commands); a replay is idem's lookup of a completed key, \
         against the floor's own read of it (on PostgreSQL and Redis, idem's claim statement, which \
         answers a replay in the same round trip). On MySQL and MariaDB both paths commit twice \
         per new key, and idem's claim reads the key before it inserts (a third round trip, which \
         answers a replay or a claim in flight without writing). \"Engine vs floor\" is what idem \
         keeps of the floor; the memory store's target is {}.\n",
        pct(MEMORY_TARGET)
    );
    print!("| store, operation |");
    for c in CONCURRENCY {
        print!(
            " {c} conn: floor | p50 / p99 / p99.9 | {c} conn: engine | p50 / p99 / p99.9 | engine vs floor |"
        );
    }
    println!();
    println!("|---|{}", "---|---|---|---|---|".repeat(CONCURRENCY.len()));
    let med = |key| {
        let samples: &[Sample] = cells.get(&key).map_or(&[], Vec::as_slice);
        (
            median(samples.iter().map(Sample::throughput).collect()),
            tails(&Sample::pooled(samples)),
        )
    };
    let mut verdicts = Vec::new();
    for (backend, _, _) in targets {
        let n = backend.name();
        for (label, floor, engine) in [
            ("new key", Path::FloorNew, Path::EngineNew),
            ("replay", Path::FloorReplay, Path::EngineReplay),
        ] {
            let mut line = format!("| {n}, {label} |");
            for c in CONCURRENCY {
                let (f, fp) = med((n, floor, c));
                let (e, ep) = med((n, engine, c));
                let ratio = e / f.max(1e-9);
                line += &format!(
                    " {} | {fp} | {} | {ep} | {} |",
                    rate(f),
                    rate(e),
                    pct(ratio)
                );
                if *backend == Backend::Memory {
                    verdicts.push(format!(
                        "{label} at {c} conn {} ({})",
                        pct(ratio),
                        if ratio >= MEMORY_TARGET {
                            "met"
                        } else {
                            "**not met**"
                        }
                    ));
                }
            }
            println!("{line}");
        }
    }
    let errors: u64 = cells.values().flatten().map(|s| s.errors).sum();
    println!("\nFailed operations in all cells: {errors}.");
    if !verdicts.is_empty() {
        println!(
            "Memory store against its floor (target {}): {}.",
            pct(MEMORY_TARGET),
            verdicts.join(", ")
        );
    }
    println!();
}
