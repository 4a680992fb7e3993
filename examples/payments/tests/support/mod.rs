//! Runs the real `payments` binary as child processes and talks to them over HTTP.
//!
//! Each [`Instance`] starts with `PORT=0` and is ready once it prints its
//! `payments listening on http://...` line; it is killed when dropped, also when the test panics
//! (then its log, kept in a temporary file, is printed to help read the failure). A test can also
//! kill it (`SIGKILL`) or stop it (`SIGTERM`) itself, and start another on the same stores.
//!
//! Waits are on observable state (a charge the card network recorded, a process that exited, a
//! reply), polled with a bound only to fail instead of hanging.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::io::{BufRead, BufReader, Read, Seek};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

/// Bounds start-up, only to fail instead of hanging: an instance is ready as soon as it says so.
const START_BOUND: Duration = Duration::from_secs(120);

/// `{"amount": 1000, "currency": "KRW"}`.
pub(crate) const KRW_1000: &str = r#"{"amount": 1000, "currency": "KRW"}"#;

/// A running `payments` process.
pub(crate) struct Instance {
    child: Child,
    base: String,
    log: std::fs::File,
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- log of the instance at {} ---", self.base);
            eprintln!("{}", read_log(&mut self.log));
        }
    }
}

fn read_log(log: &mut std::fs::File) -> String {
    let mut text = String::new();
    let _ = log.rewind();
    let _ = log.read_to_string(&mut text);
    text
}

impl Instance {
    /// Starts one instance with `env` (on top of `PORT=0`; `DATABASE_URL`, `IDEM_STORE_URL` and
    /// `PAYMENT_LATENCY_MS` are unset unless given) and waits until it accepts connections.
    pub(crate) fn start(env: &[(&str, &str)]) -> Self {
        Self::start_all(&[env]).pop().expect("one instance")
    }

    /// Starts one instance per entry of `envs`, all at once (so they migrate concurrently), and
    /// waits until each accepts connections.
    pub(crate) fn start_all(envs: &[&[(&str, &str)]]) -> Vec<Self> {
        let spawned: Vec<_> = envs.iter().map(|env| spawn(env)).collect();
        spawned
            .into_iter()
            .map(|(child, log, ready)| {
                let mut instance = Self {
                    child,
                    base: String::new(),
                    log,
                };
                match ready.recv_timeout(START_BOUND) {
                    Ok(Ok(base)) => instance.base = base,
                    Ok(Err(line)) => panic!(
                        "payments did not start: {line:?}\n{}",
                        read_log(&mut instance.log)
                    ),
                    Err(_) => panic!(
                        "payments did not start within {START_BOUND:?}\n{}",
                        read_log(&mut instance.log)
                    ),
                }
                instance
            })
            .collect()
    }

    /// `http://127.0.0.1:<port>`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The log so far.
    pub(crate) fn log(&mut self) -> String {
        read_log(&mut self.log)
    }

    /// Kills the process with `SIGKILL` (a crash: nothing runs after it) and reaps it.
    pub(crate) fn kill(&mut self) {
        self.child.kill().expect("kill the payments process");
        self.child.wait().expect("reap the payments process");
    }

    /// Sends `SIGTERM`, what a deploy sends to stop a process.
    pub(crate) fn terminate(&self) {
        let sent = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM failed: {sent}");
    }

    /// Waits for the process to exit, at most `bound`, and returns how it exited.
    pub(crate) async fn exit_status(&mut self, bound: Duration) -> ExitStatus {
        let child = &mut self.child;
        until("the payments process to exit", bound, || {
            let exited = child.try_wait().expect("poll the payments process");
            async move { exited }
        })
        .await
    }
}

type Ready = mpsc::Receiver<Result<String, String>>;

fn spawn(env: &[(&str, &str)]) -> (Child, std::fs::File, Ready) {
    let log = tempfile::tempfile().expect("log file");
    let mut command = Command::new(env!("CARGO_BIN_EXE_payments"));
    command
        .env_remove("DATABASE_URL")
        .env_remove("IDEM_STORE_URL")
        .env_remove("PAYMENT_LATENCY_MS")
        .env_remove("HEADER_TIMEOUT_MS")
        .env_remove("MAX_CONNECTIONS")
        .env_remove("SHUTDOWN_GRACE_MS")
        .env("PORT", "0")
        .env("RUST_LOG", "info,idem=debug")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log.try_clone().expect("log file"));
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("spawn the payments binary");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, ready) = mpsc::channel();
    // The first stdout line is the address; the thread then keeps the pipe open (and drained)
    // until the process exits.
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let _ = tx.send(
            first
                .strip_prefix("payments listening on ")
                .map(str::to_owned)
                .ok_or(first),
        );
        for _ in lines {}
    });
    (child, log, ready)
}

/// An HTTP reply, read to the end.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }

    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotency-replayed") == Some("true")
    }
}

/// One client for a test; no retries of its own. It drops idle connections before the server
/// closes them (`HEADER_TIMEOUT_MS`, 10 s by default), so that no request is sent on a connection
/// the server is closing at that moment.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_idle_timeout(Duration::from_secs(5))
        .build()
        .expect("client")
}

/// `POST /payments` to `instance` as `user` with `key` and `body`.
pub(crate) async fn create(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    key: &str,
    body: &str,
) -> Reply {
    try_create(client, instance.base(), user, key, body)
        .await
        .expect("POST /payments")
}

/// `POST /payments` to the instance at `base`; an error if no complete reply came back (the
/// process was killed under it, say).
pub(crate) async fn try_create(
    client: &reqwest::Client,
    base: &str,
    user: &str,
    key: &str,
    body: &str,
) -> Result<Reply, reqwest::Error> {
    let response = client
        .post(format!("{base}/payments"))
        .bearer_auth(user)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.text().await?;
    Ok(Reply {
        status,
        headers,
        body,
    })
}

/// Sends `POST /payments` on a connection of its own and returns the connection without reading
/// anything: dropping it hangs up (with a reset, as a client that crashed or timed out).
pub(crate) async fn send_without_reading(
    instance: &Instance,
    user: &str,
    key: &str,
    body: &str,
) -> tokio::net::TcpStream {
    let addr = instance.base().trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "POST /payments HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {user}\r\n\
         Idempotency-Key: {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    stream.set_zero_linger().expect("SO_LINGER");
    stream
}

/// `GET path` on `instance` as `user`.
pub(crate) async fn get(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    path: &str,
) -> Reply {
    let response = client
        .get(format!("{}{path}", instance.base()))
        .bearer_auth(user)
        .send()
        .await
        .expect("GET");
    read(response).await
}

/// `user`'s payments according to `instance` (`GET /payments`).
pub(crate) async fn payments(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
) -> Vec<serde_json::Value> {
    let reply = get(client, instance, user, "/payments").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json().as_array().expect("an array").clone()
}

/// `user`'s charges at the card network according to `instance` (`GET /charges`).
pub(crate) async fn charges(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
) -> Vec<serde_json::Value> {
    let reply = get(client, instance, user, "/charges").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json().as_array().expect("an array").clone()
}

/// Polls `probe` until it returns a value, at most `bound` (only to fail instead of hanging).
pub(crate) async fn until<T, F, Fut>(what: &str, bound: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + bound;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "waited {bound:?} for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Waits until the card network has recorded `count` charges for `user`: the requests are then in
/// their handlers, inside the network's latency.
pub(crate) async fn until_charged(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    count: usize,
) {
    until(
        &format!("{count} charges"),
        Duration::from_secs(60),
        || async { (charges(client, instance, user).await.len() >= count).then_some(()) },
    )
    .await;
}

/// The body of payment number `i` of a test: each has its own amount, so that charges and
/// payments can be told apart by amount.
pub(crate) fn body(i: usize) -> String {
    format!(r#"{{"amount": {}, "currency": "KRW"}}"#, amount(i))
}

/// The amount of payment number `i`.
pub(crate) fn amount(i: usize) -> i64 {
    1000 + i64::try_from(i).expect("a small index")
}

/// The key of payment number `i`.
pub(crate) fn key(i: usize) -> String {
    format!("order-{i}")
}

/// Sends payment `i` (key `key(i)`, body `body(i)`) until it is replayed: the key is settled. Other
/// replies on the way are the original's 201 run by this retry (its claim was lost or its lease
/// ran out), 409 (still in progress) or 503 (a store or database not back yet); anything else
/// fails. Returns every reply, the replay last.
pub(crate) async fn until_replayed(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    i: usize,
) -> Vec<Reply> {
    let mut replies = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let reply = create(client, instance, user, &key(i), &body(i)).await;
        assert!(
            matches!(reply.status, 201 | 409 | 503),
            "{}: {reply:?}",
            key(i)
        );
        let settled = reply.status == 201 && reply.replayed();
        let retry_later = matches!(reply.status, 409 | 503);
        replies.push(reply);
        if settled {
            return replies;
        }
        assert!(
            Instant::now() < deadline,
            "{} not settled: {replies:?}",
            key(i)
        );
        if retry_later {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Settles payments `keys` concurrently ([`until_replayed`]); returns each one's replies.
pub(crate) async fn settle_all(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    keys: std::ops::Range<usize>,
) -> Vec<Vec<Reply>> {
    futures_util::future::join_all(keys.map(|i| until_replayed(client, instance, user, i))).await
}

/// What the service did for `user`, by amount: the attempts of each charge the card network made,
/// and how many payments the ledger holds.
#[derive(Debug)]
pub(crate) struct Effects {
    pub(crate) charges: BTreeMap<i64, Vec<i64>>,
    pub(crate) payments: BTreeMap<i64, Vec<serde_json::Value>>,
}

impl Effects {
    pub(crate) async fn of(client: &reqwest::Client, instance: &Instance, user: &str) -> Self {
        let mut effects = Self {
            charges: BTreeMap::new(),
            payments: BTreeMap::new(),
        };
        for charge in charges(client, instance, user).await {
            let amount = charge["amount"].as_i64().expect("amount");
            let attempts = charge["attempts"].as_i64().expect("attempts");
            effects.charges.entry(amount).or_default().push(attempts);
        }
        for payment in payments(client, instance, user).await {
            let amount = payment["amount"].as_i64().expect("amount");
            effects.payments.entry(amount).or_default().push(payment);
        }
        effects
    }

    /// Asserts that payments `0..n` were each charged once and recorded once, and nothing else
    /// happened; returns how many times the network was called for each (its attempts).
    #[track_caller]
    pub(crate) fn assert_each_once(&self, n: usize) -> Vec<i64> {
        let amounts: Vec<i64> = (0..n).map(amount).collect();
        let charged: Vec<i64> = self.charges.keys().copied().collect();
        let paid: Vec<i64> = self.payments.keys().copied().collect();
        assert_eq!(charged, amounts, "a charge for every payment, and no other");
        assert_eq!(paid, amounts, "a payment for every key, and no other");
        for (amount, charges) in &self.charges {
            assert_eq!(charges.len(), 1, "one charge of {amount}: {self:?}");
        }
        for (amount, payments) in &self.payments {
            assert_eq!(payments.len(), 1, "one payment of {amount}: {self:?}");
        }
        self.charges.values().map(|c| c[0]).collect()
    }

    /// The payment of payment number `i`.
    pub(crate) fn payment(&self, i: usize) -> &serde_json::Value {
        &self.payments[&amount(i)][0]
    }
}

/// How many of `attempts` are 1, 2, ...: for the test's output.
pub(crate) fn histogram(attempts: &[i64]) -> BTreeMap<i64, usize> {
    let mut counts = BTreeMap::new();
    for a in attempts {
        *counts.entry(*a).or_default() += 1;
    }
    counts
}

/// A Redis server of the test's own (`redis-server` on `PATH`), on a free port, without
/// persistence: killing it loses every key, and [`restart`](Self::restart) brings it back empty on
/// the same port. Killed when dropped.
pub(crate) struct RedisServer {
    port: u16,
    child: Option<Child>,
}

impl RedisServer {
    pub(crate) async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let mut server = Self { port, child: None };
        server.restart().await;
        server
    }

    /// `redis://127.0.0.1:<port>`.
    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// How many keys the server holds under `prefix`.
    pub(crate) async fn count_keys(&self, prefix: &str) -> usize {
        let client = idem_runtime::redis::Client::open(self.url()).expect("redis url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to redis-server");
        let keys: Vec<String> = idem_runtime::redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        keys.len()
    }

    /// Kills the server with `SIGKILL`: its data is gone.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("kill redis-server");
            child.wait().expect("reap redis-server");
        }
    }

    /// Starts the server (again, empty) on its port and waits until it answers `PING`.
    pub(crate) async fn restart(&mut self) {
        self.kill();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (it must be on PATH)");
        self.child = Some(child);
        let client = idem_runtime::redis::Client::open(self.url()).expect("redis url");
        until(
            "redis-server to answer",
            Duration::from_secs(30),
            || async {
                let mut conn = client.get_multiplexed_async_connection().await.ok()?;
                idem_runtime::redis::cmd("PING")
                    .query_async::<()>(&mut conn)
                    .await
                    .ok()
            },
        )
        .await;
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

async fn read(response: reqwest::Response) -> Reply {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.text().await.expect("body");
    Reply {
        status,
        headers,
        body,
    }
}

/// A fresh user id, so that tests sharing a store never see each other's payments.
pub(crate) fn fresh_user() -> String {
    format!("user-{}", uuid::Uuid::new_v4().simple())
}

/// `IDEM_STORE_URL` for the Redis server at `url`, keys under `prefix`.
pub(crate) fn redis_store_url(url: &str, prefix: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}prefix={prefix}")
}

/// `DATABASE_URL` for a SQLite ledger (and, by default, records) in `dir`.
pub(crate) fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}/payments.db?mode=rwc", dir.path().display())
}

/// Where a test's instances keep the ledger and the idempotency records: one of the store modes the
/// example runs in. The database, directory or key prefix is the test's own, removed when dropped.
pub(crate) struct Stores {
    env: Vec<(&'static str, String)>,
    _dir: tempfile::TempDir,
    _db: Option<idem_tests::services::TestDb>,
    _mysql: Option<idem_tests::services::MySqlTestDb>,
    _redis: Option<idem_tests::services::RedisPrefix>,
    _cluster: Option<idem_tests::services::RedisClusterPrefix>,
}

impl Stores {
    /// The default: ledger and records in one SQLite file (`POST /payments` transactional).
    pub(crate) async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        Self::new(vec![("DATABASE_URL", sqlite_url(&dir))], dir)
    }

    /// Ledger and records in one PostgreSQL database (`POST /payments` transactional).
    pub(crate) async fn postgres() -> Self {
        let db = idem_tests::services::TestDb::create().await;
        let mut stores = Self::new(vec![("DATABASE_URL", db.url())], tempdir());
        stores._db = Some(db);
        stores
    }

    /// Ledger and records in one MySQL/MariaDB database (`POST /payments` transactional).
    pub(crate) async fn mysql() -> Self {
        let db = idem_tests::services::MySqlTestDb::create().await;
        let mut stores = Self::new(vec![("DATABASE_URL", db.url())], tempdir());
        stores._mysql = Some(db);
        stores
    }

    /// Ledger in SQLite, records in Redis (the shared server) under a fresh prefix.
    pub(crate) async fn redis_records() -> Self {
        let redis = idem_tests::services::RedisPrefix::create().await;
        let dir = tempdir();
        let env = vec![
            ("DATABASE_URL", sqlite_url(&dir)),
            (
                "IDEM_STORE_URL",
                redis_store_url(redis.url(), redis.prefix()),
            ),
        ];
        let mut stores = Self::new(env, dir);
        stores._redis = Some(redis);
        stores
    }

    /// Ledger in PostgreSQL, records in the same database through a store of their own
    /// (`IDEM_STORE_URL`): the records mode, not transactional.
    pub(crate) async fn postgres_records() -> Self {
        let db = idem_tests::services::TestDb::create().await;
        let env = vec![("DATABASE_URL", db.url()), ("IDEM_STORE_URL", db.url())];
        let mut stores = Self::new(env, tempdir());
        stores._db = Some(db);
        stores
    }

    /// Ledger in SQLite, records on the Redis Cluster under a fresh prefix.
    pub(crate) async fn redis_cluster_records() -> Self {
        let cluster = idem_tests::services::RedisClusterPrefix::create().await;
        let dir = tempdir();
        let env = vec![
            ("DATABASE_URL", sqlite_url(&dir)),
            (
                "IDEM_STORE_URL",
                redis_store_url(cluster.url(), cluster.prefix()),
            ),
        ];
        let mut stores = Self::new(env, dir);
        stores._cluster = Some(cluster);
        stores
    }

    /// Ledger in SQLite, records in the process's memory (forgotten when it stops).
    pub(crate) async fn memory() -> Self {
        let dir = tempdir();
        let env = vec![
            ("DATABASE_URL", sqlite_url(&dir)),
            ("IDEM_STORE_URL", "memory".to_owned()),
        ];
        Self::new(env, dir)
    }

    fn new(env: Vec<(&'static str, String)>, dir: tempfile::TempDir) -> Self {
        Self {
            env,
            _dir: dir,
            _db: None,
            _mysql: None,
            _redis: None,
            _cluster: None,
        }
    }

    /// The value these stores give the instances for `name` (`DATABASE_URL`, say).
    pub(crate) fn var(&self, name: &str) -> Option<&str> {
        self.env
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, value)| value.as_str())
    }

    /// Starts an instance on these stores, with `extra` variables besides.
    pub(crate) fn start(&self, extra: &[(&str, &str)]) -> Instance {
        Instance::start(&self.env(extra))
    }

    /// Starts `count` instances on these stores at once.
    pub(crate) fn start_many(&self, count: usize, extra: &[(&str, &str)]) -> Vec<Instance> {
        let env = self.env(extra);
        Instance::start_all(&vec![env.as_slice(); count])
    }

    fn env<'a>(&'a self, extra: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str)> {
        let own = self.env.iter().map(|(name, value)| (*name, value.as_str()));
        own.chain(extra.iter().copied()).collect()
    }
}

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}
