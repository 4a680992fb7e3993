//! The store's SQL statements, and how a record is read and decoded.

use super::{ER_DUP_ENTRY, ER_LOCK_DEADLOCK, ER_LOCK_WAIT_TIMEOUT};
use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use crate::store::StoreError;
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError, MySqlRow};
use sqlx::Row;
use std::time::Duration;

/// The server's time in milliseconds since the epoch, unless the statement's `?` in its place
/// carries the store's clock ([`MySqlStore::with_clock`]). Independent of the session's time zone.
macro_rules! now_ms {
    () => {
        "COALESCE(?, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    };
}

/// The server's time, never a clock's (for wake-ups, which only pollers read).
macro_rules! server_now_ms {
    () => {
        "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000)"
    };
}

macro_rules! record_columns {
    () => {
        "r.fingerprint, r.token, r.created_at, r.expires_at, r.retain_until, r.state, \
         r.lease_until, r.status, r.headers, r.body"
    };
}

/// The key's record, if any, and the store's time: binds the clock, scope and key.
pub(super) const READ: &str = concat!(
    "SELECT t.now_ms, ",
    record_columns!(),
    " FROM (SELECT ",
    now_ms!(),
    " AS now_ms) AS t LEFT JOIN idem_records AS r ON r.scope = ? AND r.`key` = ?"
);

/// [`READ`], locking the row (if any) until the transaction ends.
pub(super) const READ_FOR_UPDATE: &str = concat!(
    "SELECT t.now_ms, ",
    record_columns!(),
    " FROM (SELECT ",
    now_ms!(),
    " AS now_ms) AS t LEFT JOIN idem_records AS r ON r.scope = ? AND r.`key` = ? FOR UPDATE"
);

/// A fresh in-flight record, its instants from the store's time `n`, which `LAST_INSERT_ID(n)`
/// returns in the OK packet. Binds scope, key, fingerprint, token, ttl, retain, lease (ms), clock.
pub(super) const INSERT: &str = concat!(
    "INSERT INTO idem_records \
     (scope, `key`, fingerprint, token, created_at, expires_at, retain_until, state, lease_until) \
     SELECT ?, ?, ?, ?, LAST_INSERT_ID(t.n), t.n + ?, t.n + ?, 'in_flight', t.n + ? \
     FROM (SELECT ",
    now_ms!(),
    " AS n) AS t"
);

/// Writes a claim's in-flight record over the row the claim holds locked (takeover, resume or
/// replacement). `watched` is kept: a waiter that announced itself still waits for this key.
pub(super) const WRITE_CLAIM: &str = "
UPDATE idem_records
SET fingerprint = ?, token = ?, created_at = ?, expires_at = ?, retain_until = ?,
    state = 'in_flight', lease_until = ?, status = NULL, headers = NULL, body = NULL
WHERE scope = ? AND `key` = ?";

/// Completes the record in flight under the token; `LAST_INSERT_ID(watched)` hands the flag back.
pub(super) const COMPLETE: &str = "
UPDATE idem_records
SET state = 'completed', lease_until = NULL, status = ?, headers = ?, body = ?,
    watched = LAST_INSERT_ID(watched)
WHERE scope = ? AND `key` = ? AND token = ? AND state = 'in_flight'";

pub(super) const RELEASE: &str = "
UPDATE idem_records
SET state = 'released', lease_until = NULL, watched = LAST_INSERT_ID(watched)
WHERE scope = ? AND `key` = ? AND token = ? AND state = 'in_flight'";

pub(super) const RENEW: &str = concat!(
    "UPDATE idem_records SET lease_until = ",
    now_ms!(),
    " + ? WHERE scope = ? AND `key` = ? AND token = ? AND state = 'in_flight'"
);

/// Marks an in-flight record as awaited; only the first waiter writes. The row lock orders it
/// against the completing `UPDATE`: either that sees the flag and writes a wake-up, or it came
/// first and the waiter's next read sees the completion.
pub(super) const ANNOUNCE: &str = "
UPDATE idem_records SET watched = TRUE
WHERE scope = ? AND `key` = ? AND state = 'in_flight' AND NOT watched";

pub(super) const FORGET: &str = "
DELETE FROM idem_records WHERE scope = ? AND `key` = ? AND token = ? AND state = ?";

pub(super) const PURGE: &str = concat!(
    "DELETE FROM idem_records WHERE retain_until <= ",
    now_ms!(),
    " ORDER BY retain_until LIMIT ?"
);

pub(super) const NOW: &str = concat!("SELECT ", now_ms!());

pub(super) const SERVER_NOW: &str = concat!("SELECT ", server_now_ms!());

/// Wake-ups older than the retention (bound, in ms), at most a batch (bound).
pub(super) const PURGE_WAKEUPS: &str = concat!(
    "DELETE FROM idem_wakeups WHERE at < ",
    server_now_ms!(),
    " - ? ORDER BY at LIMIT ?"
);

/// Whether a claim attempt that failed with `e` should simply run again: another claim inserted
/// the key first, or InnoDB chose it as a deadlock victim or its lock wait timed out (each rolls
/// back the statement or transaction, so nothing was granted).
pub(super) fn retried(e: &sqlx::Error) -> bool {
    let number = e
        .as_database_error()
        .and_then(|e| e.try_downcast_ref::<MySqlDatabaseError>())
        .map(MySqlDatabaseError::number);
    matches!(
        number,
        Some(ER_DUP_ENTRY | ER_LOCK_DEADLOCK | ER_LOCK_WAIT_TIMEOUT)
    )
}

/// A duration in whole milliseconds, bounded so that adding it to a time cannot overflow BIGINT.
pub(super) fn millis(d: Duration) -> i64 {
    const MAX: i64 = 1 << 52;
    i64::try_from(d.as_millis()).unwrap_or(MAX).min(MAX)
}

/// Runs [`READ`] or [`READ_FOR_UPDATE`] for `key`.
pub(super) async fn read(
    conn: &mut MySqlConnection,
    sql: &'static str,
    key: &RecordKey,
    clock_ms: Option<i64>,
) -> Result<(Option<Record>, Timestamp), StoreError> {
    let row = sqlx::query(sql)
        .bind(clock_ms)
        .bind(key.scope().as_bytes())
        .bind(key.key().as_bytes())
        .fetch_one(&mut *conn)
        .await?;
    decode_read(&row)
}

/// The store's time and the record (if the join found one) of a [`READ`] row.
pub(super) fn decode_read(row: &MySqlRow) -> Result<(Option<Record>, Timestamp), StoreError> {
    let now: i64 = row.try_get("now_ms").map_err(StoreError::corrupt)?;
    let token: Option<i64> = row.try_get("token").map_err(StoreError::corrupt)?;
    let record = match token {
        Some(_) => Some(decode(row)?),
        None => None,
    };
    Ok((record, Timestamp::from_millis(now)))
}

/// Decodes a row of the record columns.
pub(super) fn decode(row: &MySqlRow) -> Result<Record, StoreError> {
    let get_i64 = |column: &str| -> Result<i64, StoreError> {
        row.try_get::<i64, _>(column).map_err(StoreError::corrupt)
    };
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(StoreError::corrupt)?;
    let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
        .map(Fingerprint)
        .map_err(|_| {
            StoreError::corrupt(format!(
                "fingerprint of {} bytes, expected 32",
                fingerprint.len()
            ))
        })?;
    // Text read as bytes: a join's result columns may come back with the binary character set.
    let text = |column: &str| -> Result<String, StoreError> {
        let bytes: Vec<u8> = row.try_get(column).map_err(StoreError::corrupt)?;
        String::from_utf8(bytes).map_err(StoreError::corrupt)
    };
    let state = text("state")?;
    let state = match state.as_str() {
        "in_flight" => RecordState::InFlight {
            lease_until: Timestamp::from_millis(get_i64("lease_until")?),
        },
        "completed" => {
            let status: i32 = row.try_get("status").map_err(StoreError::corrupt)?;
            let headers = text("headers")?;
            let body: Vec<u8> = row.try_get("body").map_err(StoreError::corrupt)?;
            RecordState::Completed {
                response: StoredResponse {
                    status: u16::try_from(status).map_err(StoreError::corrupt)?,
                    headers: StoredResponse::decode_headers(&headers)
                        .map_err(StoreError::corrupt)?,
                    body: body.into(),
                },
            }
        }
        "released" => RecordState::Released,
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

    #[test]
    fn durations_cannot_overflow_a_bigint_time() {
        assert_eq!(millis(Duration::from_millis(1500)), 1500);
        assert!(millis(Duration::MAX) < i64::MAX / 2);
    }

    #[test]
    fn every_statement_that_judges_time_can_take_the_stores_clock() {
        for sql in [READ, READ_FOR_UPDATE, INSERT, RENEW, PURGE, NOW] {
            assert!(sql.contains("COALESCE(?, TIMESTAMPDIFF"), "{sql}");
        }
    }
}
