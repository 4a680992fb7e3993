//! Each store's floor at scale: the store section's floor (`floors.rs`: a claim's insert and the
//! fenced completing update written directly; a replay read by primary key, or on PostgreSQL and
//! Redis through the claim command idem sends), here on any scope and on the seeded records, so
//! that the floor meets the same table or keyspace as the engine. On a Redis Cluster the same
//! commands go through the cluster connection, which routes each by its key.

use super::seed::{self, HEADERS_JSON};
use crate::floors;
use crate::stores::{Handle, RedisConn};
use idem_runtime::FencingToken;
use sqlx::Row;
use std::sync::LazyLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// The direct path to one store.
#[derive(Clone)]
pub(crate) enum Floor {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool),
    Redis(RedisConn, String),
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The Redis floor's completion: stores the response if the key still holds this claim's
/// in-flight value, keeping its TTL (Redis 7.0 has no conditional `SET` on a value).
static FENCED_COMPLETE: LazyLock<redis::Script> = LazyLock::new(|| {
    redis::Script::new(
        "if redis.call('GET', KEYS[1]) == ARGV[1] then \
           return redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') \
         end \
         return false",
    )
});

/// What a replay checks of the record it read: the fingerprint, and a response it could send.
fn replays(fp: &[u8], status: i32, headers: &str, body: &[u8]) -> bool {
    fp == floors::fingerprint().0
        && status == 201
        && idem_runtime::StoredResponse::decode_headers(headers).is_ok_and(|h| !h.is_empty())
        && !body.is_empty()
}

impl Floor {
    pub(crate) fn for_handle(handle: &Handle) -> Option<Self> {
        match handle {
            Handle::Sqlite(s) => Some(Floor::Sqlite(s.pool().clone())),
            Handle::Postgres(s) => Some(Floor::Postgres(s.pool().clone())),
            Handle::Redis(s, c) => Some(Floor::Redis(
                RedisConn::One(c.clone()),
                s.prefix().to_owned(),
            )),
            Handle::RedisCluster(s, c) => Some(Floor::Redis(
                RedisConn::Cluster(c.clone()),
                s.prefix().to_owned(),
            )),
            Handle::Memory(_) | Handle::Mysql(_) => None,
        }
    }

    /// A new key: the claim's insert, then the completion fenced by the claim's token.
    pub(crate) async fn new_request(&self, scope: &str, key: &str) -> bool {
        let fp = floors::fingerprint().0;
        let token = FencingToken::generate().0;
        let now = now_ms();
        let body = floors::response().body;
        match self {
            Floor::Sqlite(pool) => {
                let claimed = sqlx::query(
                    "INSERT INTO idem_records (scope, key, fingerprint, token, created_at, expires_at, retain_until, state, lease_until)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6, 'in_flight', ?5) ON CONFLICT DO NOTHING",
                )
                .bind(scope)
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
                    "UPDATE idem_records SET state = 'completed', lease_until = NULL, status = 201, headers = ?4, body = ?5
                     WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
                )
                .bind(scope)
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
                     VALUES ($1, $2, $3, $4, $5, $6, $6, 'in_flight', $5) ON CONFLICT DO NOTHING",
                )
                .bind(scope)
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
                    "UPDATE idem.records SET state = 'completed', lease_until = NULL, status = 201, headers = $4, body = $5
                     WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'",
                )
                .bind(scope)
                .bind(key)
                .bind(token)
                .bind(HEADERS_JSON)
                .bind(&body[..])
                .execute(pool)
                .await
                .is_ok_and(|r| r.rows_affected() == 1)
            }
            Floor::Redis(conn, prefix) => {
                let mut conn = conn.clone();
                let k = seed::redis_key(prefix, scope, key);
                let mut in_flight = fp.to_vec();
                in_flight.extend_from_slice(&token.to_be_bytes());
                let claimed = redis::cmd("SET")
                    .arg(&k)
                    .arg(&in_flight)
                    .arg("NX")
                    .arg("PX")
                    .arg(86_400_000)
                    .query_async::<Option<String>>(&mut conn)
                    .await
                    .is_ok_and(|r| r.is_some());
                if !claimed {
                    return false;
                }
                let mut value = fp.to_vec();
                value.extend_from_slice(HEADERS_JSON.as_bytes());
                value.extend_from_slice(&body);
                let mut complete = redis::cmd("EVALSHA");
                complete
                    .arg(FENCED_COMPLETE.get_hash())
                    .arg(1)
                    .arg(&k)
                    .arg(&in_flight)
                    .arg(value);
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

    /// A replay of a seeded completed record: SQLite reads it by primary key; PostgreSQL sends
    /// idem's claim statement with the same binds; Redis sends `SET … NX GET PX`, which answers
    /// with the record. Each checks the fingerprint and decodes what it would send.
    pub(crate) async fn replay(&self, scope: &str, key: &str) -> bool {
        match self {
            Floor::Sqlite(pool) => sqlx::query(
                "SELECT fingerprint, status, headers, body FROM idem_records WHERE scope = ?1 AND key = ?2",
            )
            .bind(scope)
            .bind(key)
            .fetch_optional(pool)
            .await
            .ok()
            .flatten()
            .is_some_and(|row| {
                matches!(
                    (row.try_get::<&[u8], _>(0), row.try_get::<i32, _>(1), row.try_get::<&str, _>(2), row.try_get::<&[u8], _>(3)),
                    (Ok(fp), Ok(status), Ok(headers), Ok(body)) if replays(fp, status, headers, body)
                )
            }),
            Floor::Postgres(pool) => sqlx::query(idem_runtime::store::postgres::testing::CLAIM_STATEMENT)
                .bind(scope)
                .bind(key)
                .bind(&floors::fingerprint().0[..])
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
                    row.try_get::<&str, _>(0).is_ok_and(|rule| rule == "keep")
                        && matches!(
                            (row.try_get::<&[u8], _>(2), row.try_get::<i32, _>(9), row.try_get::<&str, _>(10), row.try_get::<&[u8], _>(11)),
                            (Ok(fp), Ok(status), Ok(headers), Ok(body)) if replays(fp, status, headers, body)
                        )
                }),
            Floor::Redis(conn, prefix) => {
                let mut conn = conn.clone();
                let mut in_flight = floors::fingerprint().0.to_vec();
                in_flight.extend_from_slice(&1_i64.to_be_bytes());
                let value = redis::cmd("SET")
                    .arg(seed::redis_key(prefix, scope, key))
                    .arg(in_flight)
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(86_400_000)
                    .query_async::<Option<Vec<u8>>>(&mut conn)
                    .await
                    .ok()
                    .flatten();
                // The idem layout (blob.rs): state at 1, fingerprint at 43..75, status at 75..77.
                value.is_some_and(|v| {
                    v.len() > 81
                        && v[1] == b'D'
                        && v[43..75] == floors::fingerprint().0
                        && u16::from_be_bytes([v[75], v[76]]) == 201
                })
            }
        }
    }
}
