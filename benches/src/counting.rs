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
        lease_until: Timestamp,
    ) -> Result<(), StoreError> {
        self.calls.renew.fetch_add(1, Relaxed);
        self.inner.renew(key, token, lease_until).await
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
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
}

/// What the proxy saw.
#[derive(Debug, Default)]
pub(crate) struct Wire {
    /// Client sends that follow a server reply (or open a connection), excluding lone PostgreSQL
    /// `Sync` messages.
    round_trips: AtomicU64,
    /// PostgreSQL: those of the round trips sent while the connection had a transaction open, or
    /// that opened one (from the message that opens it to the one that commits it, both counted).
    round_trips_in_transaction: AtomicU64,
    /// PostgreSQL: SQL statements, one per `Bind` and one per statement of a simple `Query`.
    statements: AtomicU64,
    /// PostgreSQL: the statements that ran inside a transaction, but for the `BEGIN` and `COMMIT`
    /// themselves (see [`PgParser::feed`]).
    in_transaction: AtomicU64,
    /// PostgreSQL: of those, the bound statements (the ones that cost a round trip of their own
    /// when sent alone, as sqlx sends each).
    binds_in_transaction: AtomicU64,
    /// PostgreSQL: writes that are a lone `Sync` (sqlx pings each connection as it returns to
    /// the pool, off the request's path).
    pings: AtomicU64,
    /// Connections opened through the proxy.
    connections: AtomicU64,
}

/// The proxy's counters at one moment ([`Wire::snapshot`]), or their growth per request
/// ([`Counts::per`], in `f64`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Counts<T = u64> {
    pub(crate) round_trips: T,
    pub(crate) round_trips_in_transaction: T,
    pub(crate) statements: T,
    pub(crate) in_transaction: T,
    pub(crate) binds_in_transaction: T,
    pub(crate) pings: T,
    pub(crate) connections: T,
}

/// [`Counts`] per request.
pub(crate) type Rates = Counts<f64>;

impl Counts {
    /// Each counter's growth from `self` to `later`, per request over `n` requests.
    pub(crate) fn per(&self, later: &Counts, n: u64) -> Rates {
        let per = |x: u64, y: u64| (y - x) as f64 / n as f64;
        Counts {
            round_trips: per(self.round_trips, later.round_trips),
            round_trips_in_transaction: per(
                self.round_trips_in_transaction,
                later.round_trips_in_transaction,
            ),
            statements: per(self.statements, later.statements),
            in_transaction: per(self.in_transaction, later.in_transaction),
            binds_in_transaction: per(self.binds_in_transaction, later.binds_in_transaction),
            pings: per(self.pings, later.pings),
            connections: per(self.connections, later.connections),
        }
    }
}

impl Wire {
    pub(crate) fn snapshot(&self) -> Counts {
        Counts {
            round_trips: self.round_trips.load(Relaxed),
            round_trips_in_transaction: self.round_trips_in_transaction.load(Relaxed),
            statements: self.statements.load(Relaxed),
            in_transaction: self.in_transaction.load(Relaxed),
            binds_in_transaction: self.binds_in_transaction.load(Relaxed),
            pings: self.pings.load(Relaxed),
            connections: self.connections.load(Relaxed),
        }
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
            let was_in_transaction = parser.in_transaction;
            if postgres {
                let seen = parser.feed(chunk);
                wire.statements.fetch_add(seen.statements, Relaxed);
                wire.in_transaction.fetch_add(seen.in_transaction, Relaxed);
                wire.binds_in_transaction
                    .fetch_add(seen.binds_in_transaction, Relaxed);
            }
            if lone_sync {
                wire.pings.fetch_add(1, Relaxed);
            } else if !a.swap(true, Relaxed) {
                wire.round_trips.fetch_add(1, Relaxed);
                if was_in_transaction || parser.in_transaction {
                    wire.round_trips_in_transaction.fetch_add(1, Relaxed);
                }
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

/// Splits the client's byte stream into PostgreSQL frontend messages (the first, the startup
/// message, has no type byte; the bench connects with `sslmode=disable`, so no SSLRequest).
#[derive(Default)]
struct PgParser {
    buf: Vec<u8>,
    started: bool,
    /// Whether the connection has a transaction open. sqlx begins, commits and rolls back with
    /// simple queries (`BEGIN…`, `COMMIT`, `ROLLBACK`) and binds every other statement. Read off
    /// the client's messages alone: a query the server fails (a `BEGIN` that never ran) counts as
    /// if it had run; no path the bench counts sends one.
    in_transaction: bool,
}

/// Statements in one chunk of the client's stream.
#[derive(Debug, Default, PartialEq, Eq)]
struct Seen {
    statements: u64,
    in_transaction: u64,
    binds_in_transaction: u64,
}

/// What one statement of a simple query does to the connection's transaction: begins one
/// (`Some(true)`), ends one (`Some(false)`), or neither (savepoints, which sqlx uses for nested
/// transactions, change nothing).
fn transaction_control(statement: &str) -> Option<bool> {
    let text = statement.to_ascii_uppercase();
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

/// A simple query's statements and their part in the connection's transaction.
#[derive(Debug, Default, PartialEq, Eq)]
struct SimpleQuery {
    statements: u64,
    /// The statements that run inside a transaction, but for the `BEGIN` and the `COMMIT`.
    in_transaction: u64,
    /// Whether a transaction is open after it.
    open_after: bool,
}

/// Reads a simple query's text (NUL-terminated) as statements separated by `;`, which is exact for
/// what idem and this bench send (no `;` inside a literal). Statements before a `BEGIN` in the same
/// query run in the implicit transaction that the `BEGIN` turns into the open one, so they count as
/// inside it, as do those after it.
fn simple_query(text: &[u8], open_before: bool) -> SimpleQuery {
    let text = String::from_utf8_lossy(text);
    let statements: Vec<&str> = text
        .trim_end_matches('\0')
        .split(';')
        .filter(|s| !s.trim().is_empty())
        .collect();
    let controls: Vec<Option<bool>> = statements.iter().map(|s| transaction_control(s)).collect();
    let opens = controls.contains(&Some(true));
    let mut open = open_before;
    let mut seen = SimpleQuery {
        statements: statements.len() as u64,
        ..SimpleQuery::default()
    };
    for control in controls {
        match control {
            Some(now_open) => open = now_open,
            None if open || opens => seen.in_transaction += 1,
            None => {}
        }
    }
    seen.open_after = open;
    seen
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
                    seen.binds_in_transaction += u64::from(self.in_transaction);
                }
                b'Q' => {
                    // The query text follows the 4-byte length, NUL-terminated.
                    let text = self.buf.get(5..1 + len).unwrap_or_default();
                    let query = simple_query(text, self.in_transaction);
                    seen.statements += query.statements;
                    seen.in_transaction += query.in_transaction;
                    self.in_transaction = query.open_after;
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
    fn statements_between_a_begin_and_its_commit_count_as_in_the_transaction() {
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
        seen.binds_in_transaction += rest.binds_in_transaction;
        assert_eq!(
            seen,
            Seen {
                statements: 7,
                in_transaction: 3,
                binds_in_transaction: 2
            }
        );
        assert!(!parser.in_transaction);
    }

    #[test]
    fn transaction_control_reads_the_first_word() {
        assert_eq!(
            transaction_control("  begin isolation level serializable"),
            Some(true)
        );
        assert_eq!(transaction_control("ROLLBACK"), Some(false));
        assert_eq!(transaction_control("SELECT 1"), None);
        assert_eq!(
            transaction_control("ROLLBACK TO SAVEPOINT _sqlx_savepoint_1"),
            None
        );
        assert_eq!(transaction_control("SAVEPOINT _sqlx_savepoint_1"), None);
        assert_eq!(transaction_control(""), None);
    }

    #[test]
    fn a_begin_at_the_end_opens_the_transaction_its_query_ran_in() {
        let opening = simple_query(b"SELECT set_config('a', 'b', true); SET LOCAL x = 1; INSERT INTO t VALUES (1); BEGIN\0", false);
        assert_eq!(
            opening,
            SimpleQuery {
                statements: 4,
                in_transaction: 3,
                open_after: true
            }
        );
        let commit = simple_query(b"COMMIT\0", true);
        assert_eq!(
            commit,
            SimpleQuery {
                statements: 1,
                in_transaction: 0,
                open_after: false
            }
        );
        let outside = simple_query(b"SELECT 1; SELECT 2\0", false);
        assert_eq!(outside.in_transaction, 0);
        assert!(!outside.open_after);
    }
}
