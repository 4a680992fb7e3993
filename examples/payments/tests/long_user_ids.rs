//! A caller id of 3,000 characters (a long bearer token taken for a user id) gets a final answer on
//! every store and ledger mode: 201, then replays, one charge and one payment. Never a 5xx that no
//! retry can fix: idem bounds the record key, and the ledger indexes the owner by hash, which has
//! no length limit.

use crate::support::*;

async fn a_long_user_id_pays_once_and_replays(stores: Stores) {
    let instance = stores.start(&[]);
    let client = client();
    // Random, so that no compression brings it under an index's row limit.
    let random: String = (0..94)
        .map(|_| uuid::Uuid::new_v4().simple().to_string())
        .collect();
    let user = format!("{}{}", fresh_user(), &random[..3000]);
    let first = create(&client, &instance, &user, &key(0), &body(0)).await;
    assert_eq!(first.status, 201, "{}", first.body);
    let retry = create(&client, &instance, &user, &key(0), &body(0)).await;
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert!(retry.replayed());
    assert_eq!(retry.json(), first.json());
    let effects = Effects::of(&client, &instance, &user).await;
    assert_eq!(effects.assert_each_once(1), [1], "one charge, charged once");
    assert_eq!(*effects.payment(0), first.json());
    // Another caller whose id differs only past the stored head is another caller.
    let other = format!("{user}v");
    let theirs = create(&client, &instance, &other, &key(0), &body(0)).await;
    assert_eq!(theirs.status, 201, "{}", theirs.body);
    assert!(!theirs.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    a_long_user_id_pays_once_and_replays(Stores::sqlite().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_transactional() {
    a_long_user_id_pays_once_and_replays(Stores::postgres().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_transactional() {
    a_long_user_id_pays_once_and_replays(Stores::mysql().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_records() {
    a_long_user_id_pays_once_and_replays(Stores::postgres_records().await).await;
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_redis() {
    a_long_user_id_pays_once_and_replays(Stores::redis_records().await).await;
}

#[cfg_attr(
    skip_redis_cluster,
    ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_a_redis_cluster() {
    a_long_user_id_pays_once_and_replays(Stores::redis_cluster_records().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_memory() {
    a_long_user_id_pays_once_and_replays(Stores::memory().await).await;
}
