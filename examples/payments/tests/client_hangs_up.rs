//! A client hangs up while its payment runs, then retries with the same key: the payment is made
//! once (one charge, the card network called once, one payment) and the retry replays it. idem
//! runs a claimed handler in a task of its own, so a hang-up cancels nothing. On every store mode.

use crate::support::*;

/// The card network's latency: the hang-up comes while the handler waits on it.
const LATENCY: &str = "1500";

async fn a_hang_up_cancels_nothing_and_the_retry_replays(stores: Stores) {
    let instance = stores.start(&[("PAYMENT_LATENCY_MS", LATENCY)]);
    let client = client();
    let user = fresh_user();

    let connection = send_without_reading(&instance, &user, &key(0), &body(0)).await;
    // The handler has charged the card and waits for the network's answer: hang up (a reset).
    until_charged(&client, &instance, &user, 1).await;
    drop(connection);

    // The retry finds the first run still going, waits for it, and replays its payment.
    let replies = until_replayed(&client, &instance, &user, 0).await;
    assert_eq!(replies.len(), 1, "no second run: {replies:?}");
    let effects = Effects::of(&client, &instance, &user).await;
    assert_eq!(
        effects.assert_each_once(1),
        [1],
        "the network was called once"
    );
    assert_eq!(replies[0].json(), *effects.payment(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    a_hang_up_cancels_nothing_and_the_retry_replays(Stores::sqlite().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    a_hang_up_cancels_nothing_and_the_retry_replays(Stores::postgres().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql() {
    a_hang_up_cancels_nothing_and_the_retry_replays(Stores::mysql().await).await;
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_redis() {
    a_hang_up_cancels_nothing_and_the_retry_replays(Stores::redis_records().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_memory() {
    a_hang_up_cancels_nothing_and_the_retry_replays(Stores::memory().await).await;
}
