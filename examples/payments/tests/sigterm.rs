//! `SIGTERM` (a deploy) while payments run: the process stops accepting, finishes the payments in
//! flight and answers their clients, then exits 0; a process started next on the same stores
//! replays every one of them. A payment whose client hung up is finished and stored before the exit
//! too, with no client left to keep the process waiting. Each payment is charged once and paid once.

use crate::support::*;
use std::time::Duration;

/// Payments in flight, their clients waiting, when the first process gets the signal. Payment
/// number `KEYS` is in flight, its client gone, when the second one gets it.
const KEYS: usize = 20;

/// Bounds the wait for the exit, only to fail instead of hanging (the default grace period is 25 s).
const EXIT_BOUND: Duration = Duration::from_secs(60);

async fn sigterm_finishes_the_payments_in_flight_then_exits_0(stores: Stores) {
    let latency = [("PAYMENT_LATENCY_MS", "1500")];
    let mut first = stores.start(&latency);
    let client = client();
    let user = fresh_user();
    let sends: Vec<_> = (0..KEYS)
        .map(|i| {
            let (client, base, user) = (client.clone(), first.base().to_owned(), user.clone());
            tokio::spawn(async move { try_create(&client, &base, &user, &key(i), &body(i)).await })
        })
        .collect();
    until_charged(&client, &first, &user, KEYS).await;
    first.terminate();
    let mut originals = Vec::new();
    for send in sends {
        let reply = send.await.expect("join").expect("answered before the exit");
        assert_eq!(reply.status, 201, "{}", reply.body);
        assert!(!reply.replayed());
        originals.push(reply);
    }
    let status = first.exit_status(EXIT_BOUND).await;
    assert_eq!(status.code(), Some(0), "{status}");

    let mut second = stores.start(&latency);
    for (i, original) in originals.iter().enumerate() {
        let retry = create(&client, &second, &user, &key(i), &body(i)).await;
        assert_eq!(retry.status, 201, "{}", retry.body);
        assert!(retry.replayed(), "{}: {retry:?}", key(i));
        assert_eq!(retry.body, original.body);
    }
    let gone = send_without_reading(&second, &user, &key(KEYS), &body(KEYS)).await;
    until_charged(&client, &second, &user, KEYS + 1).await;
    drop(gone);
    second.terminate();
    let status = second.exit_status(EXIT_BOUND).await;
    assert_eq!(status.code(), Some(0), "{status}");

    let third = stores.start(&[]);
    let retry = create(&client, &third, &user, &key(KEYS), &body(KEYS)).await;
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert!(retry.replayed(), "finished before the exit: {retry:?}");
    let effects = Effects::of(&client, &third, &user).await;
    assert_eq!(effects.assert_each_once(KEYS + 1), [1; KEYS + 1]);
    assert_eq!(retry.json(), *effects.payment(KEYS));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    sigterm_finishes_the_payments_in_flight_then_exits_0(Stores::sqlite().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    sigterm_finishes_the_payments_in_flight_then_exits_0(Stores::postgres().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql() {
    sigterm_finishes_the_payments_in_flight_then_exits_0(Stores::mysql().await).await;
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_redis() {
    sigterm_finishes_the_payments_in_flight_then_exits_0(Stores::redis_records().await).await;
}
