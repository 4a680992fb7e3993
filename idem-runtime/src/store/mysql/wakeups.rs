//! Waking waiters across instances: the task that polls the wake-up table.

use super::statements::*;
use super::{MAX_BACKOFF, MIN_BACKOFF, POLL_BATCH, POLL_INTERVAL, POLL_OVERLAP_MS};
use crate::record::RecordKey;
use crate::store::Waiters;
use sqlx::mysql::MySqlPool;
use sqlx::Row;
use std::collections::HashMap;
use std::sync::Arc;

/// The poller task: while this store has local waiters, reads the wake-ups written since the last
/// poll (less an overlap for rows that committed late) and wakes their keys, each row once. After an
/// error it wakes every waiter, since wake-ups may have been missed, and retries with backoff.
pub(super) async fn poll(pool: MySqlPool, waiters: Arc<Waiters>) {
    // Wake-ups already delivered, by id, with their `at`, kept while they may be read again.
    let mut seen: HashMap<u64, i64> = HashMap::new();
    // The latest `at` read, or the server's time when polling started.
    let mut from: Option<i64> = None;
    let mut backoff = MIN_BACKOFF;
    loop {
        tokio::time::sleep(POLL_INTERVAL).await;
        if waiters.waiting_keys() == 0 && from.is_some() {
            continue;
        }
        match poll_once(&pool, &waiters, &mut seen, &mut from).await {
            Ok(()) => backoff = MIN_BACKOFF,
            Err(e) => {
                tracing::warn!(
                    target: "idem", error = %e,
                    "idempotency store could not read wake-ups; retrying"
                );
                waiters.notify_all();
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

pub(super) async fn poll_once(
    pool: &MySqlPool,
    waiters: &Waiters,
    seen: &mut HashMap<u64, i64>,
    from: &mut Option<i64>,
) -> Result<(), sqlx::Error> {
    let since = match *from {
        Some(since) => since,
        // The first poll also reads what was written just before it: a waiter may have
        // subscribed, and its key been completed, before this task first ran.
        None => {
            let now: i64 = sqlx::query_scalar(SERVER_NOW).fetch_one(pool).await?;
            now.saturating_sub(POLL_OVERLAP_MS)
        }
    };
    let low = since.saturating_sub(POLL_OVERLAP_MS);
    let rows = sqlx::query(
        "SELECT id, scope, `key`, at FROM idem_wakeups WHERE at >= ? ORDER BY at, id LIMIT ?",
    )
    .bind(low)
    .bind(POLL_BATCH)
    .fetch_all(pool)
    .await?;
    let mut latest = since;
    for row in &rows {
        let id: u64 = row.try_get("id")?;
        let at: i64 = row.try_get("at")?;
        latest = latest.max(at);
        if seen.insert(id, at).is_some() {
            continue;
        }
        let scope: Vec<u8> = row.try_get("scope")?;
        let key: Vec<u8> = row.try_get("key")?;
        if let (Ok(scope), Ok(key)) = (String::from_utf8(scope), String::from_utf8(key)) {
            waiters.notify(&RecordKey::stored(scope, key));
        }
    }
    *from = Some(latest);
    let keep_from = latest.saturating_sub(POLL_OVERLAP_MS);
    seen.retain(|_, at| *at >= keep_from);
    Ok(())
}
