//! Where the shared services are, and what a test does when one is not there.
//!
//! Tests read `IDEM_TEST_POSTGRES_URL` and `IDEM_TEST_REDIS_URL`, defaulting to the local services
//! the development and CI machines run. A test whose service is unreachable fails, saying how to
//! start it. To run without a service, name it in `IDEM_TEST_SKIP` (`postgres`, `redis`): the
//! tests that need it are then ignored, with the reason, and counted as such in `cargo test`'s
//! summary (see `tests/build.rs`); under `CI=true` nothing is skipped.
//!
//! [`TestDb`] and [`RedisPrefix`] give a test a database or a key prefix of its own, removed when
//! the test ends.

use idem_runtime::redis;
use idem_runtime::sqlx::postgres::PgConnectOptions;
use idem_runtime::sqlx::{self, ConnectOptions};
use std::time::{SystemTime, UNIX_EPOCH};

/// The PostgreSQL server URL for tests (a database name is appended per test run).
pub fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// The Redis URL for tests.
pub fn redis_url() -> String {
    std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
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

const REDIS: Service = Service {
    name: "Redis",
    url_var: "IDEM_TEST_REDIS_URL",
    start: r#"redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no"#,
    skip: "redis",
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
