//! Real connections cut mid-call under the PostgreSQL and Redis stores, through a TCP proxy: the
//! connection carrying one request's claim (or completion) is closed either before the command
//! reaches the server or after the server ran it, before its answer gets back. The client sees 503
//! (claim) or an unremembered 201 (completion, which the handler's task then stores on a new
//! connection), the store recovers by itself, and the handler runs as `faults.rs` predicts with an
//! injected store error: the real drivers fail the same way.
//!
//! The proxy finds the one connection to cut by a marker in what the client sends: the caller's
//! scope, which only this request's commands carry (never a keepalive or a LISTEN).

use crate::http_support::{json_post, router, send, App, Probe, Reply, PAY_1000};
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::{Engine, RecordKey, RecordState, Store};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const LEASE: Duration = Duration::from_secs(30);
/// How many times a client retries a 503 before the test gives up: a store may need one call to
/// notice that its connection is gone.
const RETRIES_OF_503: usize = 5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// Close the connection instead of forwarding the command.
    Before,
    /// Forward the command, then close the connection when the answer comes.
    After,
}

/// The marker to look for and the cut to make, until it has been made.
type Armed = Arc<Mutex<Option<(Vec<u8>, Cut)>>>;

/// A TCP proxy that cuts, once, the connection on which the client sends `marker`.
struct Proxy {
    addr: SocketAddr,
    armed: Armed,
    cuts: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let armed = Armed::default();
        let cuts = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let (armed, cuts) = (armed.clone(), cuts.clone());
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    let (armed, cuts) = (armed.clone(), cuts.clone());
                    tokio::spawn(async move {
                        if let Ok(server) = TcpStream::connect(upstream).await {
                            pump(client, server, armed, cuts).await;
                        }
                    });
                }
            }
        });
        Self {
            addr,
            armed,
            cuts,
            task,
        }
    }

    fn arm(&self, marker: &str, cut: Cut) {
        *self.armed.lock().expect("lock") = Some((marker.as_bytes().to_vec(), cut));
    }

    fn cuts(&self) -> usize {
        self.cuts.load(Ordering::SeqCst)
    }
}

async fn pump(client: TcpStream, server: TcpStream, armed: Armed, cuts: Arc<AtomicUsize>) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let doomed = AtomicBool::new(false);
    let requests = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let cut = {
                let mut armed = armed.lock().expect("lock");
                match &*armed {
                    Some((marker, cut)) if contains(&buf[..n], marker) => {
                        let cut = *cut;
                        *armed = None;
                        Some(cut)
                    }
                    _ => None,
                }
            };
            match cut {
                Some(Cut::Before) => {
                    cuts.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                Some(Cut::After) => doomed.store(true, Ordering::SeqCst),
                None => {}
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let replies = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if doomed.load(Ordering::SeqCst) {
                cuts.fetch_add(1, Ordering::SeqCst);
                return;
            }
            if client_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    // Whichever side ends, both halves of both sockets are dropped: the connection is closed.
    tokio::select! {
        _ = requests => {}
        _ = replies => {}
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Fresh,
    FreshUnremembered,
    Replay,
    Conflict409,
    Unavailable503,
}

fn seen(reply: &Reply) -> Seen {
    match (reply.status.as_u16(), reply.replayed()) {
        (201, true) => Seen::Replay,
        (201, false) if reply.headers.contains_key("idempotency-expires") => Seen::Fresh,
        (201, false) => Seen::FreshUnremembered,
        (409, _) => Seen::Conflict409,
        (503, _) => Seen::Unavailable503,
        other => panic!("unexpected reply {other:?}: {:?}", reply.body),
    }
}

struct Rig {
    clock: ManualClock,
    router: axum::Router,
    probe: Probe,
}

impl Rig {
    /// A rig over `store`, which judges time by `clock`; the clock is set back to the start, so
    /// every case (in a scope of its own) starts there.
    fn new(store: Arc<dyn Store>, clock: &ManualClock) -> Self {
        let clock = clock.clone();
        clock.set(Timestamp::from_millis(crate::http_support::START_MS));
        let engine = Engine::from_arc(store).with_store_timeout(Some(Duration::from_secs(30)));
        let probe = Probe {
            calls: Arc::new(AtomicUsize::new(0)),
            started: watch::Sender::new(0),
            open: watch::Sender::new(true),
        };
        let router = router(App {
            engine,
            probe: probe.clone(),
        });
        Self {
            clock,
            router,
            probe,
        }
    }

    async fn pay_once(&self, user: &str) -> Seen {
        seen(
            &send(
                self.router.clone(),
                json_post("/gated-no-wait", user, &["k1"], PAY_1000),
            )
            .await,
        )
    }

    /// A client that retries 503s (as `Retry-After` asks), a bounded number of times.
    async fn pay(&self, user: &str) -> Seen {
        for _ in 0..RETRIES_OF_503 {
            match self.pay_once(user).await {
                Seen::Unavailable503 => continue,
                other => return other,
            }
        }
        panic!("the store did not recover after {RETRIES_OF_503} attempts")
    }
}

async fn completed(store: &dyn Store, key: &RecordKey) -> bool {
    match store.get(key).await.expect("read the record") {
        Some(found) => matches!(found.record.state, RecordState::Completed { .. }),
        None => false,
    }
}

/// The claim's and the completion's connection cut before and after the server ran the command.
async fn cut_connections(store: Arc<dyn Store>, clock: &ManualClock, proxy: &Proxy) {
    use Seen::*;
    // (which call, cut, what the first request sees, the retry, the retry after the lease, runs)
    let cases = [
        ("claim", Cut::Before, Unavailable503, Fresh, Replay, 1),
        // The claim landed, its answer was cut: the engine releases it, so the retry runs at once.
        ("claim", Cut::After, Unavailable503, Fresh, Replay, 1),
        (
            "complete",
            Cut::Before,
            FreshUnremembered,
            Replay,
            Replay,
            1,
        ),
        ("complete", Cut::After, FreshUnremembered, Replay, Replay, 1),
    ];
    for (call, cut, first, retry, after_lease, runs) in cases {
        let rig = Rig::new(store.clone(), clock);
        let user = format!("u-{}", uuid::Uuid::new_v4().simple());
        let cuts = proxy.cuts();
        let got_first = match call {
            "claim" => {
                proxy.arm(&user, cut);
                rig.pay_once(&user).await
            }
            _ => {
                // The completion is the second command carrying the scope: let the claim through
                // by arming while the handler runs, once the claim has been answered.
                rig.probe.open.send_replace(false);
                let router = rig.router.clone();
                let u = user.clone();
                let request = tokio::spawn(async move {
                    seen(&send(router, json_post("/gated-no-wait", &u, &["k1"], PAY_1000)).await)
                });
                rig.probe.wait_started(1).await;
                // Wait for the record as a duplicate does (subscribe, announce, read again), so
                // that whichever attempt of the completion lands, its notification reaches us.
                let key = RecordKey::new(user.as_str(), "k1");
                let mut stored = store.subscribe(&key);
                store.announce_waiter(&key).await.expect("announce");
                proxy.arm(&user, cut);
                rig.probe.open.send_replace(true);
                let first = request.await.expect("join");
                // The client has its answer; the handler's task keeps storing it until it lands.
                while !completed(&*store, &key).await {
                    stored.changed().await;
                }
                first
            }
        };
        assert_eq!(
            proxy.cuts(),
            cuts + 1,
            "{call} {cut:?}: one connection was cut"
        );
        let got_retry = rig.pay(&user).await;
        rig.clock.advance(LEASE);
        let got_after = rig.pay(&user).await;
        assert_eq!(
            (got_first, got_retry, got_after, rig.probe.calls()),
            (first, retry, after_lease, runs),
            "{call} cut {cut:?}"
        );
    }
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connections_cut_mid_claim_and_mid_complete() {
    let db = crate::proof_support::postgres().await;
    let options = db.options();
    let upstream = tokio::net::lookup_host((options.get_host(), options.get_port()))
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let pool = PostgresStore::pool_options()
        .max_connections(4)
        .connect_with(options.host("127.0.0.1").port(proxy.addr.port()))
        .await
        .expect("connect through the proxy");
    let clock = ManualClock::new(Timestamp::from_millis(crate::http_support::START_MS));
    let store = PostgresStore::from_pool(pool).await.expect("migrate");
    cut_connections(Arc::new(store.with_clock(clock.clone())), &clock, &proxy).await;
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_connections_cut_mid_claim_and_mid_complete() {
    let backend = crate::proof_support::redis().await;
    let client = redis::Client::open(backend.url()).expect("redis url");
    let target = match &client.get_connection_info().addr {
        redis::ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
        other => panic!("the proxy needs a TCP redis url, got {other:?}"),
    };
    let upstream = tokio::net::lookup_host(target)
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    let clock = ManualClock::new(Timestamp::from_millis(crate::http_support::START_MS));
    let store = RedisStore::builder(format!("redis://{}", proxy.addr))
        .prefix(backend.prefix())
        .clock(clock.clone())
        .connect()
        .await
        .expect("connect through the proxy");
    cut_connections(Arc::new(store), &clock, &proxy).await;
}
