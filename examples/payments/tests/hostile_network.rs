//! What a hostile or unlucky network does to the payments binary: connections that never send a
//! request must not starve the ones that do, and the service's own database going away mid-request
//! is a 503 a client can retry, never a 500 or a double charge.

use crate::support::*;
use idem_runtime::sqlx::ConnectOptions;
use idem_tests::proxy::{self, Proxy};
use idem_tests::services::TestDb;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the peer closes the connection, returning what it sent.
async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut seen = Vec::new();
    let _ = stream.read_to_end(&mut seen).await;
    String::from_utf8_lossy(&seen).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_refused_over_the_limit_and_closed_after_the_header_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ledger = sqlite_url(&dir);
    let instance = Instance::start(&[
        ("DATABASE_URL", &ledger),
        ("MAX_CONNECTIONS", "4"),
        ("HEADER_TIMEOUT_MS", "500"),
    ]);
    let addr = instance.base().trim_start_matches("http://").to_owned();
    // Four connections that send nothing take every slot.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(&addr).await.expect("connect"));
    }
    // One more is refused at once, clearly, and closed.
    let mut extra = TcpStream::connect(&addr).await.expect("connect");
    let refusal = read_to_close(&mut extra).await;
    assert!(
        refusal.starts_with("HTTP/1.1 503") && refusal.contains("Retry-After: 1"),
        "{refusal:?}"
    );
    // The server closes each idle connection once it has sent no request head for the timeout.
    for stream in &mut idle {
        let sent = tokio::time::timeout(Duration::from_secs(30), read_to_close(stream))
            .await
            .expect("the server closed the idle connection");
        assert!(!sent.starts_with("HTTP/1.1 2"), "{sent:?}");
    }
    // Their slots are free again: a real request is served.
    let reply = create(&client(), &instance, &fresh_user(), "k1", KRW_1000).await;
    assert_eq!(reply.status, 201, "{}", reply.body);
    // A connection that sends half a request head is closed as well.
    let mut slow = TcpStream::connect(&addr).await.expect("connect");
    slow.write_all(b"POST /payments HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let sent = tokio::time::timeout(Duration::from_secs(30), read_to_close(&mut slow))
        .await
        .expect("the server closed the slow connection");
    assert!(!sent.starts_with("HTTP/1.1 2"), "{sent:?}");
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_services_own_database_going_away_is_a_503_that_a_retry_fixes() {
    let db = TestDb::create().await;
    let direct = db.options();
    let server = proxy::resolve(&format!("{}:{}", direct.get_host(), direct.get_port())).await;
    let proxy = Proxy::start(server).await;
    // The ledger (and the card network's table) through the proxy; the records elsewhere.
    let ledger = direct
        .host(&proxy.addr().ip().to_string())
        .port(proxy.addr().port())
        .to_url_lossy()
        .to_string();
    let instance = Instance::start(&[("DATABASE_URL", &ledger), ("IDEM_STORE_URL", "memory")]);
    let client = client();
    let user = fresh_user();

    proxy.cut();
    let reply = create(&client, &instance, &user, "k1", KRW_1000).await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(
        reply.json()["type"],
        "urn:payments:problem:database-unavailable"
    );
    assert_eq!(reply.header("retry-after"), Some("1"));
    // The server down (connecting refused): the pool waits for a connection it cannot open, until
    // its acquire timeout. The database is unreachable, not busy.
    proxy.go_down();
    let reply = create(&client, &instance, &user, "k2", KRW_1000).await;
    assert_eq!(reply.status, 503, "{}", reply.body);
    assert_eq!(
        reply.json()["type"],
        "urn:payments:problem:database-unavailable",
        "{}",
        reply.body
    );
    proxy.come_back().await;

    proxy.restore();
    // The 503 released the key: the retry runs, once, and is then replayed.
    let settled = until("the database is back", Duration::from_secs(60), || async {
        let reply = create(&client, &instance, &user, "k1", KRW_1000).await;
        (reply.status != 503).then_some(reply)
    })
    .await;
    assert_eq!(settled.status, 201, "{}", settled.body);
    let again = create(&client, &instance, &user, "k1", KRW_1000).await;
    assert!(again.replayed());
    assert_eq!(payments(&client, &instance, &user).await.len(), 1);
    assert_eq!(charges(&client, &instance, &user).await.len(), 1);
}
