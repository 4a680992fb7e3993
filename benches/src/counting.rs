//! Counting what reaches a store: a [`Store`] wrapper that counts calls, and a TCP proxy that counts
//! round trips (and, for PostgreSQL, statements and sqlx's release pings) on the wire.

use idem_runtime::clock::Timestamp;
use idem_runtime::store::{Claim, ClaimOutcome, Store, StoreError, Subscription};
use idem_runtime::{FencingToken, Record, RecordKey, StoredResponse};
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
    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        self.calls.get.fetch_add(1, Relaxed);
        self.inner.get(key, now).await
    }
    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.calls.subscribe.fetch_add(1, Relaxed);
        self.inner.subscribe(key)
    }
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.calls.announce.fetch_add(1, Relaxed);
        self.inner.announce_waiter(key).await
    }
}

/// What the proxy saw.
#[derive(Debug, Default)]
pub(crate) struct Wire {
    /// Client sends that follow a server reply (or open a connection), excluding lone PostgreSQL
    /// `Sync` messages.
    pub(crate) round_trips: AtomicU64,
    /// PostgreSQL: `Bind` and simple `Query` messages (one per statement executed).
    pub(crate) statements: AtomicU64,
    /// PostgreSQL: the `Bind` messages sent while the connection had a transaction open (after a
    /// simple query that begins one, before one that commits or rolls it back).
    pub(crate) in_transaction: AtomicU64,
    /// PostgreSQL: writes that are a lone `Sync` (sqlx pings each connection as it returns to
    /// the pool, off the request's path).
    pub(crate) pings: AtomicU64,
    /// Connections opened through the proxy.
    pub(crate) connections: AtomicU64,
}

impl Wire {
    pub(crate) fn snapshot(&self) -> [u64; 5] {
        [
            self.round_trips.load(Relaxed),
            self.statements.load(Relaxed),
            self.pings.load(Relaxed),
            self.connections.load(Relaxed),
            self.in_transaction.load(Relaxed),
        ]
    }
}

/// A TCP proxy to `upstream` on an ephemeral port; `postgres` parses the client's messages.
pub(crate) async fn proxy(upstream: SocketAddr, postgres: bool) -> (SocketAddr, Arc<Wire>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().expect("proxy addr");
    let wire = Arc::new(Wire::default());
    let w = wire.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = TcpStream::connect(upstream).await else {
                continue;
            };
            w.connections.fetch_add(1, Relaxed);
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            tokio::spawn(pipe(client, server, w.clone(), postgres));
        }
    });
    (addr, wire)
}

async fn pipe(client: TcpStream, server: TcpStream, wire: Arc<Wire>, postgres: bool) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let awaiting = Arc::new(AtomicBool::new(false));
    let a = awaiting.clone();
    let up = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut parser = PgParser::default();
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let chunk = &buf[..n];
            let lone_sync = postgres && chunk == [b'S', 0, 0, 0, 4];
            if lone_sync {
                wire.pings.fetch_add(1, Relaxed);
            } else if !a.swap(true, Relaxed) {
                wire.round_trips.fetch_add(1, Relaxed);
            }
            a.store(true, Relaxed);
            if postgres {
                let seen = parser.feed(chunk);
                wire.statements.fetch_add(seen.statements, Relaxed);
                wire.in_transaction.fetch_add(seen.in_transaction, Relaxed);
            }
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

/// Splits the client's byte stream into PostgreSQL frontend messages (the first, the startup
/// message, has no type byte; the bench connects with `sslmode=disable`, so no SSLRequest).
#[derive(Default)]
struct PgParser {
    buf: Vec<u8>,
    started: bool,
    /// Whether the connection has a transaction open. sqlx begins, commits and rolls back with
    /// simple queries (`BEGIN…`, `COMMIT`, `ROLLBACK`) and binds every other statement.
    in_transaction: bool,
}

/// Statements in one chunk of the client's stream.
#[derive(Debug, Default, PartialEq, Eq)]
struct Seen {
    statements: u64,
    in_transaction: u64,
}

/// Whether a simple query's text begins a transaction (`Some(true)`), ends one (`Some(false)`), or
/// neither (savepoints, which sqlx uses for nested transactions, change nothing).
fn transaction_control(query: &[u8]) -> Option<bool> {
    let text = String::from_utf8_lossy(query).to_ascii_uppercase();
    let mut words = text
        .split(|c: char| !c.is_ascii_alphabetic())
        .filter(|w| !w.is_empty());
    match (words.next()?, words.next()) {
        ("ROLLBACK", Some("TO")) => None,
        ("BEGIN" | "START", _) => Some(true),
        ("COMMIT" | "END" | "ROLLBACK" | "ABORT", _) => Some(false),
        _ => None,
    }
}

impl PgParser {
    fn feed(&mut self, chunk: &[u8]) -> Seen {
        self.buf.extend_from_slice(chunk);
        let mut seen = Seen::default();
        loop {
            if !self.started {
                if self.buf.len() < 4 {
                    break;
                }
                let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                if self.buf.len() < len {
                    break;
                }
                self.buf.drain(..len);
                self.started = true;
                continue;
            }
            if self.buf.len() < 5 {
                break;
            }
            let len =
                u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
            if self.buf.len() < 1 + len {
                break;
            }
            match self.buf[0] {
                b'B' => {
                    seen.statements += 1;
                    seen.in_transaction += u64::from(self.in_transaction);
                }
                b'Q' => {
                    seen.statements += 1;
                    // The query text follows the 4-byte length, NUL-terminated.
                    let query = self.buf.get(5..1 + len).unwrap_or_default();
                    if let Some(open) = transaction_control(query) {
                        self.in_transaction = open;
                    }
                }
                _ => {}
            }
            self.buf.drain(..1 + len);
        }
        seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend_from_slice(&u32::try_from(body.len() + 4).expect("small").to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    #[test]
    fn binds_between_a_begin_and_its_commit_count_as_in_the_transaction() {
        let mut parser = PgParser {
            started: true,
            ..PgParser::default()
        };
        let mut stream = message(b'B', b"outside");
        stream.extend(message(b'Q', b"BEGIN; SET LOCAL lock_timeout = 5\0"));
        stream.extend(message(b'B', b"claim"));
        stream.extend(message(b'E', b""));
        stream.extend(message(b'B', b"write"));
        stream.extend(message(b'Q', b"COMMIT\0"));
        stream.extend(message(b'B', b"after"));
        // Split mid-message, as TCP may.
        let (first, second) = stream.split_at(9);
        let mut seen = parser.feed(first);
        let rest = parser.feed(second);
        seen.statements += rest.statements;
        seen.in_transaction += rest.in_transaction;
        assert_eq!(
            seen,
            Seen {
                statements: 6,
                in_transaction: 2
            }
        );
        assert!(!parser.in_transaction);
    }

    #[test]
    fn transaction_control_reads_the_first_word() {
        assert_eq!(
            transaction_control(b"  begin isolation level serializable\0"),
            Some(true)
        );
        assert_eq!(transaction_control(b"ROLLBACK\0"), Some(false));
        assert_eq!(transaction_control(b"SELECT 1\0"), None);
        assert_eq!(
            transaction_control(b"ROLLBACK TO SAVEPOINT _sqlx_savepoint_1\0"),
            None
        );
        assert_eq!(transaction_control(b"SAVEPOINT _sqlx_savepoint_1\0"), None);
        assert_eq!(transaction_control(b"\0"), None);
    }
}
