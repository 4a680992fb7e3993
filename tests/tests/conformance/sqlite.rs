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

/// The same cases on stores made `unbatched`: every lookup and write a statement of its own, so
/// the plain path keeps the contract without the batcher's reader and writer.
mod unbatched {
    use super::Sqlite;
    use idem_runtime::clock::Clock;
    use idem_runtime::store::sqlite::SqliteStore;
    use idem_tests::conformance::Backend;
    use std::sync::Arc;

    struct Unbatched(Sqlite);

    #[async_trait::async_trait]
    impl Backend for Unbatched {
        type Store = SqliteStore;

        async fn open(&self, clock: Arc<dyn Clock>) -> SqliteStore {
            self.0.open(clock).await.unbatched()
        }

        fn durable(&self) -> bool {
            true
        }

        async fn unreachable(&self) -> Option<SqliteStore> {
            Some(self.0.unreachable().await?.unbatched())
        }
    }

    async fn sqlite() -> Unbatched {
        Unbatched(super::sqlite().await)
    }

    idem_tests::conformance_suite!(sqlite);
}
