//! Round trips per request, counted on the wire by a TCP proxy between the store and its server.

use crate::counting;
use crate::floors;
use crate::report;
use crate::setup::{self, Backend};
use idem_runtime::transaction::{Transactional, TxBegin};
use idem_runtime::{Engine, RecordKey};
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
        let cols = |x: [u64; 5], y: [u64; 5]| {
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

/// Transactional mode on PostgreSQL: what idem adds to a business transaction that makes one write,
/// against the same transaction without idem (`BEGIN`, the write, `COMMIT`), on the wire.
pub(crate) async fn transactional() {
    println!("\n### Transactional mode (PostgreSQL): what idem adds to the business transaction\n");
    let Some(upstream) = socket(&setup::postgres_base()) else {
        eprintln!("round trips: cannot parse the PostgreSQL address");
        return;
    };
    let (addr, wire) = counting::proxy(upstream, true).await;
    let store = match setup::postgres(Some(addr)).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("round trips: skipping transactional mode: {e}");
            return;
        }
    };
    let pool = store.pool().clone();
    // Beside the proxy, for reading the transaction counter without adding to what it counts.
    let direct = match sqlx::PgPool::connect(&format!(
        "{}/idem_bench?sslmode=disable",
        setup::postgres_base()
    ))
    .await
    {
        Ok(pool) => pool,
        Err(e) => {
            eprintln!("round trips: skipping transactional mode: {e}");
            return;
        }
    };
    let ledger = "CREATE TABLE IF NOT EXISTS rt_ledger (k TEXT PRIMARY KEY)";
    if let Err(e) = sqlx::query(ledger).execute(&pool).await {
        eprintln!("round trips: cannot create the ledger: {e}");
        return;
    }
    let txn = match Transactional::new(Engine::from_arc(store.clone()), store) {
        Ok(txn) => txn,
        Err(e) => {
            eprintln!("round trips: {e}");
            return;
        }
    };
    let scope = format!("rt-tx-{}", std::process::id());
    let write = "INSERT INTO rt_ledger (k) VALUES ($1)";
    // Without idem: the business transaction alone.
    let plain = |k: String| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.expect("begin");
            sqlx::query(write)
                .bind(k)
                .execute(&mut *tx)
                .await
                .expect("write");
            tx.commit().await.expect("commit");
        }
    };
    // With idem: claim in the transaction, the same write, store the response and commit.
    let idem = |k: String| {
        let (txn, scope) = (txn.clone(), scope.clone());
        async move {
            let key = RecordKey::new(scope, k.clone());
            match txn.begin(key, floors::fingerprint(), &floors::POLICY).await {
                Ok(TxBegin::Execute(mut claim)) => {
                    sqlx::query(write)
                        .bind(k)
                        .execute(&mut **claim.tx())
                        .await
                        .expect("write");
                    claim.complete(&floors::response()).await.expect("complete");
                }
                _ => panic!("a new key executes"),
            }
        }
    };
    for i in 0..20 {
        plain(format!("warm-plain-{scope}-{i}")).await;
        idem(format!("warm-idem-{scope}-{i}")).await;
    }
    let settle = || tokio::time::sleep(Duration::from_millis(300));
    // One past the latest finished transaction id, which is the next id to be given out when, as
    // here, nothing is running: what it moves by is how many transactions wrote (a read-only one,
    // such as an autocommitted SELECT, is given none), committed or not (nothing here rolls back).
    // The counter is the server's, so anything else writing meanwhile (an autoanalyze, another
    // database) adds its own ids: the target allows a few of those, where an extra commit per
    // request would add one id per request.
    let next_xid = || async {
        sqlx::query_scalar::<_, i64>("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")
            .fetch_one(&direct)
            .await
            .expect("transaction counter")
    };
    settle().await;
    let (a, xa) = (wire.snapshot(), next_xid().await);
    for i in 0..N {
        plain(format!("plain-{scope}-{i}")).await;
    }
    settle().await;
    let (b, xb) = (wire.snapshot(), next_xid().await);
    for i in 0..N {
        idem(format!("idem-{scope}-{i}")).await;
    }
    settle().await;
    let (c, xc) = (wire.snapshot(), next_xid().await);
    for i in 0..N {
        let key = RecordKey::new(scope.clone(), format!("idem-{scope}-{i}"));
        match txn.begin(key, floors::fingerprint(), &floors::POLICY).await {
            Ok(TxBegin::Replay(_)) => {}
            _ => panic!("a completed key replays"),
        }
    }
    settle().await;
    let (d, xd) = (wire.snapshot(), next_xid().await);
    let per = |x: u64, y: u64| (y - x) as f64 / N as f64;
    let xids = |x: i64, y: i64| (y - x) as f64 / N as f64;
    println!("{N} sequential requests each. Statements count `BEGIN` and `COMMIT` (sent by sqlx as simple queries) and every bound statement; idem sends its lock-timeout settings in the same round trip as the `BEGIN`. \"Inside the transaction\" counts the bound statements between a `BEGIN` and its `COMMIT` (the business write is one). Writing transactions are read off PostgreSQL's transaction counter (`pg_current_snapshot()`), on a connection of their own: each transaction that writes takes one id, a read-only one none, so they are the commits that write (and flush).\n");
    println!(
        "| request | round trips | statements | inside the transaction | writing transactions |"
    );
    println!("|---|---|---|---|---|");
    println!(
        "| business transaction alone (`BEGIN`, 1 write, `COMMIT`) | {:.2} | {:.2} | {:.2} | {:.2} |",
        per(a[0], b[0]),
        per(a[1], b[1]),
        per(a[4], b[4]),
        xids(xa, xb)
    );
    println!(
        "| the same with `transaction = \"tx\"`, new key | {:.2} | {:.2} | {:.2} | {:.2} |",
        per(b[0], c[0]),
        per(b[1], c[1]),
        per(b[4], c[4]),
        xids(xb, xc)
    );
    println!(
        "| replay (a plain read, no transaction) | {:.2} | {:.2} | {:.2} | {:.2} |",
        per(c[0], d[0]),
        per(c[1], d[1]),
        per(c[4], d[4]),
        xids(xc, xd)
    );
    // Whole ids, over the N requests of each phase.
    let (alone, with_idem, replays) = (xb - xa, xc - xb, xd - xc);
    let stray = N as i64 / 20;
    report::target(
        "PostgreSQL transactional mode: no extra commit (new request), none for a replay",
        format!(
            "{with_idem} writing transactions for {N} new requests against {alone} for the business transaction alone; {replays} for {N} replays"
        ),
        with_idem - alone <= stray && replays <= stray,
    );
    let inside = per(b[4], c[4]) - per(a[4], b[4]);
    let added = per(b[1], c[1]) - per(a[1], b[1]);
    report::target(
        "PostgreSQL transactional mode: 1 statement added to the business transaction",
        format!(
            "{inside:.2} bound statements added inside it (claim, completion; the lock-timeout settings ride in the `BEGIN`'s round trip), {:.2} before it (the look-up); {added:.2} statements and {:.2} round trips in all; replay {:.2} round trip",
            added - inside,
            per(b[0], c[0]) - per(a[0], b[0]),
            per(c[0], d[0])
        ),
        inside <= 1.0,
    );
}
