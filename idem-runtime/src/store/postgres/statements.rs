//! The store's SQL statements, how each is bound and run, and how its rows are read.

use super::listen::payload;
use super::MAX_CLAIM_ATTEMPTS;
use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use crate::store::{Claim, ClaimOutcome, Claimed, Found, StoreError};
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::Row;
use std::time::Duration;

/// The store's time in milliseconds since the Unix epoch: the instant bound as `$n` (a store given
/// a clock) or, when that is NULL, the server's `clock_timestamp()`. Every statement computes it
/// once (in a CTE, which PostgreSQL materialises since it calls a volatile function) and judges
/// and stamps by it alone.
macro_rules! now_ms {
    ($n:literal) => {
        concat!(
            "coalesce($",
            $n,
            "::bigint, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)"
        )
    };
}

/// Bounds the statement's row-lock waits to `$n` milliseconds ([`DEFAULT_LOCK_TIMEOUT`]): local
/// to the transaction, which for an autocommit statement is the statement. Joined to the rows a
/// statement writes, so it is set before any row reaches the lock.
macro_rules! bound_locks {
    ($n:literal) => {
        concat!("set_config('lock_timeout', $", $n, "::bigint::text, true)")
    };
}

/// Claim-or-fetch, one statement: the key's record when [`Claim::decide`] keeps it at the store's
/// time (a replay: a primary-key read, nothing written), and otherwise what `idem.claim` (see its
/// migration) made of the key, deciding again on the latest version under its lock. Binds: scope,
/// key, fingerprint, token, lease, ttl, retain (milliseconds, retain at least ttl), the store's
/// time or NULL, the lock timeout.
pub(super) const CLAIM: &str = concat!(
    "
WITH now AS (SELECT ",
    now_ms!("8"),
    " AS ms)
(SELECT 'keep'::text AS rule, now.ms AS store_now, r.fingerprint, r.token, r.created_at,
        r.expires_at, r.retain_until, r.state, r.lease_until, r.status, r.headers, r.body
 FROM idem.records AS r, now
 WHERE r.scope = $1 AND r.key = $2 AND r.retain_until > now.ms AND r.state <> 'released'
   AND NOT (r.state = 'in_flight' AND r.fingerprint = $3 AND now.ms < r.expires_at
            AND r.lease_until <= now.ms))
UNION ALL
(SELECT c.* FROM now, idem.claim($1, $2, $3, $4, $5, $6, $7, now.ms, $9) AS c)
LIMIT 1"
);

/// `sql` (the claim statement, or a statement around it such as an `EXPLAIN`) with a claim's nine
/// binds (see [`CLAIM`]).
pub(crate) fn bind_claim<'q>(
    sql: &'q str,
    claim: &Claim<'q>,
    now: Option<Timestamp>,
    lock_timeout_ms: i64,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(claim.key.scope())
        .bind(claim.key.key())
        .bind(claim.fingerprint.0.to_vec())
        .bind(claim.token.0)
        .bind(millis(claim.lease))
        .bind(millis(claim.ttl))
        .bind(millis(claim.retain.max(claim.ttl)))
        .bind(now.map(Timestamp::as_millis))
        .bind(lock_timeout_ms)
}

/// `duration` in whole milliseconds, saturated.
pub(super) fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

pub(super) const COMPLETE: &str = concat!(
    "
WITH bound AS (SELECT ",
    bound_locks!("8"),
    "),
completed AS (
    UPDATE idem.records AS r
    SET state = 'completed', lease_until = NULL, status = $4, headers = $5, body = $6
    FROM bound
    WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.state = 'in_flight'
    RETURNING r.watched
)
SELECT CASE WHEN watched THEN pg_notify('idem_records', $7) END FROM completed"
);

/// The record stays, released: its times kept, no lease, for its request's retry to resume.
pub(super) const RELEASE: &str = concat!(
    "
WITH bound AS (SELECT ",
    bound_locks!("5"),
    "),
released AS (
    UPDATE idem.records AS r
    SET state = 'released', lease_until = NULL
    FROM bound
    WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.state = 'in_flight'
    RETURNING r.watched
)
SELECT CASE WHEN watched THEN pg_notify('idem_records', $4) END FROM released"
);

pub(super) const RENEW: &str = concat!(
    "
WITH now AS (SELECT ",
    now_ms!("5"),
    " AS ms, ",
    bound_locks!("6"),
    ")
UPDATE idem.records AS r SET lease_until = now.ms + $4
FROM now
WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.state = 'in_flight'"
);

/// Marks an in-flight record as awaited. Only the first waiter writes (and commits a change); later
/// ones find the flag set and write nothing. The row lock orders this against the completing `UPDATE`,
/// which reads the row's latest version: either it sees the flag and notifies, or it committed first
/// and the waiter's next read sees the completion.
pub(super) const ANNOUNCE: &str = concat!(
    "
WITH bound AS (SELECT ",
    bound_locks!("3"),
    ")
UPDATE idem.records AS r SET watched = true
FROM bound
WHERE r.scope = $1 AND r.key = $2 AND r.state = 'in_flight' AND NOT r.watched"
);

pub(super) const GET: &str = concat!(
    "
WITH now AS (SELECT ",
    now_ms!("3"),
    " AS ms)
SELECT now.ms AS store_now, r.fingerprint, r.token, r.created_at, r.expires_at, r.retain_until,
       r.state, r.lease_until, r.status, r.headers, r.body
FROM idem.records AS r, now
WHERE r.scope = $1 AND r.key = $2 AND r.retain_until > now.ms"
);

/// The rows are picked oldest first through the `retain_until` index and locked by the same statement
/// (skipping rows a claim holds), so their `ctid`s stay valid for the delete: a TID scan whatever the
/// backlog, where a join back on the key may scan every expired row for each batch.
pub(super) const PURGE: &str = concat!(
    "
WITH now AS (SELECT ",
    now_ms!("1"),
    " AS ms)
DELETE FROM idem.records
WHERE ctid = ANY (ARRAY(
    SELECT ctid FROM idem.records
    WHERE retain_until <= (SELECT ms FROM now)
    ORDER BY retain_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
))
AND retain_until <= (SELECT ms FROM now)"
);

/// Deletes the record if it is still as the caller read it (token and state), waking its waiters.
pub(super) const FORGET: &str = concat!(
    "
WITH bound AS (SELECT ",
    bound_locks!("6"),
    "),
gone AS (
    DELETE FROM idem.records AS r
    USING bound
    WHERE r.scope = $1 AND r.key = $2 AND r.token = $3 AND r.state = $4
    RETURNING r.watched
)
SELECT CASE WHEN watched THEN pg_notify('idem_records', $5) END FROM gone"
);

/// At most a batch of the scope's records, through the primary key's `scope` prefix, locked first
/// (a record another statement deletes meanwhile is skipped, and the next one taken, so that a
/// short batch means the scope is empty); returns each key, notifying those awaited.
pub(super) const ERASE: &str = concat!(
    "
WITH bound AS (SELECT ",
    bound_locks!("3"),
    "),
gone AS (
    DELETE FROM idem.records AS r
    WHERE r.scope = $1 AND r.key IN (
        SELECT e.key FROM idem.records AS e, bound
        WHERE e.scope = $1
        LIMIT $2
        FOR UPDATE OF e
    )
    RETURNING r.key, r.watched
)
SELECT key, CASE WHEN watched THEN pg_notify('idem_records', json_build_array($1::text, key)::text)
            END AS notified
FROM gone"
);

/// The in-flight records created at least `$1` ms before the store's time, oldest first; one row
/// with NULL record columns when there is none, so that the store's time always comes back.
pub(super) const LIST_IN_FLIGHT: &str = concat!(
    "
WITH now AS (SELECT ",
    now_ms!("3"),
    " AS ms)
SELECT now.ms AS store_now, l.*
FROM now LEFT JOIN LATERAL (
    SELECT r.scope, r.key, r.fingerprint, r.token, r.created_at, r.expires_at, r.retain_until,
           r.state, r.lease_until, r.status, r.headers, r.body
    FROM idem.records AS r
    WHERE r.state = 'in_flight' AND r.retain_until > now.ms AND r.created_at <= now.ms - $1
    ORDER BY r.created_at, r.scope COLLATE \"C\", r.key COLLATE \"C\"
    LIMIT $2
) AS l ON true
ORDER BY l.created_at, l.scope COLLATE \"C\", l.key COLLATE \"C\""
);

/// [`Stats::count`] in SQL: past retention first, then released, then past expiry, then by state.
pub(super) const STATS: &str = concat!(
    "
WITH now AS (SELECT ",
    now_ms!("1"),
    " AS ms)
SELECT now.ms AS store_now,
       count(*) FILTER (WHERE r.retain_until <= now.ms) AS forgotten,
       count(*) FILTER (WHERE r.retain_until > now.ms AND r.state = 'released') AS released,
       count(*) FILTER (WHERE r.retain_until > now.ms AND r.state <> 'released'
                              AND now.ms >= r.expires_at) AS expired,
       count(*) FILTER (WHERE r.retain_until > now.ms AND r.state = 'completed'
                              AND now.ms < r.expires_at) AS completed,
       count(*) FILTER (WHERE r.retain_until > now.ms AND r.state = 'in_flight'
                              AND now.ms < r.expires_at) AS in_flight,
       min(r.created_at) FILTER (WHERE r.retain_until > now.ms AND r.state = 'in_flight'
                                       AND now.ms < r.expires_at) AS oldest_in_flight
FROM now LEFT JOIN idem.records AS r ON true
GROUP BY now.ms"
);

/// Claims with [`CLAIM`]: one statement decides, at the store's time (`now`, or the server's
/// clock). It returns nothing only if a record that blocked the insert was deleted before it
/// could be locked; it then runs again.
pub(super) async fn claim(
    conn: &mut PgConnection,
    claim: &Claim<'_>,
    now: Option<Timestamp>,
    lock_timeout_ms: i64,
) -> Result<ClaimOutcome, StoreError> {
    for _ in 0..MAX_CLAIM_ATTEMPTS {
        let row = bind_claim(CLAIM, claim, now, lock_timeout_ms)
            .fetch_optional(&mut *conn)
            .await?;
        let Some(row) = row else { continue };
        let rule: &str = row.try_get("rule").map_err(StoreError::corrupt)?;
        let taken_over = match rule {
            "keep" => return found(&row).map(ClaimOutcome::Existing),
            "take_over" => true,
            "insert" | "resume" => false,
            other => return Err(StoreError::corrupt(format!("unknown claim rule {other:?}"))),
        };
        let time = |column: &str| -> Result<Timestamp, StoreError> {
            let ms: i64 = row.try_get(column).map_err(StoreError::corrupt)?;
            Ok(Timestamp::from_millis(ms))
        };
        return Ok(ClaimOutcome::Claimed(Claimed {
            taken_over,
            created_at: time("created_at")?,
            expires_at: time("expires_at")?,
        }));
    }
    Err(StoreError::unavailable(format!(
        "claim of {} did not settle after {MAX_CLAIM_ATTEMPTS} attempts under concurrent changes",
        claim.key
    )))
}

pub(super) async fn complete(
    conn: &mut PgConnection,
    key: &RecordKey,
    token: FencingToken,
    response: &StoredResponse,
    lock_timeout_ms: i64,
) -> Result<(), StoreError> {
    // `SELECT CASE … pg_notify(...) END FROM completed` returns one row per completed record,
    // notified or not.
    let done = sqlx::query(COMPLETE)
        .bind(key.scope())
        .bind(key.key())
        .bind(token.0)
        .bind(i32::from(response.status))
        .bind(response.encode_headers())
        .bind(response.body.as_ref())
        .bind(payload(key))
        .bind(lock_timeout_ms)
        .execute(&mut *conn)
        .await?;
    fenced_unless_one(done.rows_affected())
}

/// The store's time a statement read by (its `store_now` column).
pub(super) fn store_now(row: &PgRow) -> Result<Timestamp, StoreError> {
    let ms: i64 = row.try_get("store_now").map_err(StoreError::corrupt)?;
    Ok(Timestamp::from_millis(ms))
}

/// A row of the record columns and the store's time.
pub(super) fn found(row: &PgRow) -> Result<Found, StoreError> {
    Ok(Found {
        record: decode(row)?,
        now: store_now(row)?,
    })
}

pub(super) fn fenced_unless_one(rows: u64) -> Result<(), StoreError> {
    if rows == 1 {
        Ok(())
    } else {
        Err(StoreError::fenced())
    }
}

/// Decodes a row of the record columns.
pub(super) fn decode(row: &PgRow) -> Result<Record, StoreError> {
    let get_i64 = |column: &str| -> Result<i64, StoreError> {
        row.try_get::<i64, _>(column).map_err(StoreError::corrupt)
    };
    // Borrowed where the row's own bytes do (fingerprint, state, headers): no copy to drop again.
    let fingerprint: &[u8] = row.try_get("fingerprint").map_err(StoreError::corrupt)?;
    let fingerprint = <[u8; 32]>::try_from(fingerprint)
        .map(Fingerprint)
        .map_err(|_| {
            StoreError::corrupt(format!(
                "fingerprint of {} bytes, expected 32",
                fingerprint.len()
            ))
        })?;
    let state: &str = row.try_get("state").map_err(StoreError::corrupt)?;
    let state = match state {
        "released" => RecordState::Released,
        "in_flight" => RecordState::InFlight {
            lease_until: Timestamp::from_millis(get_i64("lease_until")?),
        },
        "completed" => {
            let status: i32 = row.try_get("status").map_err(StoreError::corrupt)?;
            let headers: &str = row.try_get("headers").map_err(StoreError::corrupt)?;
            let body: Vec<u8> = row.try_get("body").map_err(StoreError::corrupt)?;
            RecordState::Completed {
                response: StoredResponse {
                    status: u16::try_from(status).map_err(StoreError::corrupt)?,
                    headers: StoredResponse::decode_headers(headers)
                        .map_err(StoreError::corrupt)?,
                    body: body.into(),
                },
            }
        }
        other => return Err(StoreError::corrupt(format!("unknown state {other:?}"))),
    };
    Ok(Record {
        fingerprint,
        token: FencingToken(get_i64("token")?),
        created_at: Timestamp::from_millis(get_i64("created_at")?),
        expires_at: Timestamp::from_millis(get_i64("expires_at")?),
        retain_until: Timestamp::from_millis(get_i64("retain_until")?),
        state,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::postgres::CHANNEL;

    #[test]
    fn completion_and_release_notify_on_the_listened_channel() {
        for sql in [COMPLETE, RELEASE] {
            assert!(sql.contains(&format!("pg_notify('{CHANNEL}'")), "{sql}");
        }
    }
}
