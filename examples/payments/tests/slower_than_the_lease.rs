//! A payment slower than its lease, in a process that stays alive: idem renews the lease while the
//! handler runs, so a duplicate that arrives after the first lease would have run out waits for the
//! payment and replays it instead of taking the key over and paying again.

use crate::support::*;
use std::time::Duration;

/// The payments policy's lease.
const LEASE: Duration = Duration::from_secs(10);

async fn a_duplicate_after_the_first_lease_waits_and_replays(stores: Stores) {
    // The card network answers after 12 s, longer than the lease.
    let instance = stores.start(&[("PAYMENT_LATENCY_MS", "12000")]);
    let client = client();
    let user = fresh_user();

    let original = tokio::spawn({
        let (client, base, user) = (client.clone(), instance.base().to_owned(), user.clone());
        async move { try_create(&client, &base, &user, &key(0), &body(0)).await }
    });
    until_charged(&client, &instance, &user, 1).await;
    // The key was claimed before the charge was seen, so its first lease is over by then + LEASE.
    // The scenario needs that much time to pass: this is not a synchronisation.
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    assert!(!original.is_finished(), "the payment still runs");

    let duplicate = until_replayed(&client, &instance, &user, 0).await;
    assert!(
        duplicate.iter().all(|r| r.status == 409 || r.replayed()),
        "the duplicate never ran the payment: {duplicate:?}"
    );
    let original = original.await.expect("join").expect("the original's reply");
    assert_eq!(original.status, 201, "{}", original.body);
    assert!(!original.replayed());
    assert_eq!(duplicate.last().expect("a replay").body, original.body);

    let effects = Effects::of(&client, &instance, &user).await;
    assert_eq!(
        effects.assert_each_once(1),
        [1],
        "the network was called once"
    );
    assert_eq!(original.json(), *effects.payment(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    a_duplicate_after_the_first_lease_waits_and_replays(Stores::sqlite().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    a_duplicate_after_the_first_lease_waits_and_replays(Stores::postgres().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql() {
    a_duplicate_after_the_first_lease_waits_and_replays(Stores::mysql().await).await;
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_redis() {
    a_duplicate_after_the_first_lease_waits_and_replays(Stores::redis_records().await).await;
}
