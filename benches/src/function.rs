//! The function section: [`Engine::once`] (any async work run once per key, its output stored as
//! JSON) on each store, beside the same store's engine path (`begin` then `complete`, as the
//! store-level section measures it) and its HTTP path (the HTTP section's handler under
//! `#[idempotent]`), in the same interleaved rounds. New keys and replays at 1 and 16 concurrent
//! callers.
//!
//! As in the store-level section, the memory store starts empty at each concurrency of each round;
//! the other stores keep one database for the run.

use crate::floors;
use crate::http;
use crate::load::{interleaved, Bounds, Connections, Keys, Ops, Sample, Sliced};
use crate::report::{dur, median, pct, rate, Config};
use crate::stores::{Backend, Handle};
use idem_runtime::function::Attempt;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{Engine, Fingerprint, RecordKey};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

const CONCURRENCY: [usize; 2] = [1, 16];
const REPLAY_KEYS: usize = 256;
/// The scope the function's replay cells read.
const REPLAY_SCOPE: &str = "function-replay";

/// The call's input: what a queue message asking for a charge would carry.
#[derive(Debug, Serialize)]
struct Charge {
    amount: i64,
    currency: &'static str,
    description: &'static str,
}

const CHARGE: Charge = Charge {
    amount: 1000,
    currency: "KRW",
    description: "two apples",
};

/// The work's output: a small struct, stored as JSON and read back on every replay.
#[derive(Debug, Serialize, Deserialize)]
struct Receipt {
    id: u64,
    amount: i64,
    currency: String,
    status: String,
}

/// What a replay's work returns if it runs at all: a replay must not run it, so the cell counts
/// the call as failed.
#[derive(Debug)]
struct NotAReplay;

/// A new key through the function face: fingerprint the input, run the work, store its output.
async fn function_new(engine: &Engine, scope: &str, key: String) -> bool {
    let Ok(fingerprint) = Fingerprint::of_input(&CHARGE) else {
        return false;
    };
    engine
        .once(
            RecordKey::new(scope, key),
            fingerprint,
            &floors::POLICY,
            |_: Attempt| async {
                Ok::<_, std::convert::Infallible>(Receipt {
                    id: 123_456,
                    amount: CHARGE.amount,
                    currency: CHARGE.currency.to_owned(),
                    status: "captured".to_owned(),
                })
            },
        )
        .await
        .is_ok()
}

/// A replay through the function face: the stored output, read back as a [`Receipt`].
async fn function_replay(engine: &Engine, key: String) -> bool {
    let Ok(fingerprint) = Fingerprint::of_input(&CHARGE) else {
        return false;
    };
    engine
        .once(
            RecordKey::new(REPLAY_SCOPE, key),
            fingerprint,
            &floors::POLICY,
            |_: Attempt| async { Err::<Receipt, _>(NotAReplay) },
        )
        .await
        .is_ok_and(|receipt| receipt.amount == CHARGE.amount)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    Engine,
    Function,
    Http,
}

/// (store, path, replay, callers).
type Cells = BTreeMap<(&'static str, Path, bool, usize), Vec<Sample>>;

/// One store's engine, with its replay keys completed on every path, and an HTTP server on it.
struct Target {
    backend: Backend,
    engine: Engine,
    addr: Result<SocketAddr, String>,
}

/// An engine on `handle`'s store with the replay keys completed through the function face and the
/// engine, and the HTTP section's server on it with its replay keys completed.
async fn target(backend: Backend, handle: &Handle) -> Target {
    let engine = Engine::from_arc(handle.store());
    for i in 0..REPLAY_KEYS as u64 {
        assert!(
            function_new(&engine, REPLAY_SCOPE, replay_key(i)).await
                || function_replay(&engine, replay_key(i)).await
        );
        // The store-level section, run before in `all`, may have completed these keys already.
        let key = || replay_key(i);
        assert!(
            floors::engine_new(&engine, "engine-replay", key()).await
                || floors::engine_replay(&engine, "engine-replay", key()).await
        );
    }
    let addr = match http::serve(http::idem_router(engine.clone())).await {
        Ok(addr) => http::seed(addr, "/idem", None).await.map(|()| addr),
        Err(e) => Err(e),
    };
    Target {
        backend,
        engine,
        addr,
    }
}

fn replay_key(n: u64) -> String {
    format!("r{}", n as usize % REPLAY_KEYS)
}

pub(crate) async fn run(handles: &[(Backend, Handle)], cfg: &Config) {
    let mut targets = Vec::new();
    for (backend, handle) in handles {
        if *backend != Backend::Memory {
            targets.push(target(*backend, handle).await);
        }
    }
    let memory = handles.iter().any(|(b, _)| *b == Backend::Memory);
    let bounds = Bounds {
        time: cfg.cell(),
        requests: u64::MAX,
    };
    let mut cells = Cells::new();
    let mut skipped = BTreeMap::new();
    let mut run_id = 0u64;
    for round in 0..cfg.rounds {
        for &c in &CONCURRENCY {
            eprintln!(
                "function: round {} of {}, {c} callers",
                round + 1,
                cfg.rounds
            );
            // The memory store starts empty here, first in the list as in the other sections.
            let fresh = if memory {
                let handle = Handle::Memory(Arc::new(MemoryStore::new()));
                Some(target(Backend::Memory, &handle).await)
            } else {
                None
            };
            for t in fresh.iter().chain(&targets) {
                run_id += 1;
                let mut loads = loads(t, run_id, c).await;
                if let Err(why) = &t.addr {
                    skipped.insert(t.backend.name(), why.clone());
                }
                interleaved(&mut loads, bounds).await;
                for ((path, replay), load) in loads {
                    let key = (t.backend.name(), path, replay, c);
                    cells.entry(key).or_default().push(load.into_sample());
                }
            }
        }
    }
    let mut names: Vec<&'static str> = Vec::new();
    if memory {
        names.push(Backend::Memory.name());
    }
    names.extend(targets.iter().map(|t| t.backend.name()));
    print(&names, &cells, &skipped, cfg);
}

/// The cells of one store at `c` concurrent callers: the function face, the engine and (if its
/// server runs) HTTP, each with new keys and replays; `run_id` keeps every cell's new keys apart.
async fn loads(t: &Target, run_id: u64, c: usize) -> Vec<((Path, bool), Box<dyn Sliced>)> {
    let (e1, e2, e3, e4) = (
        t.engine.clone(),
        t.engine.clone(),
        t.engine.clone(),
        t.engine.clone(),
    );
    let fn_scope: Arc<str> = format!("function-{run_id}").into();
    // Not the store-level section's `engine-{run_id}`: in `all` it ran before on the same stores.
    let engine_scope: Arc<str> = format!("function-engine-{run_id}").into();
    let mut loads: Vec<((Path, bool), Box<dyn Sliced>)> = vec![
        (
            (Path::Function, false),
            Box::new(Ops::new(c, move |w, n| {
                let (e, scope) = (e1.clone(), fn_scope.clone());
                async move { function_new(&e, &scope, format!("{w}-{n}")).await }
            })),
        ),
        (
            (Path::Function, true),
            Box::new(Ops::new(c, move |_, n| {
                let e = e2.clone();
                async move { function_replay(&e, replay_key(n)).await }
            })),
        ),
        (
            (Path::Engine, false),
            Box::new(Ops::new(c, move |w, n| {
                let (e, scope) = (e3.clone(), engine_scope.clone());
                async move { floors::engine_new(&e, &scope, format!("{w}-{n}")).await }
            })),
        ),
        (
            (Path::Engine, true),
            Box::new(Ops::new(c, move |_, n| {
                let e = e4.clone();
                async move { floors::engine_replay(&e, "engine-replay", replay_key(n)).await }
            })),
        ),
    ];
    if let Ok(addr) = t.addr {
        let fresh = Keys::Fresh(format!("function-http-{run_id}").into());
        let replays = Keys::Replay(Arc::new(http::replay_keys()));
        loads.push((
            (Path::Http, false),
            Box::new(Connections::open(addr, "/idem", fresh, c).await),
        ));
        loads.push((
            (Path::Http, true),
            Box::new(Connections::open(addr, "/idem", replays, c).await),
        ));
    }
    loads
}

fn print(
    names: &[&'static str],
    cells: &Cells,
    skipped: &BTreeMap<&'static str, String>,
    cfg: &Config,
) {
    println!("## Function calls: `Engine::once` beside the engine and the HTTP path\n");
    println!(
        "Calls per second (median of {} interleaved rounds of {} s per cell; p50 in brackets) on \
         each store. A new key is one `Engine::once` whose work returns a small struct at once: the \
         input fingerprinted through serde (`Fingerprint::of_input`), the claim, the work, the \
         output serialized to JSON and stored. A replay is one `once` on a completed key: the \
         stored JSON read back into the struct, the work not run (a replay that ran it would count \
         as failed). Beside them, in the same rounds: the engine's own `begin` then `complete` \
         (the store-level section's engine cells), and the HTTP section's handler under \
         `#[idempotent]` at as many keep-alive connections as there are callers. \"vs engine\" \
         is each path's rate over the engine's.\n",
        cfg.rounds, cfg.secs
    );
    print!("| store, call |");
    for c in CONCURRENCY {
        print!(
            " {c} caller{s}: engine | function | vs engine | HTTP | vs engine |",
            s = if c == 1 { "" } else { "s" }
        );
    }
    println!();
    println!("|---|{}", "---|---|---|---|---|".repeat(CONCURRENCY.len()));
    let med = |key| {
        let samples: &[Sample] = cells.get(&key).map_or(&[], Vec::as_slice);
        (
            median(samples.iter().map(Sample::throughput).collect()),
            Duration::from_secs_f64(median(
                samples.iter().map(|s| s.p50().as_secs_f64()).collect(),
            )),
            !samples.is_empty(),
        )
    };
    for &n in names {
        for (label, replay) in [("new key", false), ("replay", true)] {
            let mut line = format!("| {n}, {label} |");
            for c in CONCURRENCY {
                let (e, ep, _) = med((n, Path::Engine, replay, c));
                let (f, fp, _) = med((n, Path::Function, replay, c));
                let (h, hp, measured) = med((n, Path::Http, replay, c));
                let vs = |x: f64| pct(x / e.max(1e-9));
                line += &format!(
                    " {} ({}) | {} ({}) | {} |",
                    rate(e),
                    dur(ep),
                    rate(f),
                    dur(fp),
                    vs(f)
                );
                line += &if measured {
                    format!(" {} ({}) | {} |", rate(h), dur(hp), vs(h))
                } else {
                    " — | — |".to_owned()
                };
            }
            println!("{line}");
        }
    }
    let errors: u64 = cells.values().flatten().map(|s| s.errors).sum();
    println!("\nFailed calls in all cells: {errors}.");
    for (name, why) in skipped {
        println!("HTTP on {name} not run: {why}.");
    }
    println!(
        "\nWhat the function face adds to the engine's `begin` and `complete` is in the process, \
         not on the wire: the same claim and completion reach the store, while the input is \
         fingerprinted by turning it into a JSON value and hashing it canonically (the engine \
         cells hash the request's bytes), a new key's output is serialized to JSON and a \
         replay's parsed back into the output type, and the work runs under the claim's lease \
         keeper (which sets no timer for work that is done at its first poll). On a store reached \
         over the network this is lost in the round trips; on the memory store it is a visible \
         share of a call that costs microseconds.\n"
    );
}
