//! Round trips per request, counted on the wire by a TCP proxy between the store and its server.

use crate::counting;
use crate::floors;
use crate::report;
use crate::setup::{self, Backend};
use idem_runtime::Engine;
use std::net::SocketAddr;
use std::time::Duration;

const N: u64 = 200;

fn socket(url: &str) -> Option<SocketAddr> {
    let rest = url.split_once("://")?.1;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let host = rest.split('/').next()?;
    host.parse().ok()
}

pub(crate) async fn run() {
    println!("\n## Round trips to the store per request\n");
    println!("Counted by a TCP proxy between the store and its server, over {N} sequential requests after a warm-up: a round trip is a client send that follows a server reply. For PostgreSQL the proxy also counts statements (`Bind`/`Query` messages) and sqlx's release pings (a lone `Sync` that sqlx sends as each connection returns to its pool, after the request's statement has answered, off the request's path).\n");
    println!("| store | new request: round trips | statements | release pings | replay: round trips | statements | release pings | connections opened meanwhile |");
    println!("|---|---|---|---|---|---|---|---|");
    for backend in [Backend::Postgres, Backend::Redis] {
        let (upstream, postgres) = match backend {
            Backend::Postgres => (socket(&setup::postgres_base()), true),
            _ => (socket(&setup::redis_url()), false),
        };
        let Some(upstream) = upstream else {
            eprintln!("round trips: cannot parse the {} address", backend.name());
            continue;
        };
        let (addr, wire) = counting::proxy(upstream, postgres).await;
        let store: std::sync::Arc<dyn idem_runtime::Store> = match backend {
            Backend::Postgres => match setup::postgres(Some(addr)).await {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("round trips: skipping PostgreSQL: {e}");
                    continue;
                }
            },
            _ => match setup::redis(Some(addr)).await {
                Ok((s, _)) => s,
                Err(e) => {
                    eprintln!("round trips: skipping Redis: {e}");
                    continue;
                }
            },
        };
        let engine = Engine::from_arc(store);
        let scope = format!("rt-{}", std::process::id());
        // Warm up concurrently, so that the pool has opened all its connections and each has
        // prepared the statements: the measurement then sees the steady state.
        for round in 0..10 {
            let tasks: Vec<_> = (0..32)
                .map(|i| {
                    let (engine, scope) = (engine.clone(), scope.clone());
                    tokio::spawn(async move {
                        let key = format!("warm-{round}-{i}");
                        floors::engine_new(&engine, &scope, key.clone()).await
                            && floors::engine_replay(&engine, &scope, key).await
                    })
                })
                .collect();
            for t in tasks {
                assert!(t.await.expect("warm-up task"), "warm-up request");
            }
        }
        let settle = || tokio::time::sleep(Duration::from_millis(300));
        settle().await;
        let a = wire.snapshot();
        for i in 0..N {
            assert!(floors::engine_new(&engine, &scope, format!("k-{i}")).await);
        }
        settle().await;
        let b = wire.snapshot();
        for i in 0..N {
            assert!(floors::engine_replay(&engine, &scope, format!("k-{i}")).await);
        }
        settle().await;
        let c = wire.snapshot();
        let per = |x: u64, y: u64| (y - x) as f64 / N as f64;
        let (new_rt, replay_rt) = (per(a[0], b[0]), per(b[0], c[0]));
        let cols = |x: [u64; 4], y: [u64; 4]| {
            if postgres {
                format!(
                    "{:.2} | {:.2} | {:.2}",
                    per(x[0], y[0]),
                    per(x[1], y[1]),
                    per(x[2], y[2])
                )
            } else {
                format!("{:.2} | — | —", per(x[0], y[0]))
            }
        };
        println!(
            "| {} | {} | {} | {} |",
            backend.name(),
            cols(a, b),
            cols(b, c),
            c[3] - a[3]
        );
        report::target(
            format!(
                "{}: ≤ 2 round trips for a new request, 1 for a replay",
                backend.name()
            ),
            format!("new {new_rt:.2}, replay {replay_rt:.2}"),
            new_rt <= 2.0 && replay_rt <= 1.0,
        );
    }
}
