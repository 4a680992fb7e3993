//! A restart on the same SQLite file: the retry replays, as the records are in that file.

use crate::payments_support::*;

#[tokio::test]
async fn a_retry_after_a_restart_on_the_same_file_replays() {
    let dir = tempfile::tempdir().unwrap();
    let first = start(dir.path()).await;
    let created = send(
        &first,
        post("/payments", Some("alice"), Some("k1"), KRW_1000),
    )
    .await;
    assert_eq!(created.status, 201);
    drop(first);

    let restarted = start(dir.path()).await;
    let retry = send(
        &restarted,
        post("/payments", Some("alice"), Some("k1"), KRW_1000),
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body, created.body);
    assert_eq!(list(&restarted, "alice").await.len(), 1);

    // By default the records live in the ledger's file, next to the payments.
    let file = sqlx::SqlitePool::connect(&database_url(dir.path()))
        .await
        .unwrap();
    let records: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_records")
        .fetch_one(&file)
        .await
        .unwrap();
    assert_eq!(records, 1);
}
