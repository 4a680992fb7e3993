//! `GET /metrics` shows what idem decided, in Prometheus's text format: a payment and its replay,
//! a refund (protected by `IdempotencyLayer`) and its replay, and the store calls they made. The
//! binary runs in a process of its own, so its counters hold this test's requests only.

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_the_payment_the_refund_and_their_replays() {
    let stores = Stores::memory().await;
    let instance = stores.start(&[]);
    let client = client();
    let user = fresh_user();

    let created = create(&client, &instance, &user, "order-1", KRW_1000).await;
    assert_eq!(created.status, 201, "{}", created.body);
    assert!(create(&client, &instance, &user, "order-1", KRW_1000)
        .await
        .replayed());
    let location = created.header("location").expect("Location").to_owned();
    let refund = || {
        client
            .post(format!("{}{location}/refund", instance.base()))
            .bearer_auth(&user)
            .header("idempotency-key", "refund-1")
            .send()
    };
    let refunded = refund().await.expect("refund");
    assert_eq!(refunded.status(), 200);
    let again = refund().await.expect("refund again");
    assert_eq!(again.headers()["idempotency-replayed"], "true");

    let scraped = get(&client, &instance, &user, "/metrics").await;
    assert_eq!(scraped.status, 200);
    assert!(scraped
        .header("content-type")
        .unwrap_or_default()
        .starts_with("text/plain"));
    let lines: Vec<&str> = scraped.body.lines().collect();
    for expected in [
        r#"idem_requests_total{handler="create_payment",outcome="executed"} 1"#,
        r#"idem_requests_total{handler="create_payment",outcome="replayed"} 1"#,
        r#"idem_requests_total{handler="refund_payment",outcome="executed"} 1"#,
        r#"idem_requests_total{handler="refund_payment",outcome="replayed"} 1"#,
        "# TYPE idem_requests_total counter",
        "# TYPE idem_store_duration_seconds histogram",
    ] {
        assert!(
            lines.contains(&expected),
            "no `{expected}` in:\n{}",
            scraped.body
        );
    }
    // Four requests claimed once each (two ran, two replayed); two responses were stored.
    for (op, calls) in [("claim", 4), ("complete", 2)] {
        let count =
            format!(r#"idem_store_duration_seconds_count{{store="memory",op="{op}"}} {calls}"#);
        assert!(
            lines.contains(&count.as_str()),
            "no `{count}` in:\n{}",
            scraped.body
        );
    }
    assert!(
        scraped.body.contains("# HELP idem_requests_total "),
        "idem's metrics are described:\n{}",
        scraped.body
    );
}
