//! Many payments at once. On the default configuration (SQLite, transactional) distinct keys run
//! side by side, not one after another; on PostgreSQL, two instances take 200 keys sent 16 times
//! each without refusing any request, and make exactly one charge and one payment per key.
//!
//! On an idle machine no request is refused; on a starved one (the whole suite running on two cores)
//! a pool may answer 503 `busy` after its acquire timeout, a store call that outlives idem's store
//! timeout 503 "store unavailable", a duplicate that waited its bound 409, and a connection of the
//! 3,200 opened at once may be cut. The test's client then does what a client of this API does,
//! sending again with the same key after `Retry-After`, and the effects must still be one per key;
//! the ledger's own database, up throughout, is never reported unavailable. That no connection is held through a handler is shown, with a pool of two, by
//! the transactional tests.
//!
//! Speed is not asserted: the first test shows that payments overlap by counting what is in flight
//! (charged by the network, not yet in the ledger), and prints the elapsed time for information.

use crate::support::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_keys_run_side_by_side_on_the_default_configuration() {
    const KEYS: usize = 50;
    let stores = Stores::sqlite().await;
    let instance = stores.start(&[("PAYMENT_LATENCY_MS", "300")]);
    let client = client();
    let user = fresh_user();
    let answered = Arc::new(AtomicBool::new(false));

    let started = Instant::now();
    let sends: Vec<_> = (0..KEYS)
        .map(|i| {
            let (client, base, user) = (client.clone(), instance.base().to_owned(), user.clone());
            let answered = answered.clone();
            tokio::spawn(async move {
                let reply = try_create(&client, &base, &user, &key(i), &body(i)).await;
                answered.store(true, Ordering::SeqCst);
                reply
            })
        })
        .collect();
    // Payments in flight at a moment: charged by the network, not yet in the ledger. Payments only
    // grow, so charges read before payments give a lower bound. Run one at a time, they are at most 1.
    let mut peak = 0;
    let mut all_charged_before_an_answer = false;
    while sends.iter().any(|s| !s.is_finished()) {
        let charged = charges(&client, &instance, &user).await.len();
        let paid = payments(&client, &instance, &user).await.len();
        peak = peak.max(charged.saturating_sub(paid));
        if charged == KEYS && !answered.load(Ordering::SeqCst) {
            all_charged_before_an_answer = true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut replies = Vec::new();
    for send in sends {
        replies.push(send.await.expect("join").expect("a reply"));
    }
    let elapsed = started.elapsed();
    for reply in &replies {
        assert_eq!(reply.status, 201, "{}", reply.body);
        assert!(!reply.replayed());
    }
    let effects = Effects::of(&client, &instance, &user).await;
    assert_eq!(effects.assert_each_once(KEYS), [1; KEYS]);
    println!(
        "{KEYS} payments of 300 ms each in {elapsed:?}; at most {peak} seen in flight at once; \
         all charged before the first answer: {all_charged_before_an_answer}"
    );
    assert!(peak > 1, "payments with distinct keys ran one at a time");
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_keys_sent_sixteen_times_to_two_instances_on_postgres() {
    two_hundred_keys_sent_sixteen_times_to_two_instances(Stores::postgres().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_keys_sent_sixteen_times_to_two_instances_on_mysql() {
    two_hundred_keys_sent_sixteen_times_to_two_instances(Stores::mysql().await).await;
}

/// Sixteen copies of each of 200 keys, split between two instances on `stores`' shared database:
/// one charge and one payment per key, each key run once and its copies replayed.
async fn two_hundred_keys_sent_sixteen_times_to_two_instances(stores: Stores) {
    const KEYS: usize = 200;
    const COPIES: usize = 16;
    const ATTEMPTS: usize = 10;
    let instances = stores.start_many(2, &[("PAYMENT_LATENCY_MS", "400")]);
    let client = client();
    let user = fresh_user();

    let started = Instant::now();
    let sends = (0..KEYS * COPIES).map(|n| {
        let (client, user) = (client.clone(), user.clone());
        let base = instances[n % 2].base().to_owned();
        tokio::spawn(async move {
            let i = n / COPIES;
            // As a client of an idempotent API does, a cut connection, a 503 or a 409 is sent again
            // with the same key (after its Retry-After); the effects below must still be one per key.
            let mut answers = Vec::new();
            for _ in 0..ATTEMPTS {
                match try_create(&client, &base, &user, &key(i), &body(i)).await {
                    Ok(reply) if reply.status == 503 || reply.status == 409 => {
                        let wait = reply.header("retry-after").and_then(|s| s.parse().ok());
                        answers.push(outcome(&reply));
                        tokio::time::sleep(Duration::from_secs(wait.unwrap_or(1))).await;
                    }
                    Ok(reply) => {
                        answers.push(outcome(&reply));
                        return (i, reply, answers);
                    }
                    Err(error) => answers.push(format!("no answer: {error}")),
                }
            }
            panic!(
                "{}: no final answer in {ATTEMPTS} attempts: {answers:?}",
                key(i)
            )
        })
    });
    let replies = futures_util::future::try_join_all(sends)
        .await
        .expect("join");
    let elapsed = started.elapsed();

    // Every answer by status and, for a problem, its type, retried ones included.
    let mut outcomes = std::collections::BTreeMap::<&str, usize>::new();
    for answer in replies.iter().flat_map(|(_, _, answers)| answers) {
        *outcomes.entry(answer).or_default() += 1;
    }
    println!("{} requests in {elapsed:?}: {outcomes:?}", KEYS * COPIES);
    // The ledger's database is up throughout: when its pool is full the handlers say "busy",
    // never "unavailable".
    assert!(
        outcomes
            .keys()
            .all(|o| !o.contains("urn:payments:problem:database-unavailable")),
        "the database is up, the ledger never says it is unavailable: {outcomes:?}"
    );
    let effects = Effects::of(&client, &instances[0], &user).await;
    // One charge and one payment per key. The card network is called again only by a run that
    // follows a failed one (a 503 released the key, or its requester heard nothing), under the
    // same downstream key, which the network deduplicates.
    let attempts = effects.assert_each_once(KEYS);
    let mut failed = vec![0; KEYS];
    for (i, _, answers) in &replies {
        failed[*i] += answers
            .iter()
            .filter(|a| a.starts_with("503") || a.starts_with("no answer"))
            .count();
    }
    for i in 0..KEYS {
        assert!(
            attempts[i] as usize <= 1 + failed[i],
            "{}: {} calls to the card network after {} failed answers",
            key(i),
            attempts[i],
            failed[i]
        );
    }
    let mut runs = vec![0; KEYS];
    for (i, reply, _) in &replies {
        assert_eq!(reply.status, 201, "{}: {}", key(*i), reply.body);
        assert_eq!(reply.json(), *effects.payment(*i), "{}", key(*i));
        runs[*i] += usize::from(!reply.replayed());
    }
    assert_eq!(runs, [1; KEYS], "each key ran once, its copies replayed");
}

/// A reply's status and, for a problem, its type.
fn outcome(reply: &Reply) -> String {
    let problem = serde_json::from_str::<serde_json::Value>(&reply.body)
        .ok()
        .and_then(|body| body["type"].as_str().map(str::to_owned));
    format!("{} {}", reply.status, problem.unwrap_or_default())
}
