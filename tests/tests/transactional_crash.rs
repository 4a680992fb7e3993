//! Crash tests for transactional mode, with real processes: `txn_crash_server` (this package's
//! binary) is started on PostgreSQL (a fresh database) and on SQLite (a temporary file), aborts at
//! the point `IDEM_CRASH_AT` names while serving a request, is started again, and the client
//! retries with the same key.
//!
//! - Killed between the business write and the commit: nothing was committed, so the retry runs
//!   the handler (once: a further retry replays) and the ledger holds one row.
//! - Killed after the commit, before the response reached the client: the retry replays the
//!   stored response and the ledger still holds one row.

use idem_runtime::sqlx::{self, postgres::PgPool, sqlite::SqlitePool};
use idem_tests::services::TestDb;
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `txn_crash_server`.
struct Server {
    child: Child,
    base: String,
}

impl Server {
    /// Starts the server on `url`, crashing at `crash` if given; returns once it listens.
    fn start(url: &str, crash: Option<&str>) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_txn_crash_server"));
        command
            .env("DATABASE_URL", url)
            .env("IDEM_CRASH_AT", crash.unwrap_or(""))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().expect("start txn_crash_server");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the server's first line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the server: {line:?}"))
            .to_owned();
        Self {
            child,
            base: format!("http://{addr}"),
        }
    }

    /// Waits for the process to end; it must have aborted (SIGABRT).
    fn assert_aborted(mut self) {
        let status = self.child.wait().expect("wait for the server");
        assert_eq!(status.signal(), Some(6), "aborted, not {status:?}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Only this test's own child, by its handle.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Reply {
    status: u16,
    replayed: bool,
    body: serde_json::Value,
}

async fn create(server: &Server, key: &str) -> Result<Reply, reqwest::Error> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()?;
    let response = client
        .post(format!("{}/entries", server.base))
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .json(&serde_json::json!({ "amount": 1000 }))
        .send()
        .await?;
    let status = response.status().as_u16();
    let replayed = response.headers().get("idempotency-replayed").is_some();
    let body = response.json().await?;
    Ok(Reply {
        status,
        replayed,
        body,
    })
}

/// The scenario on one database. `rows` counts the ledger's rows.
async fn killed_before_commit_the_retry_executes_once<F, Fut>(url: &str, rows: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let crashing = Server::start(url, Some("before_commit"));
    let lost = create(&crashing, "k-before").await;
    assert!(lost.is_err(), "the server died mid-request");
    crashing.assert_aborted();
    assert_eq!(
        rows().await,
        0,
        "the business write died with its transaction"
    );

    let server = Server::start(url, None);
    let retry = create(&server, "k-before").await.expect("retry");
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(!retry.replayed, "nothing was committed: the retry executes");
    assert_eq!(rows().await, 1);
    let again = create(&server, "k-before").await.expect("second retry");
    assert!(again.replayed);
    assert_eq!(again.body, retry.body);
    assert_eq!(rows().await, 1, "executed once");
}

async fn killed_after_commit_the_retry_replays<F, Fut>(url: &str, rows: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = i64>,
{
    let crashing = Server::start(url, Some("after_commit"));
    let lost = create(&crashing, "k-after").await;
    assert!(lost.is_err(), "the response never reached the client");
    crashing.assert_aborted();
    assert_eq!(rows().await, 1, "the write committed with the record");

    let server = Server::start(url, None);
    let retry = create(&server, "k-after").await.expect("retry");
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert!(retry.replayed, "the committed response is replayed");
    assert_eq!(retry.body["amount"], 1000);
    assert_eq!(rows().await, 1, "not executed again");
}

fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("crash.db").display()
    )
}

async fn sqlite_rows(url: &str) -> i64 {
    let pool = SqlitePool::connect(url).await.expect("open");
    let n = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&pool)
        .await
        .expect("count");
    pool.close().await;
    n
}

async fn postgres_rows(db: &TestDb) -> i64 {
    let pool = PgPool::connect_with(db.options()).await.expect("connect");
    let n = sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(&pool)
        .await
        .expect("count");
    pool.close().await;
    n
}

#[tokio::test]
async fn sqlite_killed_before_commit_the_retry_executes_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = sqlite_url(&dir);
    killed_before_commit_the_retry_executes_once(&url, || sqlite_rows(&url)).await;
}

#[tokio::test]
async fn sqlite_killed_after_commit_the_retry_replays() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = sqlite_url(&dir);
    killed_after_commit_the_retry_replays(&url, || sqlite_rows(&url)).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test]
async fn postgres_killed_before_commit_the_retry_executes_once() {
    let db = TestDb::create().await;
    let url = db.url();
    killed_before_commit_the_retry_executes_once(&url, || postgres_rows(&db)).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test]
async fn postgres_killed_after_commit_the_retry_replays() {
    let db = TestDb::create().await;
    let url = db.url();
    killed_after_commit_the_retry_replays(&url, || postgres_rows(&db)).await;
}
