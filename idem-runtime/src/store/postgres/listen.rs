//! Waking waiters across instances: the notification's payload, and the task that listens.

use super::{CHANNEL, MAX_BACKOFF, MIN_BACKOFF};
use crate::record::RecordKey;
use crate::store::Waiters;
use sqlx::postgres::{PgListener, PgPool};
use std::sync::Arc;

/// The notification payload for `key`: `[scope, key]` as JSON. Both parts are bounded
/// ([`RecordKey::MAX_PART`]), so it stays far below PostgreSQL's 8000-byte limit.
pub(super) fn payload(key: &RecordKey) -> String {
    serde_json::to_string(&(key.scope(), key.key())).unwrap_or_default()
}

/// Wakes the waiters a notification payload names.
fn deliver(waiters: &Waiters, payload: &str) {
    match serde_json::from_str::<(String, String)>(payload) {
        Ok((scope, key)) => waiters.notify(&RecordKey::stored(scope, key)),
        Err(e) => tracing::debug!(
            target: "idem", error = %e, "ignoring a malformed notification on {CHANNEL}"
        ),
    }
}

/// The listener task: forwards notifications on [`CHANNEL`] to `waiters`, reconnecting with backoff.
///
/// `listening` is told when the listener first listens. If nobody receives that (the constructor did
/// not wait, or gave up), waiters may have subscribed before, and they are woken to re-read their
/// records; so they are after every reconnection.
pub(super) async fn listen(
    pool: PgPool,
    waiters: Arc<Waiters>,
    listening: tokio::sync::oneshot::Sender<()>,
) {
    let mut listening = Some(listening);
    let mut backoff = MIN_BACKOFF;
    loop {
        match PgListener::connect_with(&pool).await {
            Ok(mut listener) => match listener.listen(CHANNEL).await {
                Ok(()) => {
                    backoff = MIN_BACKOFF;
                    // Unless the constructor is still waiting for this (no subscriber can exist
                    // yet), anything announced before now may have been missed: every waiter
                    // re-reads its record.
                    let awaited = listening.take().is_some_and(|tx| tx.send(()).is_ok());
                    if !awaited {
                        waiters.notify_all();
                    }
                    loop {
                        match listener.try_recv().await {
                            Ok(Some(notification)) => deliver(&waiters, notification.payload()),
                            // The connection dropped and was re-established: some may be lost.
                            Ok(None) => waiters.notify_all(),
                            Err(e) => {
                                tracing::warn!(
                                    target: "idem", error = %e,
                                    "idempotency store listener lost its connection; reconnecting"
                                );
                                break;
                            }
                        }
                    }
                }
                Err(e) => tracing::warn!(
                    target: "idem", error = %e, "idempotency store listener could not LISTEN"
                ),
            },
            Err(e) => tracing::warn!(
                target: "idem", error = %e, "idempotency store listener could not connect"
            ),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn payload_names_the_key_or_wakes_all_when_too_long() {
        let key = RecordKey::new("tenant \"7\"", "k/1");
        let p = payload(&key);
        assert_eq!(
            serde_json::from_str::<(String, String)>(&p).unwrap(),
            (key.scope().to_owned(), key.key().to_owned())
        );
        // The longest parts, each character escaped as six bytes, are still far below the limit.
        let huge = RecordKey::new("\u{1}".repeat(10_000), "\u{1}".repeat(10_000));
        assert!(payload(&huge).len() < 8000);
    }

    #[tokio::test]
    async fn deliver_wakes_the_named_key_only() {
        let waiters = Waiters::new();
        let a = RecordKey::new("s", "a");
        let b = RecordKey::new("s", "b");
        let mut sub_a = waiters.subscribe(&a);
        let mut sub_b = waiters.subscribe(&b);
        deliver(&waiters, &payload(&a));
        sub_a.changed().await;
        let b_woken = tokio::time::timeout(Duration::ZERO, sub_b.changed()).await;
        assert!(b_woken.is_err(), "only a was named");
        deliver(&waiters, "not json");
        deliver(&waiters, &payload(&b));
        sub_b.changed().await;
    }
}
