//! The process is killed (`SIGKILL`) while payments run, inside the card network's latency; another
//! process starts on the same stores and the clients retry every key until it is replayed. The
//! retries wait for the dead process's claims until their lease runs out, take them over, charge
//! again under the same downstream key (the network deduplicates it) and record the payment once:
//! every key ends with exactly one charge and one payment. On every store mode; with the records in
//! memory the restart forgets the claims and the retries run at once.

use crate::support::*;

/// Payments in flight when the process is killed.
const KEYS: usize = 50;

async fn every_key_is_charged_and_paid_once_after_a_crash(stores: Stores) {
    let env = [("PAYMENT_LATENCY_MS", "1000")];
    let mut first = stores.start(&env);
    let client = client();
    let user = fresh_user();
    let sends: Vec<_> = (0..KEYS)
        .map(|i| {
            let (client, base, user) = (client.clone(), first.base().to_owned(), user.clone());
            tokio::spawn(async move { try_create(&client, &base, &user, &key(i), &body(i)).await })
        })
        .collect();
    until_charged(&client, &first, &user, KEYS).await;
    first.kill();
    // Which payments (if any) were answered before the kill: those ran to the end.
    let mut answered = Vec::new();
    for (i, send) in sends.into_iter().enumerate() {
        if let Ok(reply) = send.await.expect("join") {
            assert_eq!(reply.status, 201, "{}", reply.body);
            answered.push(i);
        }
    }

    let second = stores.start(&env);
    let settled = settle_all(&client, &second, &user, 0..KEYS).await;
    let effects = Effects::of(&client, &second, &user).await;
    let attempts = effects.assert_each_once(KEYS);
    for (i, replies) in settled.iter().enumerate() {
        let replay = replies.last().expect("a replay");
        assert_eq!(replay.json(), *effects.payment(i), "{}", key(i));
        // A payment cut short is charged again, once, under the same key; none more than that.
        let expected = if answered.contains(&i) { 1 } else { 2 };
        assert_eq!(attempts[i], expected, "{}: {replies:?}", key(i));
    }
    let statuses: Vec<u16> = settled.iter().flatten().map(|r| r.status).collect();
    println!(
        "{KEYS} payments, {} answered before the kill; network calls per charge: {:?}; \
         replies to the retries by status: {:?}",
        answered.len(),
        histogram(&attempts),
        histogram(&statuses.iter().map(|s| i64::from(*s)).collect::<Vec<_>>()),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    every_key_is_charged_and_paid_once_after_a_crash(Stores::sqlite().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    every_key_is_charged_and_paid_once_after_a_crash(Stores::postgres().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql() {
    every_key_is_charged_and_paid_once_after_a_crash(Stores::mysql().await).await;
}

#[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_redis() {
    every_key_is_charged_and_paid_once_after_a_crash(Stores::redis_records().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_records_in_memory() {
    every_key_is_charged_and_paid_once_after_a_crash(Stores::memory().await).await;
}
