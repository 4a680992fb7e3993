//! The SQLite store's latency tail: new keys at 16 concurrent operations through idem's engine on
//! fresh files, the batching store beside the same store [`unbatched`] and beside the batching store
//! with the write-ahead log checkpointed off the writer's path (`wal_autocheckpoint = 0` on its
//! connections and a passive checkpoint every 50 ms from the pool), interleaved in slices.
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
pub(crate) const VARIANTS: [&str; 3] = [
    "batched (the default)",
    "unbatched",
    "batched, checkpoints off the writer",
];

/// One sample per variant and round.
pub(crate) async fn run(cfg: &Config) -> Vec<Vec<Sample>> {
    let mut engines = Vec::new();
    let mut checkpointers = Vec::new();
    for (v, _) in VARIANTS.iter().enumerate() {
        let path = stores::scratch().join(format!("tails-{v}.db"));
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
        let url = format!("sqlite://{}?mode=rwc", path.display());
        let mut options = SqliteStore::options(&url).expect("SQLite options");
        if v == 2 {
            options = options.pragma("wal_autocheckpoint", "0");
        }
        let store = SqliteStore::connect_with(options)
            .await
            .expect("open SQLite");
        let store = if v == 1 { store.unbatched() } else { store };
        if v == 2 {
            let pool = store.pool().clone();
            checkpointers.push(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    let _ = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
                        .execute(&pool)
                        .await;
                }
            }));
        }
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
                    async move {
                        floors::engine_new(&e, "tails", format!("{round}-{w}-{n}")).await
                    }
                }));
                (v, load)
            })
            .collect();
        interleaved(&mut loads, bounds).await;
        for (v, load) in loads {
            out[v].push(load.into_sample());
        }
    }
    for c in checkpointers {
        c.abort();
    }
    out
}
