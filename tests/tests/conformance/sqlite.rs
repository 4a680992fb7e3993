//! The store conformance suite on the SQLite store. Each case gets a fresh database file; every
//! `open()` is a new pool on that file (two handles are two instances, reopening is a restart).

use idem_runtime::clock::Clock;
use idem_runtime::store::sqlite::SqliteStore;
use idem_tests::conformance::Backend;
use std::sync::Arc;
use tempfile::TempDir;

struct Sqlite {
    url: String,
    /// Deleted (with the database) when the case ends.
    _dir: TempDir,
}

#[async_trait::async_trait]
impl Backend for Sqlite {
    type Store = SqliteStore;

    async fn open(&self, clock: Arc<dyn Clock>) -> SqliteStore {
        let store = SqliteStore::connect(&self.url).await.expect("open sqlite");
        store.with_clock(clock)
    }

    fn durable(&self) -> bool {
        true
    }

    /// A store whose pool has been closed: every call fails with `PoolClosed`, mapped to
    /// `Unavailable`, without panicking or touching the file.
    async fn unreachable(&self) -> Option<SqliteStore> {
        let store = SqliteStore::connect(&self.url).await.expect("open sqlite");
        store.pool().close().await;
        Some(store)
    }
}

async fn sqlite() -> Sqlite {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("idem.db").display());
    Sqlite { url, _dir: dir }
}

idem_tests::conformance_suite!(sqlite);
