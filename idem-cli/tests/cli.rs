//! The `idem` binary, run as a script would run it, against stores seeded through idem itself and
//! read back directly: exit codes, `--json` shapes, and what each command does to the records.
//! SQLite always; PostgreSQL and Redis at `IDEM_TEST_POSTGRES_URL` / `IDEM_TEST_REDIS_URL` (under
//! `CI=true` an unset or unreachable service fails the test, otherwise it is skipped with a note).

use idem_runtime::policy::Policy;
use idem_runtime::store::{Claim, ClaimOutcome, Store};
use idem_runtime::{Begin, Engine, FencingToken, Fingerprint, RecordKey, StoredResponse};
use serde_json::Value;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// What one run of `idem` did.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        match serde_json::from_str(&self.stdout) {
            Ok(value) => value,
            Err(e) => panic!("not JSON ({e}): {self:?}"),
        }
    }
}

fn idem(args: &[&str]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("IDEM_STORE_URL")
        .output()
        .expect("the idem binary runs");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// A store seeded with: a completed record (`alice`, `order-1`), another of alice's
/// (`order-2`), one of bob's (`order-1`), a live claim (`alice`, `stuck`) and a dead one
/// (`carol`, `crashed`).
struct Seeded {
    url: String,
    store: Arc<dyn Store>,
    engine: Engine,
}

const BODY: &str = r#"{"id":"pay_1","amount":1000}"#;

async fn seed(url: String) -> Seeded {
    let opened = idem_runtime::store::open(&url)
        .await
        .expect("the test store opens");
    let engine = Engine::from_arc(opened.store.clone());
    for (scope, key) in [
        ("alice", "order-1"),
        ("alice", "order-2"),
        ("bob", "order-1"),
    ] {
        complete(&engine, scope, key).await;
    }
    claim(&*opened.store, "alice", "stuck", Duration::from_secs(600)).await;
    claim(&*opened.store, "carol", "crashed", Duration::ZERO).await;
    Seeded {
        url,
        store: opened.store,
        engine,
    }
}

fn fingerprint(key: &str) -> Fingerprint {
    Fingerprint::of_request(
        "POST",
        "/payments",
        Some("application/json"),
        key.as_bytes(),
    )
}

async fn complete(engine: &Engine, scope: &str, key: &str) {
    let begun = engine
        .begin(RecordKey::new(scope, key), fingerprint(key), &Policy::new())
        .await;
    let Ok(Begin::Execute(claim)) = begun else {
        panic!("a fresh key executes: {begun:?}")
    };
    let response = StoredResponse {
        status: 201,
        headers: vec![(
            idem_runtime::http::header::CONTENT_TYPE,
            idem_runtime::http::HeaderValue::from_static("application/json"),
        )],
        body: BODY.into(),
    };
    claim
        .complete(&response)
        .await
        .expect("the response is stored");
}

/// A claim left in flight, as a worker that stopped leaves it.
async fn claim(store: &dyn Store, scope: &str, key: &str, lease: Duration) {
    let record_key = RecordKey::new(scope, key);
    let claim = Claim {
        key: &record_key,
        fingerprint: fingerprint(key),
        token: FencingToken::generate(),
        lease,
        ttl: Duration::from_secs(3600),
        retain: Duration::from_secs(7200),
    };
    let outcome = store.claim(&claim).await.expect("the claim is stored");
    assert!(matches!(outcome, ClaimOutcome::Claimed(_)), "{outcome:?}");
}

async fn exists(store: &dyn Store, scope: &str, key: &str) -> bool {
    let found = store.get(&RecordKey::new(scope, key)).await;
    found.expect("the store answers").is_some()
}

/// `inspect` against `seeded`: found (0) with the record's fields, or not (1).
async fn inspect_commands(seeded: &Seeded) {
    let url = seeded.url.as_str();
    // inspect: found (0) with the record's fields, or not (1).
    let run = idem(&[
        "inspect", "--store", url, "--scope", "alice", "--key", "order-1", "--json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let seen = run.json();
    assert_eq!(seen["found"], true);
    assert_eq!(seen["scope"], "alice");
    assert_eq!(seen["key"], "order-1");
    assert_eq!(seen["state"], "completed");
    assert_eq!(seen["expired"], false);
    assert_eq!(seen["lease_live"], false);
    assert_eq!(seen["lease_until"], Value::Null);
    assert_eq!(seen["response"]["status"], 201);
    assert_eq!(seen["response"]["body_bytes"], BODY.len());
    assert_eq!(
        seen["response"]["headers"],
        serde_json::json!([["content-type", "application/json"]])
    );
    for field in ["created_at", "expires_at", "retain_until", "now"] {
        let time = seen[field].as_str().unwrap_or_default();
        assert!(time.ends_with('Z') && time.len() == 24, "{field}: {time}");
    }
    assert_eq!(seen["fingerprint"].as_str().map(str::len), Some(64));
    let run = idem(&[
        "inspect", "--store", url, "--scope", "alice", "--key", "order-1",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout.contains("completed") && run.stdout.contains("201"),
        "{run:?}"
    );
    let run = idem(&[
        "inspect", "--store", url, "--scope", "alice", "--key", "nope", "--json",
    ]);
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(
        run.json(),
        serde_json::json!({"found": false, "scope": "alice", "key": "nope"})
    );
    let run = idem(&[
        "inspect", "--store", url, "--scope", "alice", "--key", "stuck", "--json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.json()["state"], "in_flight");
    assert_eq!(run.json()["lease_live"], true);
}

/// Every command against `seeded`: the shared body of the per-store tests.
async fn every_command(seeded: Seeded) {
    inspect_commands(&seeded).await;
    let url = seeded.url.as_str();
    let store = &*seeded.store;

    // stats: counts by state.
    let run = idem(&["stats", "--store", url, "--json"]);
    assert_eq!(run.code, 0, "{run:?}");
    let stats = run.json();
    assert_eq!(stats["completed"], 3, "{stats}");
    assert_eq!(stats["in_flight"], 2, "{stats}");
    assert_eq!(stats["released"], 0, "{stats}");
    assert!(stats["oldest_in_flight"].is_string(), "{stats}");
    assert_eq!(stats["store"], store.kind());

    // in-flight: both claims at any age, the dead one's lease run out; none a day old (1).
    let run = idem(&["in-flight", "--store", url, "--older-than", "0s", "--json"]);
    assert_eq!(run.code, 0, "{run:?}");
    let listed = run.json();
    let records = listed["records"].as_array().cloned().unwrap_or_default();
    let mut found: Vec<(String, bool)> = records
        .iter()
        .map(|r| {
            (
                format!(
                    "{}/{}",
                    r["scope"].as_str().unwrap_or(""),
                    r["key"].as_str().unwrap_or("")
                ),
                r["lease_live"] == true,
            )
        })
        .collect();
    found.sort();
    assert_eq!(
        found,
        vec![
            ("alice/stuck".to_owned(), true),
            ("carol/crashed".to_owned(), false)
        ],
        "{listed}"
    );
    let run = idem(&["in-flight", "--store", url, "--older-than", "0s"]);
    assert!(
        run.stdout.contains("SCOPE") && run.stdout.contains("crashed"),
        "{run:?}"
    );
    let run = idem(&["in-flight", "--store", url, "--older-than", "1d", "--json"]);
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.json()["records"], serde_json::json!([]));

    // forget: a completed record goes (0), and the key then runs again.
    let run = idem(&[
        "forget", "--store", url, "--scope", "alice", "--key", "order-1", "--json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.json()["result"], "deleted");
    assert_eq!(run.json()["state"], "completed");
    assert!(!exists(store, "alice", "order-1").await);
    // A forgotten key runs again on its next request.
    complete(&seeded.engine, "alice", "order-1").await;
    let run = idem(&[
        "forget", "--store", url, "--scope", "alice", "--key", "nope", "--json",
    ]);
    assert_eq!(run.code, 1, "{run:?}");
    assert_eq!(run.json()["result"], "not_found");

    // forget: a live claim only with --force; a dead one with --dead-claims.
    for refused in [vec![], vec!["--dead-claims"]] {
        let mut args = vec![
            "forget", "--store", url, "--scope", "alice", "--key", "stuck", "--json",
        ];
        args.extend(refused);
        let run = idem(&args);
        assert_eq!(run.code, 1, "{run:?}");
        assert_eq!(run.json()["result"], "refused");
        assert_eq!(run.json()["lease_live"], true);
    }
    let run = idem(&[
        "forget", "--store", url, "--scope", "alice", "--key", "stuck",
    ]);
    assert!(run.stdout.contains("--force"), "{run:?}");
    assert!(exists(store, "alice", "stuck").await);
    let run = idem(&[
        "forget", "--store", url, "--scope", "alice", "--key", "stuck", "--force",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(!exists(store, "alice", "stuck").await);
    let run = idem(&[
        "forget",
        "--store",
        url,
        "--scope",
        "carol",
        "--key",
        "crashed",
        "--dead-claims",
        "--json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.json()["state"], "in_flight");
    assert!(!exists(store, "carol", "crashed").await);

    // erase: every record of alice's and none of bob's.
    complete(&seeded.engine, "alice", "order-3").await;
    let run = idem(&["erase", "--store", url, "--scope", "alice", "--json"]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(
        run.json(),
        serde_json::json!({"scope": "alice", "erased": 3})
    );
    for key in ["order-1", "order-2", "order-3"] {
        assert!(!exists(store, "alice", key).await, "alice/{key} erased");
    }
    assert!(exists(store, "bob", "order-1").await, "bob's record kept");
    let run = idem(&["erase", "--store", url, "--scope", "alice"]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("erased 0 record"), "{run:?}");
}

fn sqlite_url(dir: &tempfile::TempDir) -> String {
    format!("sqlite://{}?mode=rwc", dir.path().join("idem.db").display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    inspect_commands(&seed(sqlite_url(&dir)).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_on_sqlite() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let seeded = seed(sqlite_url(&dir)).await;
    every_command(seeded).await;
}

/// The erase leaves no body of the erased scope in the SQLite file's live rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erase_on_sqlite_leaves_no_row_of_the_scope() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let seeded = seed(sqlite_url(&dir)).await;
    let run = idem(&[
        "erase",
        "--store",
        &seeded.url,
        "--scope",
        "alice",
        "--json",
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(run.json()["erased"], 3);
    let pool = idem_runtime::sqlx::SqlitePool::connect(&seeded.url)
        .await
        .expect("the file opens");
    let rows: Vec<(String, i64)> = idem_runtime::sqlx::query_as(
        "SELECT scope, COUNT(*) FROM idem_records GROUP BY scope ORDER BY scope",
    )
    .fetch_all(&pool)
    .await
    .expect("the table reads");
    assert_eq!(rows, vec![("bob".to_owned(), 1), ("carol".to_owned(), 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(skip_postgres, ignore = "IDEM_TEST_SKIP names postgres")]
async fn every_command_on_postgres() {
    let db = idem_tests::services::TestDb::create().await;
    every_command(seed(db.url()).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(skip_redis, ignore = "IDEM_TEST_SKIP names redis")]
async fn every_command_on_redis() {
    let redis = idem_tests::services::RedisPrefix::create().await;
    every_command(seed(with_prefix(redis.url(), redis.prefix())).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(skip_redis_cluster, ignore = "IDEM_TEST_SKIP names redis-cluster")]
async fn every_command_on_redis_cluster() {
    let cluster = idem_tests::services::RedisClusterPrefix::create().await;
    every_command(seed(with_prefix(cluster.url(), cluster.prefix())).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(skip_mysql, ignore = "IDEM_TEST_SKIP names mysql")]
async fn every_command_on_mysql() {
    let db = idem_tests::services::MySqlTestDb::create().await;
    every_command(seed(db.url()).await).await;
}

/// `url` with idem's `prefix` parameter.
fn with_prefix(url: &str, prefix: &str) -> String {
    let joint = if url.contains('?') { '&' } else { '?' };
    format!("{url}{joint}prefix={prefix}")
}

#[test]
fn usage_errors_exit_2_with_clap_s_message() {
    let run = idem(&["inspect", "--store", "sqlite::memory:", "--key", "k"]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("--scope"), "{run:?}");
    let run = idem(&[
        "in-flight",
        "--store",
        "sqlite::memory:",
        "--older-than",
        "5 parsecs",
    ]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("unknown unit"), "{run:?}");
    let run = idem(&[
        "forget",
        "--store",
        "x",
        "--scope",
        "s",
        "--key",
        "k",
        "--force",
        "--dead-claims",
    ]);
    assert_eq!(run.code, 2, "{run:?}");
    let run = idem(&["stats"]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("--store"), "{run:?}");
    assert_eq!(idem(&["--help"]).code, 0);
}

#[test]
fn a_store_that_cannot_be_opened_exits_2_with_a_clear_message() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let missing = format!("sqlite://{}", dir.path().join("no/such.db").display());
    let run = idem(&["stats", "--store", &missing]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr
            .starts_with("idem: cannot open the store: SQLite"),
        "{run:?}"
    );
    assert!(run.stdout.is_empty(), "{run:?}");
    let run = idem(&["stats", "--store", "ftp://secret@example.com"]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr.contains("no idempotency store for `ftp:` URLs"),
        "{run:?}"
    );
    assert!(
        !run.stderr.contains("secret"),
        "the URL is not echoed: {run:?}"
    );
    // Nothing listens on port 1.
    let run = idem(&[
        "stats",
        "--store",
        "postgres://postgres:secret@127.0.0.1:1/idem",
    ]);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr.contains("cannot open the store: PostgreSQL"),
        "{run:?}"
    );
    assert!(!run.stderr.contains("secret"), "{run:?}");
}

#[test]
fn the_store_url_can_come_from_idem_store_url() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = sqlite_url(&dir);
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["inspect", "--scope", "s", "--key", "k", "--json"])
        .env("IDEM_STORE_URL", &url)
        .output()
        .expect("the idem binary runs");
    assert_eq!(output.status.code(), Some(1), "{output:?}");
}
