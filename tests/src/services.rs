//! Where the shared services are, and what a test does when one is not there.
//!
//! Tests read `IDEM_TEST_POSTGRES_URL`, `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL` and
//! `IDEM_TEST_AMQP_URL` (RabbitMQ), defaulting to the local services
//! the development and CI machines run. The Redis Cluster is `IDEM_TEST_REDIS_CLUSTER_URL` if set;
//! otherwise each test binary starts one of its own from the same `redis-server`, on free ports, and
//! stops it when it exits (see [`crate::local_cluster`]). A test whose service is unreachable (or
//! whose cluster cannot be started) fails, saying how to start it. To run without a service, name it in `IDEM_TEST_SKIP`
//! (`postgres`, `mysql`, `redis`, `redis-cluster`, `amqp`): the
//! tests that need it are then ignored, with the reason, and counted as such in `cargo test`'s
//! summary (see `tests/build.rs`); under `CI=true` nothing is skipped.
//!
//! [`TestDb`], [`MySqlTestDb`], [`RedisPrefix`] and [`RedisClusterPrefix`] give a test a database or a key prefix of
//! its own, removed when the test ends.

use idem_runtime::redis;
use idem_runtime::sqlx::mysql::MySqlConnectOptions;
use idem_runtime::sqlx::postgres::PgConnectOptions;
use idem_runtime::sqlx::{self, ConnectOptions};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The PostgreSQL server URL for tests (a database name is appended per test run).
pub fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// The MySQL or MariaDB server URL for tests (a database of its own is created per test).
pub fn mysql_url() -> String {
    std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// The Redis URL for tests.
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// The RabbitMQ (AMQP 0-9-1) URL for tests, with its vhost (`%2f`: `/`).
pub fn amqp_url() -> String {
    std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// [`amqp_url`], once its broker accepts connections: fails the test, saying how to start the
/// broker, if it does not (a TCP connection to its host and port; the test's own AMQP client
/// reports anything past that).
pub async fn amqp_broker() -> String {
    let url = amqp_url();
    let Some(address) = amqp_address(&url) else {
        AMQP.unreachable(&url, &"not an amqp://user:password@host:port/vhost URL");
    };
    let connect = tokio::net::TcpStream::connect(address.as_str());
    match tokio::time::timeout(Duration::from_secs(5), connect).await {
        Ok(Ok(_)) => url,
        Ok(Err(e)) => AMQP.unreachable(&url, &e),
        Err(_) => AMQP.unreachable(&url, &"no answer within 5 s"),
    }
}

/// The `host:port` of an `amqp://` or `amqps://` URL (ports 5672 and 5671 by default).
fn amqp_address(url: &str) -> Option<String> {
    let (rest, default_port) = match url.split_once("://")? {
        ("amqp", rest) => (rest, 5672),
        ("amqps", rest) => (rest, 5671),
        _ => return None,
    };
    let authority = rest.split(['/', '?']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    match host_port.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => {
            Some(format!("{host}:{}", port.parse::<u16>().ok()?))
        }
        _ if !host_port.is_empty() => Some(format!("{host_port}:{default_port}")),
        _ => None,
    }
}

/// The Redis Cluster for tests, `redis-cluster://host:port[,host:port…]` (seed nodes; the form
/// the payments example's `IDEM_STORE_URL` takes): `IDEM_TEST_REDIS_CLUSTER_URL` if set, else the
/// test binary's own cluster, started by the first call (it blocks meanwhile). Fails the test,
/// saying what to do, if that cluster cannot be started.
pub fn redis_cluster_url() -> String {
    if let Ok(url) = std::env::var("IDEM_TEST_REDIS_CLUSTER_URL") {
        return url;
    }
    match crate::local_cluster::shared() {
        Ok(cluster) => cluster.url(),
        Err(e) => panic!(
            "could not start a Redis Cluster for the tests: {e}\n\
             The tests start one from redis-server and redis-cli (Debian: apt-get install \
             redis-server); or point IDEM_TEST_REDIS_CLUSTER_URL at a running one, or run the \
             tests without it:\n    IDEM_TEST_SKIP=redis-cluster cargo test --workspace\n\
             (the tests that need it are then reported as ignored; with CI=true none are)"
        ),
    }
}

/// The seed nodes of a `redis-cluster://host:port[,host:port…][?…]` URL, as `redis://` URLs.
pub fn cluster_seeds(url: &str) -> Vec<String> {
    let nodes = url.strip_prefix("redis-cluster://").unwrap_or(url);
    let nodes = nodes.split('?').next().unwrap_or_default();
    nodes
        .split(',')
        .filter(|node| !node.is_empty())
        .map(|node| format!("redis://{node}"))
        .collect()
}

/// A service the tests need, and what to tell a developer who does not have it running.
struct Service {
    name: &'static str,
    /// The variable that points the tests at it.
    url_var: &'static str,
    /// README.md's command that starts it on a development machine.
    start: &'static str,
    /// Its name in `IDEM_TEST_SKIP`.
    skip: &'static str,
}

const POSTGRES: Service = Service {
    name: "PostgreSQL",
    url_var: "IDEM_TEST_POSTGRES_URL",
    start: "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    skip: "postgres",
};

const MYSQL: Service = Service {
    name: "MySQL/MariaDB",
    url_var: "IDEM_TEST_MYSQL_URL",
    start: "service mariadb start",
    skip: "mysql",
};

const REDIS: Service = Service {
    name: "Redis",
    url_var: "IDEM_TEST_REDIS_URL",
    start: r#"redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no"#,
    skip: "redis",
};

const AMQP: Service = Service {
    name: "RabbitMQ",
    url_var: "IDEM_TEST_AMQP_URL",
    start: "service rabbitmq-server start",
    skip: "amqp",
};

const REDIS_CLUSTER: Service = Service {
    name: "Redis Cluster",
    url_var: "IDEM_TEST_REDIS_CLUSTER_URL",
    start: "unset IDEM_TEST_REDIS_CLUSTER_URL   # the tests then start a cluster of their own",
    skip: "redis-cluster",
};

impl Service {
    /// Fails the test: the service is unreachable at `url`. Says how to start it, where else to
    /// point the tests, and how to run them without it.
    fn unreachable(&self, url: &str, error: &dyn std::fmt::Display) -> ! {
        let Self {
            name,
            url_var,
            start,
            skip,
        } = self;
        panic!(
            "{name} is unreachable at {url}: {error}\n\
             Start it with\n    {start}\n\
             or point {url_var} at a running one, or run the tests without it:\n    \
             IDEM_TEST_SKIP={skip} cargo test --workspace\n\
             (the tests that need it are then reported as ignored; with CI=true none are)"
        );
    }
}

/// A PostgreSQL database of its own on the server at [`postgres_url`], dropped with this value (also
/// when the test fails). Named `idem_test_<unix seconds>_<uuid>`; databases of this form older than
/// an hour (left by a killed run) are dropped when the next one is created.
#[derive(Debug)]
pub struct TestDb {
    server: PgConnectOptions,
    name: String,
}

const DB_PREFIX: &str = "idem_test_";
/// Test databases older than this are leftovers of a killed run.
const STALE_AFTER_SECS: u64 = 3600;

impl TestDb {
    /// Creates the database; fails the test, saying how to start the server, if it is unreachable.
    pub async fn create() -> Self {
        let url = postgres_url();
        let server: PgConnectOptions = match url.parse() {
            Ok(options) => options,
            Err(e) => POSTGRES.unreachable(&url, &e),
        };
        let mut admin = match server.clone().database("postgres").connect().await {
            Ok(conn) => conn,
            Err(e) => POSTGRES.unreachable(&url, &e),
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs();
        let existing: Vec<String> = sqlx::query_scalar(
            "SELECT datname FROM pg_database WHERE datname LIKE 'idem\\_test\\_%'",
        )
        .fetch_all(&mut admin)
        .await
        .expect("list test databases");
        for stale in existing.iter().filter(|name| {
            created_secs(name).is_some_and(|t| now.saturating_sub(t) > STALE_AFTER_SECS)
        }) {
            // Another run may drop it at the same time: ignore the outcome.
            let _ = sqlx::raw_sql(&format!(
                r#"DROP DATABASE IF EXISTS "{stale}" WITH (FORCE)"#
            ))
            .execute(&mut admin)
            .await;
        }
        let name = format!("{DB_PREFIX}{now}_{}", uuid::Uuid::new_v4().simple());
        sqlx::raw_sql(&format!(r#"CREATE DATABASE "{name}""#))
            .execute(&mut admin)
            .await
            .expect("create test database");
        Self { server, name }
    }

    /// Connection options for this database.
    pub fn options(&self) -> PgConnectOptions {
        self.server.clone().database(&self.name)
    }

    /// A `postgres://` URL of this database (for a process's `DATABASE_URL`).
    pub fn url(&self) -> String {
        self.options().to_url_lossy().to_string()
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

fn created_secs(name: &str) -> Option<u64> {
    name.strip_prefix(DB_PREFIX)?
        .split('_')
        .next()?
        .parse()
        .ok()
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let admin = self.server.clone().database("postgres");
        let name = self.name.clone();
        // Drop may run inside or outside a runtime: do the blocking work on a thread of its own.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let mut conn = admin.connect().await.map_err(|e| e.to_string())?;
                sqlx::raw_sql(&format!(r#"DROP DATABASE IF EXISTS "{name}" WITH (FORCE)"#))
                    .execute(&mut conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!(
                "could not drop test database {} ({dropped:?}); the next run drops it",
                self.name
            );
        }
    }
}

/// A MySQL/MariaDB database of its own on the server at [`mysql_url`], dropped with this value (also
/// when the test fails). Named `idem_test_<unix seconds>_<uuid>`; databases of this form older than
/// an hour (left by a killed run) are dropped when the next one is created.
#[derive(Debug)]
pub struct MySqlTestDb {
    server: MySqlConnectOptions,
    name: String,
}

impl MySqlTestDb {
    /// Creates the database; fails the test, saying how to start the server, if it is unreachable.
    pub async fn create() -> Self {
        let url = mysql_url();
        let server: MySqlConnectOptions = match url.parse() {
            Ok(options) => options,
            Err(e) => MYSQL.unreachable(&url, &e),
        };
        let mut admin = match server.connect().await {
            Ok(conn) => conn,
            Err(e) => MYSQL.unreachable(&url, &e),
        };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs();
        let existing: Vec<String> = sqlx::query_scalar(
            "SELECT CAST(schema_name AS CHAR) FROM information_schema.schemata \
             WHERE schema_name LIKE 'idem\\_test\\_%'",
        )
        .fetch_all(&mut admin)
        .await
        .expect("list test databases");
        for stale in existing.iter().filter(|name| {
            created_secs(name).is_some_and(|t| now.saturating_sub(t) > STALE_AFTER_SECS)
        }) {
            // Another run may drop it at the same time: ignore the outcome.
            let _ = sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS `{stale}`"))
                .execute(&mut admin)
                .await;
        }
        let name = format!("{DB_PREFIX}{now}_{}", uuid::Uuid::new_v4().simple());
        sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
            .execute(&mut admin)
            .await
            .expect("create test database");
        Self { server, name }
    }

    /// Connection options for this database.
    pub fn options(&self) -> MySqlConnectOptions {
        self.server.clone().database(&self.name)
    }

    /// A `mysql://` URL of this database (for a process's `DATABASE_URL`).
    pub fn url(&self) -> String {
        self.options().to_url_lossy().to_string()
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for MySqlTestDb {
    fn drop(&mut self) {
        let admin = self.server.clone();
        let name = self.name.clone();
        // Drop may run inside or outside a runtime: do the blocking work on a thread of its own.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let mut conn = admin.connect().await.map_err(|e| e.to_string())?;
                sqlx::raw_sql(&format!("DROP DATABASE IF EXISTS `{name}`"))
                    .execute(&mut conn)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!(
                "could not drop test database {} ({dropped:?}); the next run drops it",
                self.name
            );
        }
    }
}

/// A fresh key prefix on the Redis server at [`redis_url`]; every key under it is deleted when this
/// value is dropped (also when the test fails).
#[derive(Debug)]
pub struct RedisPrefix {
    url: String,
    prefix: String,
}

impl RedisPrefix {
    /// A new prefix, `idem-test-<uuid>`; fails the test, saying how to start the server, if it is
    /// unreachable.
    pub async fn create() -> Self {
        let url = redis_url();
        let reachable = async {
            let client = redis::Client::open(url.as_str())?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING").query_async::<()>(&mut conn).await
        };
        if let Err(e) = reachable.await {
            REDIS.unreachable(&url, &e);
        }
        Self {
            url,
            prefix: format!("idem-test-{}", uuid::Uuid::new_v4()),
        }
    }

    /// The server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The keys under the prefix right now.
    pub async fn keys(&self) -> Vec<String> {
        let client = redis::Client::open(self.url.as_str()).expect("redis url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to redis");
        let mut keys: Vec<String> = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}:*", self.prefix))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("scan");
            keys.extend(page);
            if next == 0 {
                return keys;
            }
            cursor = next;
        }
    }
}

impl Drop for RedisPrefix {
    /// Deletes every key under the prefix (a blocking connection: Drop cannot await).
    fn drop(&mut self) {
        let cleanup = || -> redis::RedisResult<()> {
            let client = redis::Client::open(self.url.as_str())?;
            let mut conn = client.get_connection()?;
            let keys: Vec<String> =
                redis::Commands::scan_match::<_, String>(&mut conn, format!("{}:*", self.prefix))?
                    .collect();
            for chunk in keys.chunks(500) {
                redis::cmd("DEL").arg(chunk).query::<()>(&mut conn)?;
            }
            Ok(())
        };
        if let Err(e) = cleanup() {
            eprintln!("could not delete the test keys under {}: {e}", self.prefix);
        }
    }
}

/// A fresh key prefix on the Redis Cluster at [`redis_cluster_url`]; every key under it, on every
/// primary, is deleted when this value is dropped (also when the test fails).
#[derive(Debug)]
pub struct RedisClusterPrefix {
    url: String,
    prefix: String,
}

impl RedisClusterPrefix {
    /// A new prefix, `idem-test-<uuid>`; fails the test, saying how to start the cluster, if it is
    /// unreachable or not serving every slot.
    pub async fn create() -> Self {
        let url = tokio::task::spawn_blocking(redis_cluster_url)
            .await
            .expect("join");
        let seeds = cluster_seeds(&url);
        let reachable = tokio::task::spawn_blocking(move || cluster_primaries(&seeds))
            .await
            .expect("join");
        match reachable {
            Ok(primaries) if !primaries.is_empty() => {}
            Ok(_) => REDIS_CLUSTER.unreachable(&url, &"no primary serves slots"),
            Err(e) => REDIS_CLUSTER.unreachable(&url, &e),
        }
        Self {
            url,
            prefix: format!("idem-test-{}", uuid::Uuid::new_v4()),
        }
    }

    /// The cluster's `redis-cluster://` URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its seed nodes, as `redis://` URLs.
    pub fn seeds(&self) -> Vec<String> {
        cluster_seeds(&self.url)
    }

    /// The prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The keys under the prefix right now, by primary (`redis://host:port`).
    pub async fn keys(&self) -> Vec<(String, Vec<String>)> {
        let (seeds, pattern) = (self.seeds(), format!("{}:*", self.prefix));
        tokio::task::spawn_blocking(move || cluster_keys(&seeds, &pattern))
            .await
            .expect("join")
            .expect("scan the cluster")
    }
}

impl Drop for RedisClusterPrefix {
    /// Deletes every key under the prefix, on every primary (blocking connections: Drop cannot
    /// await).
    fn drop(&mut self) {
        let cleanup = || -> redis::RedisResult<()> {
            for (primary, keys) in cluster_keys(&self.seeds(), &format!("{}:*", self.prefix))? {
                let mut conn = redis::Client::open(primary.as_str())?.get_connection()?;
                // One key per command: keys of different slots cannot share one.
                let mut pipe = redis::pipe();
                for key in &keys {
                    pipe.cmd("DEL").arg(key).ignore();
                }
                pipe.query::<()>(&mut conn)?;
            }
            Ok(())
        };
        if let Err(e) = cleanup() {
            eprintln!("could not delete the test keys under {}: {e}", self.prefix);
        }
    }
}

/// The primaries serving slots in the cluster of `seeds` (the first that answers), as
/// `redis://host:port`, from `CLUSTER NODES`.
pub fn cluster_primaries(seeds: &[String]) -> redis::RedisResult<Vec<String>> {
    let mut last = None;
    for seed in seeds {
        let nodes = redis::Client::open(seed.as_str())
            .and_then(|client| client.get_connection_with_timeout(Duration::from_secs(1)))
            .and_then(|mut conn| {
                redis::cmd("CLUSTER")
                    .arg("NODES")
                    .query::<String>(&mut conn)
            });
        match nodes {
            Ok(nodes) => {
                let mut primaries: Vec<String> = nodes
                    .lines()
                    .filter_map(|line| {
                        let fields: Vec<&str> = line.split(' ').collect();
                        let flags = fields.get(2)?;
                        let serving = fields.len() > 8
                            && flags.split(',').any(|f| f == "master")
                            && !flags.contains("fail");
                        let address = fields[1].split(['@', ',']).next()?;
                        serving.then(|| format!("redis://{address}"))
                    })
                    .collect();
                primaries.sort();
                return Ok(primaries);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        redis::RedisError::from((redis::ErrorKind::InvalidClientConfig, "no seed node"))
    }))
}

/// The keys matching `pattern` on each primary of the cluster of `seeds`.
fn cluster_keys(seeds: &[String], pattern: &str) -> redis::RedisResult<Vec<(String, Vec<String>)>> {
    cluster_primaries(seeds)?
        .into_iter()
        .map(|primary| {
            let mut conn = redis::Client::open(primary.as_str())?.get_connection()?;
            let keys = redis::Commands::scan_match::<_, String>(&mut conn, pattern)?.collect();
            Ok((primary, keys))
        })
        .collect()
}
