//! `before-after`: two builds of the same server (`benches/before-after/server`, built from two
//! commits by `benches/before-after/run`) loaded in turns, new keys and replays, so that a change's
//! cost is a ratio measured in one run on one machine state. `before-after-requests` sends a fixed
//! number of requests one after another, for the runner's instruction counts under callgrind.

use crate::http::{seed, CONNECTIONS, REPLAY_KEYS};
use crate::load::{interleaved, Bounds, Connections, Keys, Sample, Sliced};
use crate::report::{median, pct, rate, Config};
use std::net::SocketAddr;
use std::sync::Arc;

/// Loads `before` and `after` (each serving `/idem`) in interleaved rounds and prints one table
/// row per cell: their medians and after ÷ before, with the lowest and highest round's ratio.
pub(crate) async fn run(before: SocketAddr, after: SocketAddr, label: &str, cfg: &Config) {
    for addr in [before, after] {
        if let Err(e) = seed(addr, "/idem", None).await {
            println!("| {label} | not run: {addr}: {e} | | | |");
            return;
        }
    }
    let bounds = Bounds {
        time: cfg.cell(),
        requests: u64::MAX,
    };
    let replay_keys = Arc::new(crate::http::replay_keys());
    // Per cell (new keys, replays), per round: (before, after).
    let mut cells: [Vec<(Sample, Sample)>; 2] = [Vec::new(), Vec::new()];
    for round in 0..cfg.rounds {
        eprintln!(
            "before-after {label}: round {} of {}",
            round + 1,
            cfg.rounds
        );
        // In order: new keys before, after; replays before, after.
        let mut loads: Vec<((), Box<dyn Sliced>)> = Vec::new();
        for replay in [false, true] {
            for addr in [before, after] {
                let keys = match replay {
                    false => Keys::Fresh(format!("ab-{round}").into()),
                    true => Keys::Replay(replay_keys.clone()),
                };
                let load = Connections::open(addr, "/idem", keys, CONNECTIONS).await;
                loads.push(((), Box::new(load)));
            }
        }
        interleaved(&mut loads, bounds).await;
        let mut samples = loads.into_iter().map(|(_, load)| load.into_sample());
        for cell in &mut cells {
            if let (Some(b), Some(a)) = (samples.next(), samples.next()) {
                cell.push((b, a));
            }
        }
    }
    for (name, rounds) in ["new keys", "replays"].iter().zip(&cells) {
        let before = median(rounds.iter().map(|(b, _)| b.throughput()).collect());
        let after = median(rounds.iter().map(|(_, a)| a.throughput()).collect());
        let mut ratios: Vec<f64> = rounds
            .iter()
            .map(|(b, a)| a.throughput() / b.throughput().max(1e-9))
            .collect();
        ratios.sort_by(f64::total_cmp);
        let errors: u64 = rounds.iter().map(|(b, a)| b.errors + a.errors).sum();
        println!(
            "| {label}, {name} | {} | {} | {} ({}–{}) | {errors} |",
            rate(before),
            rate(after),
            pct(median(ratios.clone())),
            pct(ratios.first().copied().unwrap_or_default()),
            pct(ratios.last().copied().unwrap_or_default()),
        );
    }
}

/// The table's head, printed once by `benches/before-after/run` before its rows.
pub(crate) fn header(cfg: &Config) {
    println!(
        "Requests per second at {CONNECTIONS} connections (median of {} interleaved rounds of {} s \
         per cell; replays cycle through {REPLAY_KEYS} completed keys); the ratio is after ÷ before \
         per round, its median and its range.\n",
        cfg.rounds, cfg.secs
    );
    println!("| store, cell | before, req/s | after, req/s | after ÷ before (range) | errors |");
    println!("|---|---|---|---|---|");
}

/// Sends `count` requests to `addr`'s `/idem` one after another on one connection: new keys (unique
/// to this call), or replays of the seeded keys (seeding them first). Fails on any answer but 2xx.
pub(crate) async fn requests(addr: SocketAddr, replay: bool, count: usize) -> Result<(), String> {
    let keys = crate::http::replay_keys();
    if replay {
        seed(addr, "/idem", None).await?;
    }
    let run = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut sender = crate::load::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    for i in 0..count {
        let key = match replay {
            true => keys[i % keys.len()].clone(),
            false => format!("count-{run}-{i}"),
        };
        match crate::load::send(&mut sender, crate::load::post("/idem", &key)).await {
            Some(status) if status.is_success() => {}
            other => return Err(format!("request {i}: {other:?}")),
        }
    }
    Ok(())
}
