//! Two processes of the payments binary share one PostgreSQL database (ledger and records), and
//! again with the records in Redis, and in a Redis Cluster: identical requests split between them
//! make one payment, and a retry that lands on the other instance replays; also with the records in
//! MySQL/MariaDB.
//!
//! Each test gets a fresh database (and Redis or Redis Cluster key prefix), removed when it ends; the processes are
//! killed when it ends, also on failure. Without the services the tests fail, saying how to start
//! them, unless `IDEM_TEST_SKIP` names them (see README.md).

use crate::support::*;
use idem_runtime::sqlx::{self, mysql::MySqlPool, postgres::PgPool};
use idem_tests::services::{MySqlTestDb, RedisClusterPrefix, RedisPrefix, TestDb};
use std::sync::Arc;

/// Sends 16 identical creates at once, alternating between `instances`, and checks that they are
/// one payment: every reply is that payment's 201, exactly one was executed (the others replayed),
/// and every instance's `GET /payments` and the ledger table hold one payment. Returns the reply.
async fn sixteen_identical_creates_make_one_payment(
    instances: &[Instance],
    ledger: &impl LedgerRows,
) -> Reply {
    let client = client();
    let user = fresh_user();
    let key = "order-16";
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let sends = (0..16).map(|i| {
        let (client, user, barrier) = (client.clone(), user.clone(), barrier.clone());
        let instance = &instances[i % instances.len()];
        async move {
            barrier.wait().await;
            create(&client, instance, &user, key, KRW_1000).await
        }
    });
    let replies = futures_util::future::join_all(sends).await;

    let payments = payments(&client, &instances[0], &user).await;
    assert_eq!(payments.len(), 1, "exactly one payment: {payments:?}");
    for reply in &replies {
        assert_eq!(reply.status, 201, "{}", reply.body);
        assert_eq!(reply.json()["id"], payments[0]["id"]);
    }
    assert_eq!(
        replies.iter().filter(|r| !r.replayed()).count(),
        1,
        "one execution, fifteen replays"
    );
    for instance in instances {
        assert_eq!(self::payments(&client, instance, &user).await, payments);
    }
    assert_eq!(ledger.rows(&user).await, 1, "one row in the ledger");

    // Retries on either instance replay the same payment.
    for instance in instances {
        let retry = create(&client, instance, &user, key, KRW_1000).await;
        assert_eq!(retry.status, 201);
        assert!(retry.replayed(), "{retry:?}");
        assert_eq!(retry.json(), replies[0].json());
    }
    replies.into_iter().next().expect("replies")
}

/// A create on one instance, its retry on the other: replayed, with the same body and Location;
/// the same key with another body is refused there too.
async fn a_retry_on_the_other_instance_replays(a: &Instance, b: &Instance) {
    let client = client();
    let user = fresh_user();
    let created = create(&client, a, &user, "order-1", KRW_1000).await;
    assert_eq!(created.status, 201, "{}", created.body);
    assert!(!created.replayed());

    let retry = create(&client, b, &user, "order-1", KRW_1000).await;
    assert_eq!(retry.status, 201, "{}", retry.body);
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, created.body);
    assert_eq!(retry.header("location"), created.header("location"));
    let location = created.header("location").expect("Location");
    assert_eq!(get(&client, b, &user, location).await.status, 200);

    let other = create(
        &client,
        b,
        &user,
        "order-1",
        r#"{"amount": 2000, "currency": "KRW"}"#,
    )
    .await;
    assert_eq!(other.status, 422, "{}", other.body);
    assert_eq!(payments(&client, b, &user).await.len(), 1);
}

/// The ledger's payments of one owner, counted in the database itself.
trait LedgerRows {
    async fn rows(&self, owner: &str) -> i64;
}

impl LedgerRows for PgPool {
    async fn rows(&self, owner: &str) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM payments WHERE owner = $1")
            .bind(owner)
            .fetch_one(self)
            .await
            .expect("count the ledger")
    }
}

impl LedgerRows for MySqlPool {
    async fn rows(&self, owner: &str) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM payments WHERE owner = ?")
            .bind(owner)
            .fetch_one(self)
            .await
            .expect("count the ledger")
    }
}

/// Two processes with the ledger and the records in one MariaDB database, in transactional mode:
/// sixteen identical creates make one payment and one charge, and retries on either replay.
#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_mysql_database() {
    let db = MySqlTestDb::create().await;
    let url = db.url();
    let env: &[(&str, &str)] = &[("DATABASE_URL", &url), ("PAYMENT_LATENCY_MS", "200")];
    let instances = Instance::start_all(&[env, env]);
    let ledger = MySqlPool::connect_with(db.options())
        .await
        .expect("connect to the test database");

    sixteen_identical_creates_make_one_payment(&instances, &ledger).await;
    a_retry_on_the_other_instance_replays(&instances[0], &instances[1]).await;
    a_retry_on_the_other_instance_replays(&instances[1], &instances[0]).await;

    let records: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_records")
        .fetch_one(&ledger)
        .await
        .expect("the records are in the shared database");
    assert_eq!(records, 3, "one record per key");
    let charges: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM card_charges")
        .fetch_one(&ledger)
        .await
        .expect("count the charges");
    assert_eq!(charges, 3, "one charge per payment");
}

async fn ledger_pool(db: &TestDb) -> PgPool {
    PgPool::connect_with(db.options())
        .await
        .expect("connect to the test database")
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_postgres_database() {
    let db = TestDb::create().await;
    let url = db.url();
    // A slow card network keeps the first request in flight while the others arrive, so most
    // duplicates wait on the other instance's claim; the outcome asserted does not depend on it.
    let env: &[(&str, &str)] = &[("DATABASE_URL", &url), ("PAYMENT_LATENCY_MS", "200")];
    let instances = Instance::start_all(&[env, env]);
    let ledger = ledger_pool(&db).await;

    sixteen_identical_creates_make_one_payment(&instances, &ledger).await;
    a_retry_on_the_other_instance_replays(&instances[0], &instances[1]).await;
    a_retry_on_the_other_instance_replays(&instances[1], &instances[0]).await;

    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idem.records")
        .fetch_one(&ledger)
        .await
        .expect("the records are in the shared database");
    assert_eq!(records, 3, "one record per key");
}

#[cfg_attr(
    any(skip_postgres, skip_redis),
    ignore = "needs PostgreSQL and Redis, skipped by IDEM_TEST_SKIP"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_the_records_in_redis() {
    let db = TestDb::create().await;
    let redis = RedisPrefix::create().await;
    let url = db.url();
    let store_url = with_prefix(&redis);
    let env: &[(&str, &str)] = &[
        ("DATABASE_URL", &url),
        ("IDEM_STORE_URL", &store_url),
        ("PAYMENT_LATENCY_MS", "200"),
    ];
    let instances = Instance::start_all(&[env, env]);
    let ledger = ledger_pool(&db).await;

    sixteen_identical_creates_make_one_payment(&instances, &ledger).await;
    a_retry_on_the_other_instance_replays(&instances[0], &instances[1]).await;

    // The records are in Redis under the prefix, and not in PostgreSQL.
    assert_eq!(redis.keys().await.len(), 2, "one record per key");
    let in_postgres: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('idem.records')::text")
            .fetch_one(&ledger)
            .await
            .expect("look for idem.records");
    assert_eq!(
        in_postgres, None,
        "no idempotency table in the ledger's database"
    );
}

#[cfg_attr(
    any(skip_postgres, skip_redis_cluster),
    ignore = "needs PostgreSQL and a Redis Cluster, skipped by IDEM_TEST_SKIP"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_the_records_in_a_redis_cluster() {
    let db = TestDb::create().await;
    let cluster = RedisClusterPrefix::create().await;
    let url = db.url();
    let store_url = format!("{}?prefix={}", cluster.url(), cluster.prefix());
    let env: &[(&str, &str)] = &[
        ("DATABASE_URL", &url),
        ("IDEM_STORE_URL", &store_url),
        ("PAYMENT_LATENCY_MS", "200"),
    ];
    let instances = Instance::start_all(&[env, env]);
    let ledger = ledger_pool(&db).await;

    sixteen_identical_creates_make_one_payment(&instances, &ledger).await;
    a_retry_on_the_other_instance_replays(&instances[0], &instances[1]).await;
    a_retry_on_the_other_instance_replays(&instances[1], &instances[0]).await;

    // The records are in the cluster under the prefix (one per key), not in PostgreSQL.
    let keys: usize = cluster.keys().await.iter().map(|(_, k)| k.len()).sum();
    assert_eq!(keys, 3, "one record per key");
    let in_postgres: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('idem.records')::text")
            .fetch_one(&ledger)
            .await
            .expect("look for idem.records");
    assert_eq!(in_postgres, None);
}

#[cfg_attr(
    any(skip_postgres, skip_mysql),
    ignore = "needs PostgreSQL and MySQL/MariaDB, skipped by IDEM_TEST_SKIP"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_the_records_in_mysql() {
    let db = TestDb::create().await;
    let records_db = MySqlTestDb::create().await;
    let url = db.url();
    let store_url = records_db.url();
    let env: &[(&str, &str)] = &[
        ("DATABASE_URL", &url),
        ("IDEM_STORE_URL", &store_url),
        ("PAYMENT_LATENCY_MS", "200"),
    ];
    let instances = Instance::start_all(&[env, env]);
    let ledger = ledger_pool(&db).await;

    sixteen_identical_creates_make_one_payment(&instances, &ledger).await;
    a_retry_on_the_other_instance_replays(&instances[0], &instances[1]).await;
    a_retry_on_the_other_instance_replays(&instances[1], &instances[0]).await;

    // The records are in MariaDB (one per key), not in PostgreSQL.
    let records = idem_runtime::sqlx::mysql::MySqlPool::connect_with(records_db.options())
        .await
        .expect("connect to the records' database");
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM idem_records")
        .fetch_one(&records)
        .await
        .expect("count the records");
    assert_eq!(rows, 3, "one record per key");
    let in_postgres: Option<String> =
        sqlx::query_scalar("SELECT to_regclass('idem.records')::text")
            .fetch_one(&ledger)
            .await
            .expect("look for idem.records");
    assert_eq!(in_postgres, None);
}

/// `IDEM_STORE_URL` for `redis`'s server and prefix.
fn with_prefix(redis: &RedisPrefix) -> String {
    let separator = if redis.url().contains('?') { '&' } else { '?' };
    format!("{}{separator}prefix={}", redis.url(), redis.prefix())
}
