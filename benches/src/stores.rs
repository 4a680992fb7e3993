//! The stores under test: one per backend, each empty, and the services' addresses.

use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::redis::RedisStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::store::Store;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// The four backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    Memory,
    Sqlite,
    Postgres,
    Redis,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Sqlite => "SQLite",
            Backend::Postgres => "PostgreSQL",
            Backend::Redis => "Redis",
        }
    }
}

/// One backend's store, with what the floors and bulk loads need to reach it directly.
#[derive(Clone)]
pub(crate) enum Handle {
    Memory(Arc<MemoryStore>),
    Sqlite(Arc<SqliteStore>),
    Postgres(Arc<PostgresStore>),
    Redis(Arc<RedisStore>, redis::aio::ConnectionManager),
}

impl Handle {
    pub(crate) fn store(&self) -> Arc<dyn Store> {
        match self {
            Handle::Memory(s) => s.clone(),
            Handle::Sqlite(s) => s.clone(),
            Handle::Postgres(s) => s.clone(),
            Handle::Redis(s, _) => s.clone(),
        }
    }
}

/// Where the services are. Defaults: the test services.
pub(crate) fn postgres_base() -> String {
    std::env::var("IDEM_BENCH_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

pub(crate) fn redis_url() -> String {
    // Database 7, flushed by the bench: never the tests' database 0.
    std::env::var("IDEM_BENCH_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/7".to_owned())
}

/// A fresh scratch directory for SQLite files.
pub(crate) fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A new SQLite store in a new file (WAL, synchronous=NORMAL: the store's defaults).
pub(crate) async fn sqlite(name: &str) -> Arc<SqliteStore> {
    let path = scratch().join(format!("{name}.db"));
    let _ = std::fs::remove_file(&path);
    let url = format!("sqlite://{}?mode=rwc", path.display());
    Arc::new(SqliteStore::connect(&url).await.expect("open SQLite"))
}

/// The bench's own PostgreSQL database (`idem_bench`, created if missing, emptied), so bulk loads
/// never meet the tests' records. `via` replaces the host:port (the counting proxy).
pub(crate) async fn postgres(via: Option<SocketAddr>) -> Result<Arc<PostgresStore>, String> {
    let base = postgres_base();
    let admin = sqlx::PgPool::connect(&format!("{base}/postgres?sslmode=disable"))
        .await
        .map_err(|e| format!("PostgreSQL unreachable at {base}: {e}"))?;
    if let Err(e) = sqlx::query("CREATE DATABASE idem_bench")
        .execute(&admin)
        .await
    {
        if !e.to_string().contains("already exists") {
            return Err(format!("CREATE DATABASE idem_bench: {e}"));
        }
    }
    admin.close().await;
    let url = match via {
        Some(addr) => format!("postgres://postgres@{addr}/idem_bench?sslmode=disable"),
        None => format!("{base}/idem_bench?sslmode=disable"),
    };
    let store = PostgresStore::connect(&url)
        .await
        .map_err(|e| format!("PostgresStore::connect: {e}"))?;
    if via.is_none() {
        sqlx::query("TRUNCATE idem.records")
            .execute(store.pool())
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(Arc::new(store))
}

/// The Redis store on the bench's database (flushed), and a plain connection for floors and loads.
pub(crate) async fn redis(
    via: Option<SocketAddr>,
) -> Result<(Arc<RedisStore>, redis::aio::ConnectionManager), String> {
    let url = match via {
        Some(addr) => format!("redis://{addr}/7"),
        None => redis_url(),
    };
    let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
    let mut conn = redis::aio::ConnectionManager::new(client)
        .await
        .map_err(|e| format!("Redis unreachable at {url}: {e}"))?;
    if via.is_none() {
        redis::cmd("FLUSHDB")
            .query_async::<()>(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    let store = RedisStore::builder(url)
        .prefix("bench")
        .connect()
        .await
        .map_err(|e| format!("RedisStore::connect: {e}"))?;
    Ok((Arc::new(store), conn))
}

/// Whether `IDEM_BENCH_STORES` (a comma-separated list of `memory`, `sqlite`, `postgres`, `redis`;
/// unset or empty: all) selects `backend`.
pub(crate) fn selected(backend: Backend) -> bool {
    let list = std::env::var("IDEM_BENCH_STORES").unwrap_or_default();
    let name = match backend {
        Backend::Memory => "memory",
        Backend::Sqlite => "sqlite",
        Backend::Postgres => "postgres",
        Backend::Redis => "redis",
    };
    list.trim().is_empty() || list.split(',').any(|s| s.trim().eq_ignore_ascii_case(name))
}

/// Every selected backend that can be reached, each empty: a new memory store, a new SQLite file
/// `<sqlite>.db`, the bench's PostgreSQL table truncated, its Redis database flushed. The
/// unreachable ones are reported and skipped.
pub(crate) async fn handles(sqlite_name: &str) -> Vec<(Backend, Handle)> {
    let mut out = Vec::new();
    if selected(Backend::Memory) {
        out.push((
            Backend::Memory,
            Handle::Memory(Arc::new(MemoryStore::new())),
        ));
    }
    if selected(Backend::Sqlite) {
        out.push((Backend::Sqlite, Handle::Sqlite(sqlite(sqlite_name).await)));
    }
    if selected(Backend::Postgres) {
        match postgres(None).await {
            Ok(s) => out.push((Backend::Postgres, Handle::Postgres(s))),
            Err(e) => eprintln!("skipping PostgreSQL: {e}"),
        }
    }
    if selected(Backend::Redis) {
        match redis(None).await {
            Ok((s, c)) => out.push((Backend::Redis, Handle::Redis(s, c))),
            Err(e) => eprintln!("skipping Redis: {e}"),
        }
    }
    out
}
