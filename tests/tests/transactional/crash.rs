//! Crash tests for transactional mode, with real processes: `txn_crash_server` (this package's
//! binary, lease 2 s) is started on PostgreSQL (a fresh database) and on SQLite (a temporary file),
//! dies at a chosen point while serving a request, is started again, and the client retries with
//! the same key. Its handler charges a "card network" first (a `charges` row per downstream key,
//! counting attempts, outside any transaction), then writes one ledger row in idem's transaction.
//!
//! - Killed (SIGKILL) in the foreign call, or aborted after the ledger write but before the commit:
//!   the claim is committed but nothing else, so the ledger has no row. The retry waits for the dead
//!   claim's lease to run out, takes it over (`taken_over`), charges again under the same downstream
//!   key (one charge, two attempts) and writes the one row; a further retry replays.
//! - Aborted after the commit, before the response reached the client: the retry replays the
//!   stored response at once; one row, one attempt.
//!
//! A crash before the claim commits leaves nothing behind: the retry is simply a first request.

use idem_runtime::sqlx::{self, postgres::PgPool, sqlite::SqlitePool};
use idem_tests::services::TestDb;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tokio::sync::mpsc;

/// How long anything may take before it counts as hung.
const HANG: Duration = Duration::from_secs(60);

/// A running `txn_crash_server`.
struct Server {
    child: Child,
    base: String,
    /// The lines it prints, after the first.
    lines: mpsc::UnboundedReceiver<String>,
}

impl Server {
    /// Starts the server on `url`, dying at `crash` if given; returns once it listens.
    async fn start(url: &str, crash: Option<&str>) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_txn_crash_server"))
            .env("DATABASE_URL", url)
            .env("IDEM_CRASH_AT", crash.unwrap_or(""))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start txn_crash_server");
        let stdout = child.stdout.take().expect("piped stdout");
        let (send, mut lines) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        let first = tokio::time::timeout(HANG, lines.recv())
            .await
            .expect("the server starts")
            .expect("the server prints where it listens");
        let addr = first
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from the server: {first:?}"));
        Self {
            base: format!("http://{addr}"),
            child,
            lines,
        }
    }

    /// Returns once a handler is in its foreign call, with the downstream key it charged under.
    async fn until_in_call(&mut self) -> String {
        let line = tokio::time::timeout(HANG, self.lines.recv())
            .await
            .expect("a handler reaches its foreign call")
            .expect("the server is alive");
        line.strip_prefix("in call ")
            .unwrap_or_else(|| panic!("unexpected line from the server: {line:?}"))
            .to_owned()
    }

    /// Kills the process (SIGKILL) and waits for it to end.
    fn kill(mut self) {
        self.child.kill().expect("kill the server");
        let status = self.child.wait().expect("wait for the server");
        assert_eq!(status.signal(), Some(9), "killed, not {status:?}");
    }

    /// Waits for the process to end; it must have aborted (SIGABRT).
    fn assert_aborted(mut self) {
        let status = self.child.wait().expect("wait for the server");
        assert_eq!(status.signal(), Some(6), "aborted, not {status:?}");
    }

    /// Lets the requests it holds go on.
    async fn release(&self) {
        let response = reqwest::Client::new()
            .post(format!("{}/release", self.base))
            .send()
            .await
            .expect("release");
        assert_eq!(response.status(), 204);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Only this test's own child, by its handle.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Debug)]
struct Reply {
    status: u16,
    replayed: bool,
    body: Value,
}

/// `POST /entries` as alice under `key`, `hold`ing the handler in its foreign call if asked.
async fn create(base: String, key: &'static str, hold: bool) -> Result<Reply, reqwest::Error> {
    let client = reqwest::Client::builder().timeout(HANG).build()?;
    let response = client
        .post(format!("{base}/entries"))
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .json(&json!({ "amount": 1000, "hold": hold }))
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

/// The database a scenario runs on, read by the test on connections of its own.
enum Db {
    Sqlite(tempfile::TempDir),
    Postgres(Box<TestDb>),
}

impl Db {
    fn sqlite() -> Self {
        Db::Sqlite(tempfile::tempdir().expect("temp dir"))
    }

    async fn postgres() -> Self {
        Db::Postgres(Box::new(TestDb::create().await))
    }

    fn url(&self) -> String {
        match self {
            Db::Sqlite(dir) => format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("crash.db").display()
            ),
            Db::Postgres(db) => db.url(),
        }
    }

    async fn ledger_rows(&self) -> i64 {
        let count = "SELECT count(*) FROM ledger";
        match self {
            Db::Sqlite(_) => {
                let pool = SqlitePool::connect(&self.url()).await.expect("open");
                let n = sqlx::query_scalar(count).fetch_one(&pool).await;
                pool.close().await;
                n.expect("count")
            }
            Db::Postgres(db) => {
                let pool = PgPool::connect_with(db.options()).await.expect("connect");
                let n = sqlx::query_scalar(count).fetch_one(&pool).await;
                pool.close().await;
                n.expect("count")
            }
        }
    }

    /// The card network's charges: (downstream key, attempts).
    async fn charges(&self) -> Vec<(String, i64)> {
        let all = "SELECT downstream_key, attempts FROM charges ORDER BY downstream_key";
        match self {
            Db::Sqlite(_) => {
                let pool = SqlitePool::connect(&self.url()).await.expect("open");
                let rows = sqlx::query_as(all).fetch_all(&pool).await;
                pool.close().await;
                rows.expect("charges")
            }
            Db::Postgres(db) => {
                let pool = PgPool::connect_with(db.options()).await.expect("connect");
                let rows = sqlx::query_as(all).fetch_all(&pool).await;
                pool.close().await;
                rows.expect("charges")
            }
        }
    }
}

/// After a crash that left `key`'s claim in flight with its charge made (`downstream`) and no
/// ledger row: a fresh server takes the claim over once its lease has run out, charges again under
/// the same downstream key, writes the one row, and replays from then on.
async fn the_retry_takes_over(db: &Db, key: &'static str, downstream: String) {
    assert_eq!(db.ledger_rows().await, 0, "nothing but the claim committed");
    assert_eq!(db.charges().await, [(downstream.clone(), 1)]);

    let server = Server::start(&db.url(), None).await;
    // The server waits (up to 30 s) for the dead claim's 2 s lease to run out, then takes over.
    let retry = create(server.base.clone(), key, false)
        .await
        .expect("retry");
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(!retry.replayed, "nothing was committed: the retry executes");
    assert_eq!(retry.body["taken_over"], true);
    assert_eq!(retry.body["downstream_key"], downstream.as_str());
    assert_eq!(db.ledger_rows().await, 1);
    assert_eq!(
        db.charges().await,
        [(downstream, 2)],
        "one charge, attempted twice under the same key"
    );

    let again = create(server.base.clone(), key, false)
        .await
        .expect("second retry");
    assert!(again.replayed, "{again:?}");
    assert_eq!(again.body, retry.body);
    assert_eq!(db.ledger_rows().await, 1, "executed once");
}

/// SIGKILL while the handler is in its foreign call: the charge is made, the transaction never
/// began.
async fn killed_in_the_foreign_call(db: Db) {
    let mut crashing = Server::start(&db.url(), Some("in_call")).await;
    let lost = tokio::spawn(create(crashing.base.clone(), "k-call", false));
    let downstream = crashing.until_in_call().await;
    crashing.kill();
    assert!(
        lost.await.expect("request task").is_err(),
        "the server died mid-request"
    );
    the_retry_takes_over(&db, "k-call", downstream).await;
}

/// Abort after the ledger write, before idem stores the response and commits.
async fn aborted_before_the_commit(db: Db) {
    let mut crashing = Server::start(&db.url(), Some("before_commit")).await;
    let lost = tokio::spawn(create(crashing.base.clone(), "k-before", false));
    let downstream = crashing.until_in_call().await;
    assert!(
        lost.await.expect("request task").is_err(),
        "the server died mid-request"
    );
    crashing.assert_aborted();
    the_retry_takes_over(&db, "k-before", downstream).await;
}

/// Abort after the commit, before the response reaches the client: the retry replays at once.
async fn aborted_after_the_commit(db: Db) {
    let crashing = Server::start(&db.url(), Some("after_commit")).await;
    let lost = create(crashing.base.clone(), "k-after", false).await;
    assert!(lost.is_err(), "the response never reached the client");
    crashing.assert_aborted();
    assert_eq!(
        db.ledger_rows().await,
        1,
        "the write committed with the record"
    );

    let server = Server::start(&db.url(), None).await;
    let retry = create(server.base.clone(), "k-after", false)
        .await
        .expect("retry");
    assert_eq!(retry.status, 201, "{retry:?}");
    assert!(retry.replayed, "the committed response is replayed");
    assert_eq!(retry.body["amount"], 1000);
    assert_eq!(retry.body["taken_over"], false);
    assert_eq!(db.ledger_rows().await, 1, "not executed again");
    let charges = db.charges().await;
    assert_eq!(charges.len(), 1);
    assert_eq!(charges[0].1, 1, "charged once");
}

#[tokio::test]
async fn sqlite_killed_in_the_foreign_call_the_retry_takes_over() {
    killed_in_the_foreign_call(Db::sqlite()).await;
}

#[tokio::test]
async fn sqlite_aborted_before_the_commit_the_retry_takes_over() {
    aborted_before_the_commit(Db::sqlite()).await;
}

#[tokio::test]
async fn sqlite_aborted_after_the_commit_the_retry_replays() {
    aborted_after_the_commit(Db::sqlite()).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test]
async fn postgres_killed_in_the_foreign_call_the_retry_takes_over() {
    killed_in_the_foreign_call(Db::postgres().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test]
async fn postgres_aborted_before_the_commit_the_retry_takes_over() {
    aborted_before_the_commit(Db::postgres().await).await;
}

#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test]
async fn postgres_aborted_after_the_commit_the_retry_replays() {
    aborted_after_the_commit(Db::postgres().await).await;
}

/// Two processes on one database: duplicates sent to the second wait for the original running in
/// the first (woken across processes by PostgreSQL's `NOTIFY`) and replay it. The original's
/// charge is the only one: no duplicate ran the handler.
#[cfg_attr(skip_postgres, ignore = "needs PostgreSQL, skipped by IDEM_TEST_SKIP")]
#[tokio::test]
async fn postgres_duplicates_in_another_process_replay_the_original() {
    let db = Db::postgres().await;
    let Db::Postgres(test_db) = &db else {
        unreachable!()
    };
    let mut first = Server::start(&db.url(), None).await;
    let second = Server::start(&db.url(), None).await;
    let original = tokio::spawn(create(first.base.clone(), "k-dup", true));
    let downstream = first.until_in_call().await;
    let duplicates: Vec<_> = (0..3)
        .map(|_| tokio::spawn(create(second.base.clone(), "k-dup", true)))
        .collect();

    // A duplicate that waits marks the record as awaited (so that its completion notifies).
    let checks = PgPool::connect_with(test_db.options())
        .await
        .expect("checks");
    tokio::time::timeout(HANG, async {
        loop {
            let watched: Option<bool> = sqlx::query_scalar(
                "SELECT watched FROM idem.records WHERE scope = 'alice' AND key = 'k-dup'",
            )
            .fetch_optional(&checks)
            .await
            .expect("record");
            if watched == Some(true) {
                return;
            }
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("a duplicate waits in the second process");

    first.release().await;
    let original = original.await.expect("task").expect("original");
    assert_eq!(original.status, 201, "{original:?}");
    assert!(!original.replayed);
    for duplicate in duplicates {
        let reply = duplicate.await.expect("task").expect("duplicate");
        assert_eq!(reply.status, 201, "{reply:?}");
        assert!(reply.replayed, "{reply:?}");
        assert_eq!(reply.body, original.body);
    }
    assert_eq!(db.ledger_rows().await, 1);
    assert_eq!(db.charges().await, [(downstream, 1)]);
}
