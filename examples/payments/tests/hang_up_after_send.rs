//! Clients that hang up right after sending (a raw socket closed with a reset, at jittered moments:
//! before the server read the request, while it claims the key, while the handler runs), each
//! followed at once by its retry: every retry gets its payment without waiting for a lease held by
//! nobody, and each key is charged and recorded once. idem runs the claim itself in a task of its
//! own and gives back a claim whose request is gone, so no moment of a hang-up strands a key. On
//! every store.

use crate::support::*;
use std::time::Duration;

const KEYS: usize = 24;

/// When the client hangs up after sending: at once, or after a pause of up to 2 ms.
fn jitter(i: usize) -> Duration {
    Duration::from_micros([0, 0, 20, 100, 300, 700, 1_200, 2_000][i % 8])
}

async fn hang_ups_strand_no_key(stores: Stores) {
    let instance = stores.start(&[]);
    let client = client();
    let user = fresh_user();
    for i in 0..KEYS {
        let connection = send_without_reading(&instance, &user, &key(i), &body(i)).await;
        let pause = jitter(i);
        if !pause.is_zero() {
            tokio::time::sleep(pause).await; // the moment of the hang-up, not a synchronisation
        }
        drop(connection);
        let retry = create(&client, &instance, &user, &key(i), &body(i)).await;
        assert_eq!(retry.status, 201, "key {i}: {}", retry.body);
    }
    let effects = Effects::of(&client, &instance, &user).await;
    let attempts = effects.assert_each_once(KEYS);
    assert!(
        attempts.iter().all(|a| *a == 1),
        "the network was called once per key: {:?}",
        histogram(&attempts)
    );
    // A retry that met a claim held by nobody would have waited out `wait` and got 409, or taken
    // the key over once the lease ran out: neither happened.
    let scraped = get(&client, &instance, &user, "/metrics").await;
    for outcome in ["conflict", "taken_over"] {
        let line =
            format!(r#"idem_requests_total{{handler="create_payment",outcome="{outcome}"}}"#);
        let count = scraped
            .body
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .map_or(0.0, |n| n.trim().parse::<f64>().expect("a count"));
        assert_eq!(count, 0.0, "{outcome}:\n{}", scraped.body);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    hang_ups_strand_no_key(Stores::sqlite().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_transactional() {
    hang_ups_strand_no_key(Stores::postgres().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql_transactional() {
    hang_ups_strand_no_key(Stores::mysql().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_records() {
    hang_ups_strand_no_key(Stores::postgres_records().await).await;
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_redis() {
    hang_ups_strand_no_key(Stores::redis_records().await).await;
}

#[cfg_attr(
    skip_redis_cluster,
    ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_a_redis_cluster() {
    hang_ups_strand_no_key(Stores::redis_cluster_records().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_memory() {
    hang_ups_strand_no_key(Stores::memory().await).await;
}
