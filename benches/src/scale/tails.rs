//! The SQLite store's latency tail: new keys at 16 concurrent operations through idem's engine on
//! fresh files, the batching store beside the same store [`unbatched`], interleaved in slices.
//!
//! [`unbatched`]: idem_runtime::store::sqlite::SqliteStore::unbatched

use crate::floors;
use crate::load::{interleaved, Bounds, Ops, Sample, Sliced};
use crate::report::Config;
use crate::stores;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::Engine;
use std::sync::Arc;

/// The variants compared.
pub(crate) const VARIANTS: [&str; 2] = ["batched (the default)", "unbatched"];

/// One sample per variant and round.
pub(crate) async fn run(cfg: &Config) -> Vec<Vec<Sample>> {
    let mut engines = Vec::new();
    for (v, _) in VARIANTS.iter().enumerate() {
        let path = stores::scratch().join(format!("tails-{v}.db"));
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let store = SqliteStore::connect(&url).await.expect("open SQLite");
        let store = if v == 1 { store.unbatched() } else { store };
        engines.push(Engine::from_arc(Arc::new(store)));
    }
    let bounds = Bounds {
        time: cfg.cell(),
        requests: u64::MAX,
    };
    let mut out = vec![Vec::new(); VARIANTS.len()];
    for round in 0..cfg.rounds {
        eprintln!("tails: round {} of {}", round + 1, cfg.rounds);
        let mut loads: Vec<(usize, Box<dyn Sliced>)> = engines
            .iter()
            .enumerate()
            .map(|(v, engine)| {
                let e = engine.clone();
                let load: Box<dyn Sliced> = Box::new(Ops::new(16, move |w, n| {
                    let e = e.clone();
                    async move { floors::engine_new(&e, "tails", format!("{round}-{w}-{n}")).await }
                }));
                (v, load)
            })
            .collect();
        interleaved(&mut loads, bounds).await;
        for (v, load) in loads {
            out[v].push(load.into_sample());
        }
    }
    out
}
