//! `POST /webhooks/card-network` on every store mode: one `webhook-id` delivered 16 times at once
//! and 5 times later is one dispute, two ids for one payment are two; a wrongly signed or stale
//! delivery changes nothing and burns nothing (its id still works when signed); an unknown payment
//! is a 404, stored and replayed.

use crate::support::*;
use payments::webhooks::{WebhookSecret, DEFAULT_WEBHOOK_SECRET};
use std::time::{SystemTime, UNIX_EPOCH};

fn now() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970");
    i64::try_from(since.as_secs()).expect("in range")
}

fn event(payment_id: &str) -> String {
    serde_json::json!({"type": "charge.disputed", "data": {"payment_id": payment_id}}).to_string()
}

/// Delivers `body` as the card network would, signed with `secret` at `timestamp`.
async fn deliver(
    client: &reqwest::Client,
    base: &str,
    secret: &WebhookSecret,
    id: &str,
    timestamp: i64,
    body: &str,
) -> Reply {
    let signature = secret
        .sign(id, timestamp, body.as_bytes())
        .expect("a signature");
    let response = client
        .post(format!("{base}/webhooks/card-network"))
        .header("webhook-id", id)
        .header("webhook-timestamp", timestamp.to_string())
        .header("webhook-signature", signature)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("POST /webhooks/card-network");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.text().await.expect("a body");
    Reply {
        status,
        headers,
        body,
    }
}

async fn disputes(client: &reqwest::Client, instance: &Instance, user: &str, id: &str) -> i64 {
    let reply = get(client, instance, user, &format!("/payments/{id}")).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json()["disputes"]
        .as_i64()
        .expect("an integer `disputes`")
}

async fn each_delivery_id_has_its_effect_once(stores: Stores) {
    let instance = stores.start(&[]);
    let (client, user) = (client(), fresh_user());
    let secret = WebhookSecret::new(DEFAULT_WEBHOOK_SECRET).expect("the default secret");
    let paid = create(&client, &instance, &user, "pay-1", KRW_1000).await;
    assert_eq!(paid.status, 201, "{}", paid.body);
    let payment = paid.json()["id"].as_str().expect("an id").to_owned();
    assert_eq!(disputes(&client, &instance, &user, &payment).await, 0);
    let body = event(&payment);
    let base = instance.base().to_owned();

    // 16 deliveries of one id at once, then 5 redeliveries later: one dispute.
    let at = now();
    let sends: Vec<_> = (0..16)
        .map(|_| {
            let (client, base, secret, body) =
                (client.clone(), base.clone(), secret.clone(), body.clone());
            tokio::spawn(async move { deliver(&client, &base, &secret, "msg_1", at, &body).await })
        })
        .collect();
    let mut fresh = 0;
    for send in sends {
        let reply = send.await.expect("join");
        assert_eq!(reply.status, 200, "{}", reply.body);
        fresh += usize::from(!reply.replayed());
    }
    assert_eq!(fresh, 1, "one delivery ran, the others replayed");
    for _ in 0..5 {
        let reply = deliver(&client, &base, &secret, "msg_1", now(), &body).await;
        assert_eq!(
            (reply.status, reply.replayed()),
            (200, true),
            "{}",
            reply.body
        );
        assert_eq!(reply.json()["disputes"], 1);
    }
    assert_eq!(disputes(&client, &instance, &user, &payment).await, 1);

    // Another id for the same payment is another dispute.
    let second = deliver(&client, &base, &secret, "msg_2", now(), &body).await;
    assert_eq!(
        (second.status, second.replayed()),
        (200, false),
        "{}",
        second.body
    );
    assert_eq!(disputes(&client, &instance, &user, &payment).await, 2);

    // Wrongly signed, signed with another secret, or stale: 401, nothing changes, the id is not
    // burned.
    let other = WebhookSecret::new("whsec_c29tZW9uZS1lbHNl").expect("a secret");
    let forged = deliver(&client, &base, &other, "msg_3", now(), &body).await;
    assert_eq!(forged.status, 401, "{}", forged.body);
    let stale = deliver(&client, &base, &secret, "msg_3", now() - 6 * 60, &body).await;
    assert_eq!(stale.status, 401, "{}", stale.body);
    let unsigned = client
        .post(format!("{base}/webhooks/card-network"))
        .header("webhook-id", "msg_3")
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .expect("POST");
    assert_eq!(unsigned.status().as_u16(), 401);
    assert_eq!(disputes(&client, &instance, &user, &payment).await, 2);
    let signed = deliver(&client, &base, &secret, "msg_3", now(), &body).await;
    assert_eq!(
        (signed.status, signed.replayed()),
        (200, false),
        "{}",
        signed.body
    );
    assert_eq!(disputes(&client, &instance, &user, &payment).await, 3);

    // An unknown payment: 404, stored like any 4xx.
    let unknown = event("pay_unknown");
    let missing = deliver(&client, &base, &secret, "msg_4", now(), &unknown).await;
    assert_eq!(
        (missing.status, missing.replayed()),
        (404, false),
        "{}",
        missing.body
    );
    let again = deliver(&client, &base, &secret, "msg_4", now(), &unknown).await;
    assert_eq!(
        (again.status, again.replayed()),
        (404, true),
        "{}",
        again.body
    );
    assert_eq!(disputes(&client, &instance, &user, &payment).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite() {
    each_delivery_id_has_its_effect_once(Stores::sqlite().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres() {
    each_delivery_id_has_its_effect_once(Stores::postgres().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_records() {
    each_delivery_id_has_its_effect_once(Stores::postgres_records().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_records() {
    each_delivery_id_has_its_effect_once(Stores::redis_records().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_memory() {
    each_delivery_id_has_its_effect_once(Stores::memory().await).await;
}

#[cfg_attr(skip_mysql, ignore = "needs MySQL/MariaDB, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mysql() {
    each_delivery_id_has_its_effect_once(Stores::mysql().await).await;
}

#[cfg_attr(
    skip_redis_cluster,
    ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_cluster_records() {
    each_delivery_id_has_its_effect_once(Stores::redis_cluster_records().await).await;
}
