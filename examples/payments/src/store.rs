//! Where the idempotency records live, chosen by URL.

use crate::StartError;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::Store;
use std::sync::Arc;

/// The idempotency store for `url`: `IDEM_STORE_URL` if set, else `DATABASE_URL`.
///
/// | URL | store |
/// |---|---|
/// | `memory:` | [`MemoryStore`]: forgotten on restart, one process only |
/// | `sqlite:...` | for now [`MemoryStore`] (see the TODO below) |
///
// TODO(integrator): wire the persistent stores here once they land:
//   - `sqlite:` → `idem_runtime::store::sqlite::SqliteStore` (branch `sqlite` has
//     `SqliteStore::connect(url)` and `SqliteStore::from_pool(pool)`; when the URL is DATABASE_URL,
//     `from_pool(ledger.pool().clone())` shares the ledger's pool). Then a restart replays: remove
//     the `#[ignore]` of `tests/tests/payments_restart.rs`. Spawn a `Sweeper` for it too;
//   - `postgres:` → `idem_runtime::store::postgres::PostgresStore`;
//   - `redis:` → `idem_runtime::store::redis::RedisStore`.
pub async fn store_from_url(url: &str) -> Result<Arc<dyn Store>, StartError> {
    let scheme = url.split(':').next().unwrap_or_default();
    match scheme {
        "memory" => Ok(Arc::new(MemoryStore::new())),
        "sqlite" => {
            tracing::warn!(
                "idempotency records are kept in memory for now: a restart forgets them"
            );
            Ok(Arc::new(MemoryStore::new()))
        }
        _ => Err(StartError::Unsupported(format!(
            "no idempotency store for `{scheme}:` URLs yet (use sqlite: or memory:)"
        ))),
    }
}
