//! The idempotency store stops answering while the payments binary runs: requests get 503 with
//! `Retry-After`, no handler runs (no payment is made), and service resumes by itself when the
//! store returns. The store is reached through a TCP proxy the test cuts and restores; the ledger
//! is reached directly, so the test can see that nothing was charged.

use crate::support::*;
use idem_runtime::sqlx::ConnectOptions;
use idem_tests::proxy::{self, Proxy};
use idem_tests::services::{MySqlTestDb, RedisPrefix, TestDb};
use std::time::Duration;

/// How often, and how many times, a request is sent again while waiting for the store to come back:
/// polling for an observable state, bounded only to fail instead of hanging.
const POLL_EVERY: Duration = Duration::from_millis(100);
const POLL_ATTEMPTS: usize = 600;

async fn an_outage_answers_503_and_service_resumes_by_itself(instance: &Instance, store: &Proxy) {
    let client = client();
    let user = fresh_user();
    let before = create(&client, instance, &user, "before", KRW_1000).await;
    assert_eq!(before.status, 201, "{}", before.body);

    store.cut();
    for key in ["during", "during", "before"] {
        let reply = create(&client, instance, &user, key, KRW_1000).await;
        assert_eq!(reply.status, 503, "{key}: {}", reply.body);
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(reply.json()["type"], "urn:idem:problem:store-unavailable");
        let retry_after: u64 = reply
            .header("retry-after")
            .expect("Retry-After")
            .parse()
            .expect("Retry-After in seconds");
        assert!(retry_after >= 1);
    }
    // The handler never ran: the ledger (still reachable) holds only the payment made before.
    assert_eq!(payments(&client, instance, &user).await, [before.json()]);

    store.restore();
    let mut resumed = None;
    for _ in 0..POLL_ATTEMPTS {
        let reply = create(&client, instance, &user, "during", KRW_1000).await;
        if reply.status != 503 {
            resumed = Some(reply);
            break;
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
    let during = resumed.expect("service resumed once the store returned");
    assert_eq!(during.status, 201, "{}", during.body);
    assert!(!during.replayed(), "the key that met the outage runs now");
    assert_eq!(
        payments(&client, instance, &user).await,
        [before.json(), during.json()]
    );
    // Both records are there: each key replays its own payment.
    for (key, original) in [("before", &before), ("during", &during)] {
        let retry = create(&client, instance, &user, key, KRW_1000).await;
        assert!(retry.replayed(), "{key}: {retry:?}");
        assert_eq!(retry.body, original.body);
    }
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_in_redis() {
    let redis = RedisPrefix::create().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let proxy = Proxy::redis(redis.url()).await;
    let ledger = format!("sqlite://{}/payments.db?mode=rwc", dir.path().display());
    let store = format!("{}?prefix={}", proxy.url(), redis.prefix());
    let instance = Instance::start(&[("DATABASE_URL", &ledger), ("IDEM_STORE_URL", &store)]);
    an_outage_answers_503_and_service_resumes_by_itself(&instance, &proxy).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_in_postgres() {
    let db = TestDb::create().await;
    let direct = db.options();
    let server = proxy::resolve(&format!("{}:{}", direct.get_host(), direct.get_port())).await;
    let proxy = Proxy::start(server).await;
    // The ledger connects directly; the records go through the proxy, to the same database.
    let ledger = db.url();
    let store = direct
        .host(&proxy.addr().ip().to_string())
        .port(proxy.addr().port())
        .to_url_lossy()
        .to_string();
    let instance = Instance::start(&[("DATABASE_URL", &ledger), ("IDEM_STORE_URL", &store)]);
    an_outage_answers_503_and_service_resumes_by_itself(&instance, &proxy).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_in_mysql() {
    let db = MySqlTestDb::create().await;
    let direct = db.options();
    let server = proxy::resolve(&format!("{}:{}", direct.get_host(), direct.get_port())).await;
    let proxy = Proxy::start(server).await;
    // The ledger is a SQLite file; the records go through the proxy to MariaDB.
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = format!("sqlite://{}/payments.db?mode=rwc", dir.path().display());
    let store = direct
        .host(&proxy.addr().ip().to_string())
        .port(proxy.addr().port())
        .to_url_lossy()
        .to_string();
    let instance = Instance::start(&[("DATABASE_URL", &ledger), ("IDEM_STORE_URL", &store)]);
    an_outage_answers_503_and_service_resumes_by_itself(&instance, &proxy).await;
}
