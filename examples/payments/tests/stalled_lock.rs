//! A row lock held by a stalled transaction: an instance that claimed a payment and was cut off from
//! PostgreSQL between writing to the key's record and committing. Its retries on another instance
//! cost that key a 503 with `Retry-After` (the store's statements stop waiting at their lock
//! timeout), never the pool: unrelated payments keep answering 201, and no statement is left waiting
//! in the database once its request has been answered.

use crate::support::*;
use idem_runtime::sqlx::{self, Row};
use idem_runtime::store::postgres::PostgresStore;
use idem_runtime::{Begin, Engine, Fingerprint, Policy, RecordKey};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_row_lock_costs_its_key_a_503_and_nothing_else() {
    let stores = Stores::postgres().await;
    let instance = stores.start(&[]);
    let url = stores
        .var("DATABASE_URL")
        .expect("a PostgreSQL URL")
        .to_owned();
    let client = client();
    let user = fresh_user();

    // The fingerprint the service gives payment 0's body (scopes aside): read from the record of
    // another user's payment.
    let probe = fresh_user();
    let first = create(&client, &instance, &probe, &key(0), &body(0)).await;
    assert_eq!(first.status, 201, "{}", first.body);
    let pool = sqlx::PgPool::connect(&url).await.expect("PostgreSQL");
    let fingerprint: Vec<u8> =
        sqlx::query_scalar("SELECT fingerprint FROM idem.records WHERE scope = $1 AND key = $2")
            .bind(&probe)
            .bind(key(0))
            .fetch_one(&pool)
            .await
            .expect("the first payment's record");
    let fingerprint = Fingerprint(fingerprint.try_into().expect("32 bytes"));

    // The stalled instance: an engine on the same database claims `key(0)` with that body's
    // fingerprint and a lease long enough to outlive the test, then a transaction of its locks the
    // record's row and never commits.
    let stalled = Engine::new(PostgresStore::connect(&url).await.expect("store"));
    let policy = Policy::new().lease(Duration::from_secs(120));
    let Ok(Begin::Execute(claim)) = stalled
        .begin(RecordKey::new(user.clone(), key(0)), fingerprint, &policy)
        .await
    else {
        panic!("the stalled instance claims the key")
    };
    let mut stalled_tx = pool.begin().await.expect("a transaction");
    sqlx::query("SELECT 1 FROM idem.records WHERE scope = $1 AND key = $2 FOR UPDATE")
        .bind(&user)
        .bind(key(0))
        .fetch_one(&mut *stalled_tx)
        .await
        .expect("the row lock");

    // Nine retries of the stalled key pile up on the live instance while unrelated payments go on.
    let retries = (0..9).map(|_| {
        let (client, base, user) = (client.clone(), instance.base().to_owned(), user.clone());
        tokio::spawn(async move { try_create(&client, &base, &user, &key(0), &body(0)).await })
    });
    let unrelated = (1..11).map(|i| {
        let (client, base, user) = (client.clone(), instance.base().to_owned(), user.clone());
        tokio::spawn(async move { try_create(&client, &base, &user, &key(i), &body(i)).await })
    });
    let (retries, unrelated) = tokio::join!(
        futures_util::future::join_all(retries),
        futures_util::future::join_all(unrelated)
    );
    for reply in retries {
        let reply = reply.expect("join").expect("an answer");
        assert_eq!(reply.status, 503, "{}", reply.body);
        assert!(reply.header("retry-after").is_some(), "{:?}", reply.headers);
    }
    for reply in unrelated {
        let reply = reply.expect("join").expect("an answer");
        assert_eq!(reply.status, 201, "{}", reply.body);
    }

    // Every request was answered and none of the service's statements still waits on the lock.
    let waiting: i64 = sqlx::query(
        "SELECT count(*) AS n FROM pg_stat_activity
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&pool)
    .await
    .expect("pg_stat_activity")
    .get("n");
    assert_eq!(waiting, 0, "statements left waiting on the stalled row");

    // The partition heals: the stalled transaction ends, its instance gives the key back, and the
    // retry runs the payment once.
    stalled_tx.rollback().await.expect("rollback");
    claim.release().await.expect("release");
    let retried = create(&client, &instance, &user, &key(0), &body(0)).await;
    assert_eq!(
        (retried.status, retried.replayed()),
        (201, false),
        "{}",
        retried.body
    );
    let effects = Effects::of(&client, &instance, &user).await;
    assert_eq!(effects.assert_each_once(11), [1; 11]);
}
