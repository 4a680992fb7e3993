//! The stores under test: one per backend, each empty, and the services' addresses.

use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::mysql::MySqlStore;
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::store::redis::{RedisClusterStore, RedisStore};
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::store::Store;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether the MySQL store's server is MariaDB (set when the bench reaches it).
static MARIADB: AtomicBool = AtomicBool::new(false);

/// The backends (the Redis Cluster only in the `scale` section: `cluster` reaches it itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backend {
    Memory,
    Sqlite,
    Postgres,
    Mysql,
    Redis,
    RedisCluster,
}

impl Backend {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Sqlite => "SQLite",
            Backend::Postgres => "PostgreSQL",
            // The store is the MySQL store either way; the name says which server it measured.
            Backend::Mysql if MARIADB.load(Ordering::Relaxed) => "MariaDB",
            Backend::Mysql => "MySQL",
            Backend::Redis => "Redis",
            Backend::RedisCluster => "Redis Cluster",
        }
    }

    /// Its name in `IDEM_BENCH_STORES`.
    pub(crate) fn id(self) -> &'static str {
        match self {
            Backend::Memory => "memory",
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
            Backend::Mysql => "mysql",
            Backend::Redis => "redis",
            Backend::RedisCluster => "redis-cluster",
        }
    }
}

/// One backend's store, with what the floors and bulk loads need to reach it directly.
#[derive(Clone)]
pub(crate) enum Handle {
    Memory(Arc<MemoryStore>),
    Sqlite(Arc<SqliteStore>),
    Postgres(Arc<PostgresStore>),
    Mysql(Arc<MySqlStore>),
    Redis(Arc<RedisStore>, redis::aio::ConnectionManager),
    RedisCluster(
        Arc<RedisClusterStore>,
        redis::cluster_async::ClusterConnection,
    ),
}

impl Handle {
    pub(crate) fn store(&self) -> Arc<dyn Store> {
        match self {
            Handle::Memory(s) => s.clone(),
            Handle::Sqlite(s) => s.clone(),
            Handle::Postgres(s) => s.clone(),
            Handle::Mysql(s) => s.clone(),
            Handle::Redis(s, _) => s.clone(),
            Handle::RedisCluster(s, _) => s.clone(),
        }
    }
}

/// A connection to one Redis server or to a cluster, for the floors' commands: the cluster
/// connection routes each command by its key.
#[derive(Clone)]
pub(crate) enum RedisConn {
    One(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

impl redis::aio::ConnectionLike for RedisConn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            RedisConn::One(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            RedisConn::One(c) => c.req_packed_commands(cmd, offset, count),
            RedisConn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::One(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}

/// Where the services are. Defaults: the test services.
pub(crate) fn postgres_base() -> String {
    std::env::var("IDEM_BENCH_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_owned())
}

/// The bench's MySQL or MariaDB database (created if missing, its tables emptied).
pub(crate) fn mysql_url() -> String {
    std::env::var("IDEM_BENCH_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/idem_bench".to_owned())
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

/// `url` with its `host:port` replaced by `addr` (the counting proxy), its user and path kept.
pub(crate) fn via(url: &str, addr: SocketAddr) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (user, rest) = rest.rsplit_once('@').map_or(("", rest), |(u, r)| (u, r));
    let path = rest.find('/').map_or("", |i| &rest[i..]);
    let at = if user.is_empty() { "" } else { "@" };
    format!("{scheme}://{user}{at}{addr}{path}")
}

/// The MySQL store on the bench's database ([`mysql_url`]: created if missing; its records and
/// wake-ups deleted). `via` replaces the host:port (the counting proxy).
pub(crate) async fn mysql(via: Option<SocketAddr>) -> Result<Arc<MySqlStore>, String> {
    let url = mysql_url();
    let (server, database) = url
        .rsplit_once('/')
        .filter(|(server, db)| server.contains("://") && !db.is_empty())
        .ok_or_else(|| format!("IDEM_BENCH_MYSQL_URL names no database: {url}"))?;
    let database = database.split('?').next().unwrap_or(database);
    if !database
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(format!(
            "database name {database:?}: letters, digits and _ only"
        ));
    }
    let admin = sqlx::MySqlPool::connect(server)
        .await
        .map_err(|e| format!("MySQL unreachable at {server}: {e}"))?;
    sqlx::query(&format!("CREATE DATABASE IF NOT EXISTS `{database}`"))
        .execute(&admin)
        .await
        .map_err(|e| format!("CREATE DATABASE {database}: {e}"))?;
    if let Ok(version) = sqlx::query_scalar::<_, String>("SELECT VERSION()")
        .fetch_one(&admin)
        .await
    {
        MARIADB.store(version.contains("MariaDB"), Ordering::Relaxed);
    }
    admin.close().await;
    let url = match via {
        Some(addr) => self::via(&url, addr),
        None => url,
    };
    let store = MySqlStore::connect(&url)
        .await
        .map_err(|e| format!("MySqlStore::connect: {e}"))?;
    if via.is_none() {
        for table in ["idem_records", "idem_wakeups"] {
            sqlx::query(&format!("TRUNCATE {table}"))
                .execute(store.pool())
                .await
                .map_err(|e| e.to_string())?;
        }
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

/// The Redis Cluster's seed nodes, from `IDEM_BENCH_REDIS_CLUSTER_URL`
/// (`redis-cluster://host:port[,host:port…]`; default `.ci/redis-cluster`'s on 7000-7002): the URL
/// and each node's `redis://` URL.
pub(crate) fn redis_cluster_seeds() -> (String, Vec<String>) {
    let url = std::env::var("IDEM_BENCH_REDIS_CLUSTER_URL").unwrap_or_else(|_| {
        "redis-cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002".to_owned()
    });
    let seeds = url
        .trim_start_matches("redis-cluster://")
        .split(',')
        .map(|node| format!("redis://{node}"))
        .collect();
    (url, seeds)
}

/// The Redis Cluster store under `prefix`, and a cluster connection for floors and loads; the
/// caller empties the prefix.
pub(crate) async fn redis_cluster(
    prefix: &str,
) -> Result<
    (
        Arc<RedisClusterStore>,
        redis::cluster_async::ClusterConnection,
    ),
    String,
> {
    let (url, seeds) = redis_cluster_seeds();
    let unreachable =
        |e: redis::RedisError| format!("no cluster at {url} (`.ci/redis-cluster start`): {e}");
    let client = redis::cluster::ClusterClient::new(seeds.clone()).map_err(unreachable)?;
    let conn = client.get_async_connection().await.map_err(unreachable)?;
    let store = RedisClusterStore::builder(seeds)
        .prefix(prefix)
        .connect()
        .await
        .map_err(unreachable)?;
    Ok((Arc::new(store), conn))
}

/// Whether `IDEM_BENCH_STORES` (a comma-separated list of `memory`, `sqlite`, `postgres`, `mysql`,
/// `redis`, `redis-cluster`; unset or empty: all) selects `backend`.
pub(crate) fn selected(backend: Backend) -> bool {
    let list = std::env::var("IDEM_BENCH_STORES").unwrap_or_default();
    let name = backend.id();
    list.trim().is_empty() || list.split(',').any(|s| s.trim().eq_ignore_ascii_case(name))
}

/// Every selected backend that can be reached, each empty: a new memory store, a new SQLite file
/// `<sqlite>.db`, the bench's PostgreSQL and MySQL tables truncated, its Redis database flushed. The
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
    if selected(Backend::Mysql) {
        match mysql(None).await {
            Ok(s) => out.push((Backend::Mysql, Handle::Mysql(s))),
            Err(e) => eprintln!("skipping MySQL: {e}"),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The counting proxy must reach the same database as the same user: only the address moves.
    #[test]
    fn via_replaces_only_the_address() {
        let proxy: SocketAddr = "127.0.0.1:40000".parse().expect("an address");
        assert_eq!(
            via("mysql://root@127.0.0.1:3306/idem_bench", proxy),
            "mysql://root@127.0.0.1:40000/idem_bench"
        );
        assert_eq!(
            via(
                "mysql://app:secret@db.internal:3306/app?ssl-mode=disabled",
                proxy
            ),
            "mysql://app:secret@127.0.0.1:40000/app?ssl-mode=disabled"
        );
        assert_eq!(
            via("redis://127.0.0.1:6379", proxy),
            "redis://127.0.0.1:40000"
        );
    }
}
