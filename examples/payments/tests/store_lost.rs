//! The idempotency store goes away while payments are storing their responses, then comes back:
//! the clients still get their 201s (the payments were made), idem keeps storing the responses until
//! the store takes them, and every key ends with one charge, one payment and a replay.
//!
//! With the records in Redis the server is the test's own and is killed (`SIGKILL`, no persistence):
//! it comes back empty, and idem puts back the records it lost. With the records in PostgreSQL the
//! store is reached through a proxy that is cut off, then restored: the records are still there.

use crate::support::*;
use idem_runtime::sqlx::ConnectOptions;
use idem_tests::proxy::{self, Proxy};
use idem_tests::services::TestDb;
use std::time::Duration;

/// Payments in flight when the store goes away.
const KEYS: usize = 20;

/// The records' key prefix on the test's own Redis server.
const PREFIX: &str = "payments";

/// Sends payments `0..KEYS` to `instance`, calls `outage` once they are all in the card network's
/// latency, and checks that every client still gets its 201. Returns the replies.
async fn payments_answered_through_an_outage(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    outage: impl FnOnce(),
) -> Vec<Reply> {
    let sends: Vec<_> = (0..KEYS)
        .map(|i| {
            let (client, base, user) =
                (client.clone(), instance.base().to_owned(), user.to_owned());
            tokio::spawn(async move { try_create(&client, &base, &user, &key(i), &body(i)).await })
        })
        .collect();
    until_charged(client, instance, user, KEYS).await;
    outage();
    let mut replies = Vec::new();
    for send in sends {
        let reply = send.await.expect("join").expect("a reply");
        assert_eq!(reply.status, 201, "{}", reply.body);
        assert!(!reply.replayed());
        replies.push(reply);
    }
    replies
}

/// Checks that every key was charged and paid once, the payment its client was first told of and
/// its retries replayed. Returns the network's calls per charge.
async fn every_key_once(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    originals: &[Reply],
    settled: &[Vec<Reply>],
) -> Vec<i64> {
    let effects = Effects::of(client, instance, user).await;
    let attempts = effects.assert_each_once(KEYS);
    for (i, replies) in settled.iter().enumerate() {
        assert_eq!(originals[i].json(), *effects.payment(i), "{}", key(i));
        let replay = replies.last().expect("a replay");
        assert_eq!(replay.json(), originals[i].json(), "{}", key(i));
    }
    let statuses: Vec<i64> = settled
        .iter()
        .flatten()
        .map(|r| i64::from(r.status))
        .collect();
    println!(
        "network calls per charge: {:?}; replies to the retries by status: {:?}; \
         retries that ran the payment again: {}",
        histogram(&attempts),
        histogram(&statuses),
        reruns(settled.iter().flatten()),
    );
    attempts
}

/// How many of `replies` ran the payment again (a 201 that is not a replay).
fn reruns<'a>(replies: impl IntoIterator<Item = &'a Reply>) -> usize {
    replies
        .into_iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .count()
}

/// The scenario's premise: the outage came while the responses were being stored (idem logs each
/// attempt that fails).
#[track_caller]
fn assert_completions_failed(instance: &mut Instance) {
    let failed = instance
        .log()
        .matches("response could not be stored")
        .count();
    assert!(failed > 0, "no completion met the outage");
}

#[cfg_attr(skip_redis, ignore = "needs redis-server, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_empty() {
    let mut redis = RedisServer::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (ledger, records) = (sqlite_url(&dir), redis_store_url(&redis.url(), PREFIX));
    let mut instance = Instance::start(&[
        ("DATABASE_URL", &ledger),
        ("IDEM_STORE_URL", &records),
        ("PAYMENT_LATENCY_MS", "1500"),
    ]);
    let client = client();
    let user = fresh_user();

    let originals =
        payments_answered_through_an_outage(&client, &instance, &user, || redis.kill()).await;
    assert_completions_failed(&mut instance);
    redis.restart().await;
    // Half the keys are retried at once: a retry that reaches a key before idem put its record back
    // runs the payment again, and the network deduplicates the charge (2 calls), the ledger the
    // payment.
    let mut settled = settle_all(&client, &instance, &user, 0..KEYS / 2).await;
    // The others once the store holds a record for every key again: idem's completions, retried
    // until the store took them, claimed the lost records again and stored the responses.
    until(
        "a record for every key",
        Duration::from_secs(60),
        || async { (redis.count_keys(PREFIX).await >= KEYS).then_some(()) },
    )
    .await;
    let later = settle_all(&client, &instance, &user, KEYS / 2..KEYS).await;
    assert_eq!(reruns(later.iter().flatten()), 0, "{later:?}");
    settled.extend(later);
    let attempts = every_key_once(&client, &instance, &user, &originals, &settled).await;
    assert!(attempts.iter().all(|a| (1..=2).contains(a)), "{attempts:?}");
    assert!(attempts[KEYS / 2..].iter().all(|a| *a == 1), "{attempts:?}");
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_cut_off_and_restored() {
    let db = TestDb::create().await;
    let direct = db.options();
    let server = proxy::resolve(&format!("{}:{}", direct.get_host(), direct.get_port())).await;
    let proxy = Proxy::start(server).await;
    // The ledger connects directly; the records go through the proxy, to the same database.
    let records = direct
        .host(&proxy.addr().ip().to_string())
        .port(proxy.addr().port())
        .to_url_lossy()
        .to_string();
    let mut instance = Instance::start(&[
        ("DATABASE_URL", &db.url()),
        ("IDEM_STORE_URL", &records),
        ("PAYMENT_LATENCY_MS", "1500"),
    ]);
    let client = client();
    let user = fresh_user();

    let originals =
        payments_answered_through_an_outage(&client, &instance, &user, || proxy.cut()).await;
    assert_completions_failed(&mut instance);
    proxy.restore();
    // The records were kept in flight and their leases renewed: no retry ran a payment again.
    let settled = settle_all(&client, &instance, &user, 0..KEYS).await;
    assert_eq!(reruns(settled.iter().flatten()), 0, "{settled:?}");
    let attempts = every_key_once(&client, &instance, &user, &originals, &settled).await;
    assert_eq!(attempts, [1; KEYS]);
}
