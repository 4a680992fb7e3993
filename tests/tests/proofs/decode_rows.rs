//! Property-based fuzzing of the SQL stores' row decoders, which cargo-fuzz cannot reach (a row only
//! comes out of a database): random rows are written straight into the records table (for SQLite
//! with any storage class in any column, as its dynamic typing allows; for PostgreSQL anything the
//! column types and CHECKs admit), then read, claimed, completed and released through the store.
//!
//! Every call must answer `Ok`, `Corrupt` or `Fenced` — never panic, never `Unavailable` (a decoding
//! problem is not an outage) — and a claim that reports `Corrupt` must leave the row as it was.
//!
//! `PROPTEST_CASES` sets the budget (default 64 per store).

use idem_runtime::clock::Timestamp;
use idem_runtime::sqlx::{self, Row};
use idem_runtime::store::{Claim, ClaimOutcome};
use idem_runtime::{FencingToken, Fingerprint, RecordKey, Store, StoreErrorKind, StoredResponse};
use idem_tests::conformance::Backend;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const NOW: i64 = 1_800_000_000_000;

fn runner() -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]))
}

/// A value of any SQLite storage class.
#[derive(Debug, Clone)]
enum Val {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

fn millis() -> impl Strategy<Value = i64> {
    prop_oneof![
        4 => NOW - 10_000_000..NOW + 10_000_000,
        1 => any::<i64>(),
        1 => Just(i64::MIN),
        1 => Just(i64::MAX),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(r#"[["content-type","application/json"]]"#.to_owned()),
        Just("[]".to_owned()),
        Just(r#"[["a"]]"#.to_owned()),
        Just(r#"{"a":"b"}"#.to_owned()),
        Just("not json".to_owned()),
        any::<String>(),
    ]
}

fn val(int: impl Strategy<Value = i64> + 'static) -> impl Strategy<Value = Val> {
    prop_oneof![
        6 => int.prop_map(Val::Int),
        1 => Just(Val::Null),
        1 => any::<f64>().prop_map(Val::Real),
        1 => text().prop_map(Val::Text),
        1 => prop::collection::vec(any::<u8>(), 0..40).prop_map(Val::Blob),
    ]
}

fn fingerprint_val() -> impl Strategy<Value = Val> {
    prop_oneof![
        6 => Just(Val::Blob(fp().0.to_vec())),
        2 => prop::collection::vec(any::<u8>(), 0..40).prop_map(Val::Blob),
        1 => text().prop_map(Val::Text),
        1 => any::<i64>().prop_map(Val::Int),
    ]
}

#[derive(Debug, Clone)]
struct SqliteRow {
    fingerprint: Val,
    token: Val,
    created_at: Val,
    expires_at: Val,
    retain_until: Val,
    /// The `state` column: one the table admits.
    state: &'static str,
    lease_until: Val,
    status: Val,
    headers: Val,
    body: Val,
}

fn sqlite_row() -> impl Strategy<Value = SqliteRow> {
    (
        fingerprint_val(),
        val(any::<i64>()),
        val(millis()),
        val(millis()),
        val(millis()),
        prop_oneof![Just("in_flight"), Just("completed"), Just("released")],
        val(millis()),
        val(prop_oneof![4 => 100i64..600, 1 => any::<i64>()]),
        prop_oneof![4 => text().prop_map(Val::Text), 1 => val(any::<i64>())],
        val(any::<i64>()),
    )
        .prop_map(
            |(
                fingerprint,
                token,
                created_at,
                expires_at,
                retain_until,
                state,
                lease_until,
                status,
                headers,
                body,
            )| {
                SqliteRow {
                    fingerprint,
                    token,
                    created_at,
                    expires_at,
                    retain_until,
                    state,
                    lease_until,
                    status,
                    headers,
                    body,
                }
            },
        )
}

fn fp() -> Fingerprint {
    Fingerprint::of_request("POST", "/payments", None, b"x")
}

fn fresh_claim(key: &RecordKey) -> Claim<'_> {
    Claim {
        key,
        fingerprint: fp(),
        token: FencingToken::generate(),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        retain: Duration::from_secs(4 * 3600),
    }
}

/// The clock the stores here judge time by, standing at `NOW`.
fn clock() -> Arc<dyn idem_runtime::clock::Clock> {
    Arc::new(idem_runtime::clock::ManualClock::new(
        Timestamp::from_millis(NOW),
    ))
}

fn allowed<T: std::fmt::Debug>(
    what: &str,
    result: &Result<T, idem_runtime::StoreError>,
) -> Result<(), TestCaseError> {
    match result {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.kind(), StoreErrorKind::Corrupt | StoreErrorKind::Fenced) => Ok(()),
        Err(e) => Err(TestCaseError::fail(format!("{what}: {e}"))),
    }
}

/// Reads, claims, completes and releases `key` through `store`; `snapshot` reads the raw row.
async fn exercise<S: Store, F, Fut>(
    store: &S,
    key: &RecordKey,
    snapshot: F,
) -> Result<(), TestCaseError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = String>,
{
    allowed(
        "get",
        &store.get(key).await.map(|found| found.map(|f| f.record)),
    )?;
    let before = snapshot().await;
    let claimed = store.claim(&fresh_claim(key)).await;
    allowed("claim", &claimed)?;
    if matches!(&claimed, Err(e) if e.kind() == StoreErrorKind::Corrupt) {
        let after = snapshot().await;
        if before != after {
            return Err(TestCaseError::fail(format!(
                "a claim reporting Corrupt changed the row: {before} -> {after}"
            )));
        }
    }
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: "x".into(),
    };
    allowed(
        "complete",
        &store.complete(key, FencingToken(1), &response).await,
    )?;
    allowed("release", &store.release(key, FencingToken(1)).await)?;
    if let Ok(ClaimOutcome::Claimed(_)) = claimed {
        allowed(
            "get after claim",
            &store.get(key).await.map(|found| found.map(|f| f.record)),
        )?;
    }
    Ok(())
}

fn bind<'q>(
    q: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>>,
    v: &Val,
) -> sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments<'q>> {
    match v.clone() {
        Val::Null => q.bind(None::<i64>),
        Val::Int(i) => q.bind(i),
        Val::Real(f) => q.bind(f),
        Val::Text(s) => q.bind(s),
        Val::Blob(b) => q.bind(b),
    }
}

#[test]
fn sqlite_rows_decode_or_are_corrupt() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let backend = runtime.block_on(crate::proof_support::sqlite());
    let store = runtime.block_on(backend.open(clock()));
    let pool = store.pool().clone();
    let n = AtomicU64::new(0);
    let result = runner().run(&sqlite_row(), |row| {
        runtime.block_on(async {
            let key = RecordKey::new("rows", format!("k{}", n.fetch_add(1, Ordering::Relaxed)));
            let mut q = sqlx::query(
                "INSERT INTO idem_records (scope, key, fingerprint, token, created_at, expires_at, \
                 retain_until, state, lease_until, status, headers, body) \
                 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            )
            .bind(key.scope().to_owned())
            .bind(key.key().to_owned());
            for v in [&row.fingerprint, &row.token, &row.created_at, &row.expires_at, &row.retain_until] {
                q = bind(q, v);
            }
            q = q.bind(row.state);
            for v in [&row.lease_until, &row.status, &row.headers, &row.body] {
                q = bind(q, v);
            }
            if q.execute(&pool).await.is_err() {
                return Ok(()); // a NOT NULL column given NULL: not a row the table can hold
            }
            let snapshot = || async {
                let row = sqlx::query(
                    "SELECT quote(fingerprint) || quote(token) || quote(created_at) || quote(expires_at) \
                     || quote(retain_until) || quote(state) || quote(lease_until) || quote(status) \
                     || quote(headers) || quote(body) FROM idem_records WHERE scope = ? AND key = ?",
                )
                .bind(key.scope())
                .bind(key.key())
                .fetch_optional(&pool)
                .await
                .expect("snapshot");
                row.map(|r| r.get::<String, _>(0)).unwrap_or_default()
            };
            exercise(&store, &key, snapshot).await
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[derive(Debug, Clone)]
struct PgRow {
    fingerprint: Vec<u8>,
    token: i64,
    created_at: i64,
    expires_at: i64,
    retain_until: i64,
    completed: bool,
    lease_until: i64,
    status: i32,
    headers: String,
    body: Vec<u8>,
}

fn pg_row() -> impl Strategy<Value = PgRow> {
    (
        prop_oneof![6 => Just(fp().0.to_vec()), 2 => prop::collection::vec(any::<u8>(), 0..40)],
        any::<i64>(),
        millis(),
        millis(),
        millis(),
        any::<bool>(),
        millis(),
        prop_oneof![4 => 100i32..600, 1 => any::<i32>()],
        text(),
        prop::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(
            |(
                fingerprint,
                token,
                created_at,
                expires_at,
                retain_until,
                completed,
                lease_until,
                status,
                headers,
                body,
            )| PgRow {
                fingerprint,
                token,
                created_at,
                expires_at,
                retain_until,
                completed,
                lease_until,
                status,
                headers,
                body,
            },
        )
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[test]
fn postgres_rows_decode_or_are_corrupt() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let backend = runtime.block_on(crate::proof_support::postgres());
    let store = runtime.block_on(backend.open(clock()));
    let pool = store.pool().clone();
    let n = AtomicU64::new(0);
    let result = runner().run(&pg_row(), |row| {
        runtime.block_on(async {
            let key = RecordKey::new("rows", format!("k{}", n.fetch_add(1, Ordering::Relaxed)));
            // Text headers must not hold NUL, which PostgreSQL's text type refuses.
            let headers = row.headers.replace('\0', "");
            sqlx::query(
                "INSERT INTO idem.records (scope, key, fingerprint, token, created_at, expires_at, \
                 retain_until, state, lease_until, status, headers, body) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            )
            .bind(key.scope())
            .bind(key.key())
            .bind(&row.fingerprint)
            .bind(row.token)
            .bind(row.created_at)
            .bind(row.expires_at)
            .bind(row.retain_until)
            .bind(if row.completed { "completed" } else { "in_flight" })
            .bind((!row.completed).then_some(row.lease_until))
            .bind(row.completed.then_some(row.status))
            .bind(row.completed.then_some(headers))
            .bind(row.completed.then_some(row.body.clone()))
            .execute(&pool)
            .await
            .expect("insert a row the table admits");
            let snapshot = || async {
                let row = sqlx::query(
                    "SELECT to_jsonb(r)::text FROM idem.records r WHERE scope = $1 AND key = $2",
                )
                .bind(key.scope())
                .bind(key.key())
                .fetch_optional(&pool)
                .await
                .expect("snapshot");
                row.map(|r| r.get::<String, _>(0)).unwrap_or_default()
            };
            exercise(&store, &key, snapshot).await
        })
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}
