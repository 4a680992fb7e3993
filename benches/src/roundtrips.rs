//! Store operations per request: the calls idem's engine makes to each store (claim, complete,
//! lease renewal, the rest), counted by a wrapping store, and for PostgreSQL, MySQL and Redis the
//! round trips on the wire, counted by a TCP proxy between the store and its server. New requests at 1
//! and 16 concurrent connections, with a handler that returns at once and one that takes a second.

use crate::counting::{self, Calls, CountingStore, Protocol, Wire};
use crate::floors;
use crate::stores::{self, Backend};
use idem_runtime::policy::Policy;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::Store;
use idem_runtime::{Begin, Engine, RecordKey};
use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

/// The lease of every request here: renewed every third of it, so once during a 1 s handler.
const LEASE: Duration = Duration::from_secs(2);
const POLICY: Policy = Policy::new()
    .ttl(Duration::from_secs(86_400))
    .lease(LEASE)
    .handler("bench")
    .checked();

/// (connections, handler time, requests per connection).
const CASES: [(usize, Duration, u64); 4] = [
    (1, Duration::ZERO, 200),
    (16, Duration::ZERO, 13),
    (1, Duration::from_secs(1), 4),
    (16, Duration::from_secs(1), 2),
];

fn socket(url: &str) -> Option<SocketAddr> {
    let rest = url.split_once("://")?.1;
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let host = rest.split('/').next()?;
    host.parse().ok()
}

/// A store under count, and the proxy's counters if it is reached over the network.
type Counted = (Backend, Arc<dyn Store>, Option<Arc<Wire>>);

/// Each selected store; PostgreSQL, MySQL and Redis reached through a proxy that counts round
/// trips.
async fn stores() -> Vec<Counted> {
    let mut out: Vec<Counted> = Vec::new();
    for backend in [
        Backend::Memory,
        Backend::Sqlite,
        Backend::Postgres,
        Backend::Mysql,
        Backend::Redis,
    ] {
        if !stores::selected(backend) {
            continue;
        }
        let reached = match backend {
            Backend::Memory => Ok((Arc::new(MemoryStore::new()) as Arc<dyn Store>, None)),
            Backend::Sqlite => Ok((stores::sqlite("roundtrips").await as Arc<dyn Store>, None)),
            Backend::Postgres | Backend::Mysql | Backend::Redis => {
                let (url, protocol) = match backend {
                    Backend::Postgres => (stores::postgres_base(), Protocol::Postgres),
                    Backend::Mysql => (stores::mysql_url(), Protocol::Mysql),
                    _ => (stores::redis_url(), Protocol::Redis),
                };
                match socket(&url) {
                    None => Err(format!("cannot parse the address {url}")),
                    Some(upstream) => {
                        let (addr, wire) = counting::proxy(upstream, protocol).await;
                        let store = match protocol {
                            Protocol::Postgres => stores::postgres(Some(addr))
                                .await
                                .map(|s| s as Arc<dyn Store>),
                            Protocol::Mysql => {
                                stores::mysql(Some(addr)).await.map(|s| s as Arc<dyn Store>)
                            }
                            Protocol::Redis => stores::redis(Some(addr))
                                .await
                                .map(|(s, _)| s as Arc<dyn Store>),
                        };
                        store.map(|s| (s, Some(wire)))
                    }
                }
            }
            Backend::RedisCluster => Err("not counted on a cluster".to_owned()),
        };
        match reached {
            Ok((store, wire)) => out.push((backend, store, wire)),
            Err(e) => eprintln!("round trips: skipping {}: {e}", backend.name()),
        }
    }
    out
}

/// One new request: claim, the handler (`handler` long, the lease kept alive), complete.
async fn request(engine: &Engine, scope: &str, key: String, handler: Duration) -> bool {
    match engine
        .begin(RecordKey::new(scope, key), floors::fingerprint(), &POLICY)
        .await
    {
        Ok(Begin::Execute(claim)) => {
            claim.keep_alive(tokio::time::sleep(handler)).await;
            claim.complete(&floors::response()).await.is_ok()
        }
        _ => false,
    }
}

/// `per` requests on each of `connections` concurrent tasks; the requests that succeeded.
async fn requests(
    engine: &Engine,
    scope: &str,
    connections: usize,
    per: u64,
    handler: Duration,
) -> u64 {
    let tasks: Vec<_> = (0..connections)
        .map(|w| {
            let (engine, scope) = (engine.clone(), scope.to_owned());
            tokio::spawn(async move {
                let mut ok = 0;
                for i in 0..per {
                    ok += u64::from(request(&engine, &scope, format!("{w}-{i}"), handler).await);
                }
                ok
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        ok += t.await.unwrap_or(0);
    }
    ok
}

fn snapshot(calls: &Calls) -> [u64; 4] {
    let other = calls.release.load(Relaxed)
        + calls.get.load(Relaxed)
        + calls.subscribe.load(Relaxed)
        + calls.announce.load(Relaxed);
    [
        calls.claim.load(Relaxed),
        calls.complete.load(Relaxed),
        calls.renew.load(Relaxed),
        other,
    ]
}

pub(crate) async fn run() {
    println!("## Store operations per request\n");
    println!(
        "What one new request costs each store: the calls idem's engine makes (claim, complete, \
         lease renewal, any other), and on PostgreSQL, MySQL and Redis the round trips on the wire, \
         counted by a TCP proxy (a client send that follows a server reply). The lease is {} s, renewed \
         every third of it while the handler runs, so a 1 s handler renews once. A replay is one \
         claim that finds the completed record: one call, one round trip.\n",
        LEASE.as_secs()
    );
    println!("| store | connections | handler | requests | claim | complete | renew | other | round trips |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let scope = format!("rt-{}", std::process::id());
    for (backend, store, wire) in stores().await {
        let calls = Arc::new(Calls::default());
        let engine = Engine::from_arc(Arc::new(CountingStore {
            inner: store,
            calls: calls.clone(),
        }));
        // Warm up, so that the pool has opened its connections and prepared its statements.
        requests(&engine, &format!("{scope}-warm"), 16, 4, Duration::ZERO).await;
        for (case, (connections, handler, per)) in CASES.into_iter().enumerate() {
            let settle = || tokio::time::sleep(Duration::from_millis(300));
            settle().await;
            let (a, wa) = (snapshot(&calls), wire.as_ref().map(|w| w.snapshot()));
            let scope = format!("{scope}-{case}");
            let n = requests(&engine, &scope, connections, per, handler).await;
            settle().await;
            let b = snapshot(&calls);
            let per_request = |i: usize| (b[i] - a[i]) as f64 / n.max(1) as f64;
            let round_trips = match (&wire, wa) {
                (Some(w), Some(wa)) => {
                    let r = wa.per(&w.snapshot(), n.max(1));
                    if matches!(backend, Backend::Postgres | Backend::Mysql) {
                        format!("{:.2} (+ {:.2} pool pings)", r.round_trips, r.pings)
                    } else {
                        format!("{:.2}", r.round_trips)
                    }
                }
                _ => "—".into(),
            };
            println!(
                "| {} | {connections} | {} | {n} | {:.2} | {:.2} | {:.2} | {:.2} | {round_trips} |",
                backend.name(),
                if handler.is_zero() { "0 ms" } else { "1 s" },
                per_request(0),
                per_request(1),
                per_request(2),
                per_request(3),
            );
        }
    }
    println!(
        "\nThe SQL stores' pool pings are sqlx's check of a connection as it returns to the pool, \
         after the request's statement has answered: off the request's path. At 16 connections, Redis' \
         multiplexed connection pipelines the commands of concurrent requests into shared writes, \
         so the wire sees fewer round trips than commands.\n"
    );
}
