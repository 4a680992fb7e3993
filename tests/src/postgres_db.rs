//! A PostgreSQL database of its own for one test, dropped with it.
//!
//! Named `idem_test_<unix seconds>_<uuid>` on the server at `IDEM_TEST_POSTGRES_URL`; databases of
//! this form older than an hour (left by a killed run) are dropped when the next one is created.

use idem_runtime::sqlx::postgres::PgConnectOptions;
use idem_runtime::sqlx::{self, ConnectOptions};
use std::time::{SystemTime, UNIX_EPOCH};

const PREFIX: &str = "idem_test_";
/// Test databases older than this are leftovers of a killed run.
const STALE_AFTER_SECS: u64 = 3600;

/// A fresh database, dropped (with `FORCE`) when this value is.
#[derive(Debug)]
pub struct TestDatabase {
    server: PgConnectOptions,
    name: String,
}

impl TestDatabase {
    /// Creates the database, or returns `None` after saying the test is skipped (outside CI, when
    /// PostgreSQL is unreachable); under CI an unreachable server panics.
    pub async fn create() -> Option<Self> {
        let server: PgConnectOptions = match crate::services::postgres_url().parse() {
            Ok(options) => options,
            Err(e) => return crate::services::unreachable_service("PostgreSQL", &e),
        };
        let mut admin = match server.clone().database("postgres").connect().await {
            Ok(conn) => conn,
            Err(e) => return crate::services::unreachable_service("PostgreSQL", &e),
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
        let name = format!("{PREFIX}{now}_{}", uuid::Uuid::new_v4().simple());
        sqlx::raw_sql(&format!(r#"CREATE DATABASE "{name}""#))
            .execute(&mut admin)
            .await
            .expect("create test database");
        Some(Self { server, name })
    }

    /// Connection options for this database.
    pub fn options(&self) -> PgConnectOptions {
        self.server.clone().database(&self.name)
    }

    /// A `postgres://` URL for this database (for a child process): the server URL with its
    /// database, if any, replaced and its query kept.
    pub fn url(&self) -> String {
        let server = crate::services::postgres_url();
        let (scheme, rest) = server.split_once("://").unwrap_or(("postgres", &server));
        let (before_query, query) = match rest.split_once('?') {
            Some((before, query)) => (before, Some(query)),
            None => (rest, None),
        };
        let authority = before_query.split('/').next().unwrap_or(before_query);
        match query {
            Some(query) => format!("{scheme}://{authority}/{}?{query}", self.name),
            None => format!("{scheme}://{authority}/{}", self.name),
        }
    }
}

fn created_secs(name: &str) -> Option<u64> {
    name.strip_prefix(PREFIX)?.split('_').next()?.parse().ok()
}

impl Drop for TestDatabase {
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
