//! Each store's floor: the claim and complete of a new request, and the read of a replay, issued
//! directly (a `Mutex<HashMap>`, raw sqlx statements on the store's own pool and table for SQLite,
//! PostgreSQL and MySQL, raw Redis commands), beside the same operations through idem's engine (no HTTP). Every floor's completion
//! is fenced, as idem's is: it stores the response only if the record is still the claim's own
//! in-flight record (the token compared under the map's lock, in the SQL `WHERE`, or by a Redis
//! script, since Redis 7.0 has no conditional `SET` on a value).

use crate::stores::{Handle, RedisConn};
use axum::http::header::{HeaderValue, CONTENT_TYPE, LOCATION};
use bytes::Bytes;
use idem_runtime::policy::Policy;
use idem_runtime::{Begin, Engine, FencingToken, Fingerprint, RecordKey, StoredResponse};
use sqlx::Row;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The policy engine-level runs use (the macro's defaults with a 24 h ttl).
pub(crate) const POLICY: Policy = Policy::new()
    .ttl(Duration::from_secs(86_400))
    .handler("bench")
    .checked();

/// The response every engine-level run stores (what the annotated handler stores, in size).
pub(crate) fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            (CONTENT_TYPE, HeaderValue::from_static("application/json")),
            (LOCATION, HeaderValue::from_static("/payments/123456")),
        ],
        body: Bytes::from_static(
            br#"{"amount":1000,"currency":"KRW","id":123456,"status":"captured"}"#,
        ),
    }
}

pub(crate) fn fingerprint() -> Fingerprint {
    Fingerprint::of_request(
        "POST",
        "/idem",
        Some("application/json"),
        crate::load::BODY.as_bytes(),
    )
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A new request through the engine: claim, then complete.
pub(crate) async fn engine_new(engine: &Engine, scope: &str, key: String) -> bool {
    match engine
        .begin(RecordKey::new(scope, key), fingerprint(), &POLICY)
        .await
    {
        Ok(Begin::Execute(claim)) => claim.complete(&response()).await.is_ok(),
        _ => false,
    }
}

/// A replay through the engine.
pub(crate) async fn engine_replay(engine: &Engine, scope: &str, key: String) -> bool {
    matches!(
        engine
            .begin(RecordKey::new(scope, key), fingerprint(), &POLICY)
            .await,
        Ok(Begin::Replay(_))
    )
}

/// The headers every floor stores with its response, as JSON (the SQL stores' column format).
const HEADERS_JSON: &str = r#"[["content-type","application/json"]]"#;

/// What a direct replay does with the record it read: compare the fingerprint and decode the
/// response it would send (status, headers, body), as the engine must. A floor that only checked
/// that a record exists would not be replaying anything.
fn replays(fp: &[u8], status: u16, headers: &str, body: &[u8]) -> bool {
    let response = StoredResponse {
        status,
        headers: StoredResponse::decode_headers(headers).unwrap_or_default(),
        body: Bytes::copy_from_slice(body),
    };
    fp == self::fingerprint().0 && response.status == 201 && !response.body.is_empty()
}

/// [`replays`] on a SQL floor's row, whose columns `at` hold the fingerprint, status, headers and
/// body.
fn replayed<'r, R: Row>(row: &'r R, at: [usize; 4]) -> bool
where
    usize: sqlx::ColumnIndex<R>,
    &'r [u8]: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    &'r str: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let [fp, status, headers, body] = at;
    let (Ok(fp), Ok(status), Ok(headers), Ok(body)) = (
        row.try_get::<&[u8], _>(fp),
        row.try_get::<i32, _>(status),
        row.try_get::<&str, _>(headers),
        row.try_get::<&[u8], _>(body),
    ) else {
        return false;
    };
    replays(fp, status as u16, headers, body)
}

/// What the Redis floor's completion stores: the fingerprint, then the response as the SQL floors
/// store it (status, the headers as JSON, the body), with the headers' length so the parts can be
/// told apart.
fn redis_value(fp: &[u8; 32], body: &[u8]) -> Vec<u8> {
    let headers = HEADERS_JSON.as_bytes();
    let mut value = Vec::with_capacity(32 + 2 + 4 + headers.len() + body.len());
    value.extend_from_slice(fp);
    value.extend_from_slice(&201u16.to_be_bytes());
    value.extend_from_slice(&(headers.len() as u32).to_be_bytes());
    value.extend_from_slice(headers);
    value.extend_from_slice(body);
    value
}

/// [`replays`] on the Redis floor's value ([`redis_value`]).
fn redis_replayed(value: &[u8]) -> bool {
    let Some((fp, rest)) = value.split_first_chunk::<32>() else {
        return false;
    };
    let Some((status, rest)) = rest.split_first_chunk::<2>() else {
        return false;
    };
    let Some((len, rest)) = rest.split_first_chunk::<4>() else {
        return false;
    };
    let Some((headers, body)) = rest.split_at_checked(u32::from_be_bytes(*len) as usize) else {
        return false;
    };
    let headers = std::str::from_utf8(headers).unwrap_or("");
    replays(fp, u16::from_be_bytes(*status), headers, body)
}

/// The Redis floor's key for `key`.
fn redis_key(key: &str) -> String {
    format!("floor:{key}")
}

/// The Redis floor's in-flight value: the fingerprint and the claim's token.
fn redis_in_flight(fp: &[u8; 32], token: i64) -> Vec<u8> {
    let mut value = Vec::with_capacity(40);
    value.extend_from_slice(fp);
    value.extend_from_slice(&token.to_be_bytes());
    value
}

/// The Redis floor's claim: `SET … NX` with a day's TTL; whether it claimed.
async fn redis_claim(conn: &mut RedisConn, key: &str, in_flight: &[u8]) -> bool {
    redis::cmd("SET")
        .arg(key)
        .arg(in_flight)
        .arg("NX")
        .arg("PX")
        .arg(86_400_000)
        .query_async::<Option<String>>(conn)
        .await
        .is_ok_and(|r| r.is_some())
}

/// The Redis floor's completion: stores the response if the key still holds this claim's
/// in-flight value (keeping its TTL) and answers `OK`; `nil` if not.
static FENCED_COMPLETE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then \
           return redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') \
         end \
         return false",
    )
});

/// The direct path to one backend.
#[derive(Clone)]
pub(crate) enum Floor {
    Memory(Arc<MemoryMap>),
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
    Mysql(sqlx::MySqlPool),
    Redis(RedisConn),
}

#[derive(Debug, Clone)]
pub(crate) struct FloorRecord {
    fingerprint: [u8; 32],
    token: i64,
    pub(crate) response: Option<Bytes>,
}

/// The memory floor's records.
pub(crate) type MemoryMap = Mutex<HashMap<String, FloorRecord>>;

/// The memory floor's claim: insert an in-flight record under `key` if there is none, under the
/// map's one lock.
pub(crate) fn memory_claim(map: &MemoryMap, key: &str, fingerprint: [u8; 32], token: i64) -> bool {
    let mut map = map.lock().expect("floor map");
    if map.contains_key(key) {
        return false;
    }
    map.insert(
        key.to_owned(),
        FloorRecord {
            fingerprint,
            token,
            response: None,
        },
    );
    true
}

/// The memory floor's completion: store `body` under `key` if its record is still this claim's
/// (`token`); whether it was.
pub(crate) fn memory_complete(map: &MemoryMap, key: &str, token: i64, body: Bytes) -> bool {
    let mut map = map.lock().expect("floor map");
    match map.get_mut(key) {
        Some(r) if r.token == token => {
            r.response = Some(body);
            true
        }
        _ => false,
    }
}

impl Floor {
    pub(crate) fn for_handle(handle: &Handle) -> Self {
        match handle {
            Handle::Memory(_) => Floor::Memory(Arc::default()),
            Handle::Sqlite(s) => Floor::Sqlite(s.pool().clone()),
            Handle::Postgres(s) => Floor::Postgres(s.pool().clone()),
            Handle::Mysql(s) => Floor::Mysql(s.pool().clone()),
            Handle::Redis(_, c) => Floor::Redis(RedisConn::One(c.clone())),
            Handle::RedisCluster(_, c) => Floor::Redis(RedisConn::Cluster(c.clone())),
        }
    }

    /// Claim (insert if absent) then complete (store the response under the token).
    pub(crate) async fn new_request(&self, key: &str) -> bool {
        let fp = fingerprint().0;
        // A fresh token per claim, drawn as idem draws its own, so the fence tells two claims apart.
        let token = FencingToken::generate().0;
        let now = now_ms();
        let body = response().body;
        match self {
            Floor::Memory(map) => {
                memory_claim(map, key, fp, token) && memory_complete(map, key, token, body)
            }
            Floor::Sqlite(pool) => {
                let claimed = sqlx::query(
                    "INSERT INTO idem_records (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until)
                     VALUES ('floor', ?1, ?2, ?3, ?4, ?5, ?5, 'in_flight', ?4) ON CONFLICT DO NOTHING",
                )
                .bind(key)
                .bind(&fp[..])
                .bind(token)
                .bind(now)
                .bind(now + 86_400_000)
                .execute(pool)
                .await;
                if !matches!(claimed, Ok(r) if r.rows_affected() == 1) {
                    return false;
                }
                sqlx::query(
                    "UPDATE idem_records SET state = 'completed', lease_until = NULL, status = 201, headers = ?3, body = ?4
                     WHERE scope = 'floor' AND key = ?1 AND token = ?2 AND state = 'in_flight'",
                )
                .bind(key)
                .bind(token)
                .bind(HEADERS_JSON)
                .bind(&body[..])
                .execute(pool)
                .await
                .is_ok_and(|r| r.rows_affected() == 1)
            }
            Floor::Postgres(pool) => {
                let claimed = sqlx::query(
                    "INSERT INTO idem.records (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until)
                     VALUES ('floor', $1, $2, $3, $4, $5, $5, 'in_flight', $4) ON CONFLICT DO NOTHING",
                )
                .bind(key)
                .bind(&fp[..])
                .bind(token)
                .bind(now)
                .bind(now + 86_400_000)
                .execute(pool)
                .await;
                if !matches!(claimed, Ok(r) if r.rows_affected() == 1) {
                    return false;
                }
                sqlx::query(
                    "UPDATE idem.records SET state = 'completed', lease_until = NULL, status = 201, headers = $3, body = $4
                     WHERE scope = 'floor' AND key = $1 AND token = $2 AND state = 'in_flight'",
                )
                .bind(key)
                .bind(token)
                .bind(HEADERS_JSON)
                .bind(&body[..])
                .execute(pool)
                .await
                .is_ok_and(|r| r.rows_affected() == 1)
            }
            Floor::Mysql(pool) => {
                // A plain insert: a duplicate key is an error, so nothing is claimed twice.
                let claimed = sqlx::query(
                    "INSERT INTO idem_records (scope, `key`, fingerprint, token, created_at, expires_at, retain_until, state, lease_until)
                     VALUES ('floor', ?, ?, ?, ?, ?, ?, 'in_flight', ?)",
                )
                .bind(key)
                .bind(&fp[..])
                .bind(token)
                .bind(now)
                .bind(now + 86_400_000)
                .bind(now + 86_400_000)
                .bind(now)
                .execute(pool)
                .await;
                if !matches!(claimed, Ok(r) if r.rows_affected() == 1) {
                    return false;
                }
                sqlx::query(
                    "UPDATE idem_records SET state = 'completed', lease_until = NULL, status = 201, headers = ?, body = ?
                     WHERE scope = 'floor' AND `key` = ? AND token = ? AND state = 'in_flight'",
                )
                .bind(HEADERS_JSON)
                .bind(&body[..])
                .bind(key)
                .bind(token)
                .execute(pool)
                .await
                .is_ok_and(|r| r.rows_affected() == 1)
            }
            Floor::Redis(conn) => {
                let mut conn = conn.clone();
                let k = redis_key(key);
                let in_flight = redis_in_flight(&fp, token);
                if !redis_claim(&mut conn, &k, &in_flight).await {
                    return false;
                }
                // The fence, as the SQL floors' `WHERE token = … AND state = 'in_flight'`: on
                // Redis 7.0 a conditional write takes a script.
                let mut complete = redis::cmd("EVALSHA");
                complete
                    .arg(FENCED_COMPLETE.get_hash())
                    .arg(1)
                    .arg(&k)
                    .arg(&in_flight)
                    .arg(redis_value(&fp, &body));
                let done = match complete.query_async::<Option<String>>(&mut conn).await {
                    Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                        let _ = FENCED_COMPLETE.load_async(&mut conn).await;
                        complete.query_async::<Option<String>>(&mut conn).await
                    }
                    done => done,
                };
                done.is_ok_and(|r| r.is_some())
            }
        }
    }

    /// PostgreSQL and Redis: a replay through the claim idem sends, issued directly. On PostgreSQL,
    /// idem's own claim statement (the read, and the insert branch PostgreSQL does not execute when
    /// the read finds the record) on the store's pool with the same binds, decoding the same columns
    /// as [`replay`](Self::replay); on Redis, `SET … NX GET PX` with the floor's in-flight value,
    /// decoding the value it returns. Beside the engine, it shows what the framework adds to its
    /// command; beside the bare read, what a command that can also claim costs.
    pub(crate) async fn replay_via_claim_statement(&self, key: &str) -> bool {
        let pool = match self {
            Floor::Postgres(pool) => pool,
            Floor::Redis(conn) => {
                let mut conn = conn.clone();
                return redis::cmd("SET")
                    .arg(redis_key(key))
                    .arg(redis_in_flight(&fingerprint().0, 1))
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(86_400_000)
                    .query_async::<Option<Vec<u8>>>(&mut conn)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|value| redis_replayed(&value));
            }
            _ => return false,
        };
        // The store's binds: durations in milliseconds, the server's clock, a lock timeout.
        sqlx::query(idem_runtime::store::postgres::testing::CLAIM_STATEMENT)
            .bind("floor")
            .bind(key)
            .bind(&fingerprint().0[..])
            .bind(1_i64)
            .bind(30_000_i64)
            .bind(86_400_000_i64)
            .bind(86_400_000_i64)
            .bind(None::<i64>)
            .bind(2_000_i64)
            .fetch_optional(pool)
            .await
            .ok()
            .flatten()
            .is_some_and(|row| {
                // Columns: rule, the store's time, fingerprint, token, three times, state, lease,
                // status, headers, body.
                row.try_get::<&str, _>(0).is_ok_and(|rule| rule == "keep")
                    && replayed(&row, [2, 9, 10, 11])
            })
    }

    /// Read a completed record by key.
    pub(crate) async fn replay(&self, key: &str) -> bool {
        match self {
            Floor::Memory(map) => map
                .lock()
                .expect("floor map")
                .get(key)
                .filter(|r| r.fingerprint == fingerprint().0)
                .and_then(|r| r.response.clone())
                .is_some(),
            Floor::Sqlite(pool) => sqlx::query(
                "SELECT fingerprint, status, headers, body FROM idem_records WHERE scope = 'floor' AND key = ?1",
            )
            .bind(key)
            .fetch_optional(pool)
            .await
            .ok()
            .flatten()
            .is_some_and(|row| replayed(&row, [0, 1, 2, 3])),
            Floor::Postgres(pool) => sqlx::query(
                "SELECT fingerprint, status, headers, body FROM idem.records WHERE scope = 'floor' AND key = $1",
            )
            .bind(key)
            .fetch_optional(pool)
            .await
            .ok()
            .flatten()
            .is_some_and(|row| replayed(&row, [0, 1, 2, 3])),
            // The headers read as bytes, as the store reads its text columns.
            Floor::Mysql(pool) => sqlx::query(
                "SELECT fingerprint, status, headers, body FROM idem_records WHERE scope = 'floor' AND `key` = ?",
            )
            .bind(key)
            .fetch_optional(pool)
            .await
            .ok()
            .flatten()
            .is_some_and(|row| {
                let (Ok(fp), Ok(status), Ok(headers), Ok(body)) = (
                    row.try_get::<&[u8], _>(0),
                    row.try_get::<i32, _>(1),
                    row.try_get::<&[u8], _>(2),
                    row.try_get::<&[u8], _>(3),
                ) else {
                    return false;
                };
                let headers = std::str::from_utf8(headers).unwrap_or("");
                replays(fp, status as u16, headers, body)
            }),
            Floor::Redis(conn) => {
                let mut conn = conn.clone();
                redis::cmd("GET")
                    .arg(redis_key(key))
                    .query_async::<Option<Vec<u8>>>(&mut conn)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|value| redis_replayed(&value))
            }
        }
    }
}
