//! Counting what reaches a store: a [`Store`] wrapper that counts calls, and a TCP proxy that counts
//! round trips (and, for PostgreSQL, sqlx's release pings) on the wire.

use idem_runtime::store::{Claim, ClaimOutcome, Found, Store, StoreError, Subscription};
use idem_runtime::{FencingToken, RecordKey, StoredResponse};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Store calls, by operation.
#[derive(Debug, Default)]
pub(crate) struct Calls {
    pub(crate) claim: AtomicU64,
    pub(crate) complete: AtomicU64,
    pub(crate) release: AtomicU64,
    pub(crate) renew: AtomicU64,
    pub(crate) get: AtomicU64,
    pub(crate) subscribe: AtomicU64,
    pub(crate) announce: AtomicU64,
}

/// A store that counts every call before passing it on.
pub(crate) struct CountingStore {
    pub(crate) inner: Arc<dyn Store>,
    pub(crate) calls: Arc<Calls>,
}

#[async_trait::async_trait]
impl Store for CountingStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.calls.claim.fetch_add(1, Relaxed);
        self.inner.claim(claim).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        self.calls.complete.fetch_add(1, Relaxed);
        self.inner.complete(key, token, response).await
    }
    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.calls.release.fetch_add(1, Relaxed);
        self.inner.release(key, token).await
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: std::time::Duration,
    ) -> Result<(), StoreError> {
        self.calls.renew.fetch_add(1, Relaxed);
        self.inner.renew(key, token, lease).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        self.calls.get.fetch_add(1, Relaxed);
        self.inner.get(key).await
    }
    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.calls.subscribe.fetch_add(1, Relaxed);
        self.inner.subscribe(key)
    }
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.calls.announce.fetch_add(1, Relaxed);
        self.inner.announce_waiter(key).await
    }
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

/// What the proxy saw.
#[derive(Debug, Default)]
pub(crate) struct Wire {
    /// Client sends that follow a server reply (or open a connection), excluding pool pings.
    round_trips: AtomicU64,
    /// PostgreSQL and MySQL: writes that are a pool ping ([`Protocol::is_ping`]: sqlx pings each
    /// connection as it returns to the pool, off the request's path).
    pings: AtomicU64,
}

/// The proxy's counters at one moment ([`Wire::snapshot`]), or their growth per request
/// ([`Counts::per`], in `f64`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counts<T = u64> {
    pub(crate) round_trips: T,
    pub(crate) pings: T,
}

/// [`Counts`] per request.
pub(crate) type Rates = Counts<f64>;

impl Counts {
    /// Each counter's growth from `self` to `later`, per request over `n` requests.
    pub(crate) fn per(&self, later: &Counts, n: u64) -> Rates {
        let per = |x: u64, y: u64| (y - x) as f64 / n as f64;
        Counts {
            round_trips: per(self.round_trips, later.round_trips),
            pings: per(self.pings, later.pings),
        }
    }
}

impl Wire {
    pub(crate) fn snapshot(&self) -> Counts {
        Counts {
            round_trips: self.round_trips.load(Relaxed),
            pings: self.pings.load(Relaxed),
        }
    }
}

/// What the proxy carries: it tells the pool's pings apart from requests on the SQL protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Postgres,
    Mysql,
    Redis,
}

impl Protocol {
    /// Whether a client's write is one of sqlx's pings of a connection as it returns to the pool: a
    /// lone `Sync` on PostgreSQL, a lone `COM_PING` packet on MySQL.
    fn is_ping(self, chunk: &[u8]) -> bool {
        match self {
            Protocol::Postgres => chunk == [b'S', 0, 0, 0, 4],
            Protocol::Mysql => chunk == [1, 0, 0, 0, 0x0e],
            Protocol::Redis => false,
        }
    }
}

/// A TCP proxy to `upstream` on an ephemeral port, counting round trips and pool pings.
pub(crate) async fn proxy(upstream: SocketAddr, protocol: Protocol) -> (SocketAddr, Arc<Wire>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().expect("proxy addr");
    let wire = Arc::new(Wire::default());
    let w = wire.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                continue;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            tokio::spawn(pipe(client, server, w.clone(), protocol));
        }
    });
    (addr, wire)
}

async fn pipe(client: TcpStream, server: TcpStream, wire: Arc<Wire>, protocol: Protocol) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let awaiting = Arc::new(AtomicBool::new(false));
    let a = awaiting.clone();
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            if protocol.is_ping(chunk) {
                wire.pings.fetch_add(1, Relaxed);
            } else if !a.swap(true, Relaxed) {
                wire.round_trips.fetch_add(1, Relaxed);
            }
            a.store(true, Relaxed);
            if sw.write_all(chunk).await.is_err() {
                break;
            }
        }
    };
    let down = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match sr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            awaiting.store(false, Relaxed);
            if cw.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
    };
    tokio::join!(up, down);
}
