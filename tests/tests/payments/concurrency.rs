//! Many identical requests at once make one payment.

use crate::payments_support::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_identical_posts_make_one_payment() {
    let dir = tempfile::tempdir().unwrap();
    // A slow card network keeps the first request in flight while the others arrive; the outcome
    // asserted below does not depend on how they interleave.
    let app = start_with_latency(dir.path(), Duration::from_millis(50)).await;

    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(16));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let app = app.clone();
        let barrier = barrier.clone();
        tasks.spawn(async move {
            barrier.wait().await;
            send(
                &app,
                post("/payments", Some("alice"), Some("same-key"), KRW_1000),
            )
            .await
        });
    }
    let mut replies = Vec::new();
    while let Some(reply) = tasks.join_next().await {
        replies.push(reply.unwrap());
    }

    let payments = list(&app, "alice").await;
    assert_eq!(payments.len(), 1, "exactly one payment: {payments:?}");
    for reply in &replies {
        assert_eq!(reply.status, 201, "{:?}", reply.body);
        assert_eq!(reply.json()["id"], payments[0]["id"]);
    }
    assert_eq!(replies.iter().filter(|r| !r.replayed()).count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_legacy_double_taps_make_one_payment() {
    let dir = tempfile::tempdir().unwrap();
    let app = start_with_latency(dir.path(), Duration::from_millis(50)).await;

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let app = app.clone();
        tasks.spawn(async move {
            send(
                &app,
                post("/legacy/payments", Some("alice"), None, KRW_1000),
            )
            .await
        });
    }
    while let Some(reply) = tasks.join_next().await {
        assert_eq!(reply.unwrap().status, 201);
    }
    assert_eq!(list(&app, "alice").await.len(), 1);
}
