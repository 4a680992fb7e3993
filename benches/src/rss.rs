//! Peak RSS of the payments example over a run of new keys, read from `/proc/<pid>/status`: VmRSS
//! split into its anonymous part (the heap and stacks: what a leak grows), its file-backed part
//! (the binary's pages and mapped files) and its shared-memory part, plus the peak (VmHWM).
//!
//! Where the example keeps its idempotency records is chosen with `IDEM_BENCH_RSS_STORE` (see
//! [`Records`]) and checked at the end of the run by counting the records in that file, so that the
//! table never describes a configuration the run did not have.

use crate::load::{self, Bounds, Keys};
use crate::report::{dur, rate, Config};
use crate::setup;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::ConnectOptions;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CONNECTIONS: usize = 16;
const STEPS: u64 = 10;

fn status(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn mib(kib: Option<u64>) -> String {
    kib.map_or_else(|| "?".into(), |k| format!("{:.1} MiB", k as f64 / 1024.0))
}

/// The memory columns of one table row: VmRSS, RssAnon, RssFile, RssShmem, VmHWM.
fn memory(pid: u32) -> String {
    ["VmRSS:", "RssAnon:", "RssFile:", "RssShmem:", "VmHWM:"]
        .map(|field| mib(status(pid, field)))
        .join(" | ")
}

/// Where the payments example keeps its idempotency records in this run.
struct Records {
    /// `IDEM_STORE_URL` for the example (`None`: unset, the records share the ledger's file).
    url: Option<String>,
    /// The configuration, as the report states it.
    describe: &'static str,
    /// The SQLite file that must hold one record per key at the end, if the records are in one.
    file: Option<PathBuf>,
}

impl Records {
    /// From `IDEM_BENCH_RSS_STORE`: `shared` (the default: the example's default configuration,
    /// records in the ledger's SQLite file on the ledger's pool, `POST /payments` in transactional
    /// mode), `sqlite` (a second SQLite file: the non-transactional path) or `memory`.
    fn from_env(dir: &Path) -> Self {
        match std::env::var("IDEM_BENCH_RSS_STORE").as_deref() {
            Ok("sqlite") => Self {
                url: Some(format!("sqlite://{}/idem.db?mode=rwc", dir.display())),
                describe: "SQLite ledger, records in a second SQLite file (`IDEM_STORE_URL=sqlite:…`), both WAL",
                file: Some(dir.join("idem.db")),
            },
            Ok("memory") => Self {
                url: Some("memory".to_owned()),
                describe: "SQLite ledger (WAL), records in memory (`IDEM_STORE_URL=memory`)",
                file: None,
            },
            _ => Self {
                url: None,
                describe: "the default configuration: SQLite ledger and records in one file, WAL, `POST /payments` transactional",
                file: Some(dir.join("payments.db")),
            },
        }
    }

    /// How many records `file` holds; `None` if it cannot be read.
    async fn count(file: &Path) -> Option<i64> {
        let mut conn = SqliteConnectOptions::new()
            .filename(file)
            .connect()
            .await
            .ok()?;
        sqlx::query_scalar("SELECT count(*) FROM idem_records")
            .fetch_one(&mut conn)
            .await
            .ok()
    }
}

pub(crate) async fn run(cfg: &Config) {
    let time_cap = Duration::from_secs(
        std::env::var("IDEM_BENCH_RSS_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(240),
    );
    println!("\n## Peak RSS of the payments example\n");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let dir = setup::scratch().join("payments");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("payments dir");
    let records = Records::from_env(&dir);
    let exe = std::env::current_exe().expect("current exe");
    let mut command = Command::new(exe);
    command
        .arg("serve-payments")
        .env("PORT", port.to_string())
        .env(
            "DATABASE_URL",
            format!("sqlite://{}/payments.db?mode=rwc", dir.display()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    match &records.url {
        Some(url) => command.env("IDEM_STORE_URL", url),
        None => command.env_remove("IDEM_STORE_URL"),
    };
    let mut child = command.spawn().expect("spawn payments");
    let pid = child.id();
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let ready = Instant::now();
    while load::connect(addr).await.is_err() {
        if ready.elapsed() > Duration::from_secs(30) {
            eprintln!("payments did not start");
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("`POST /payments`, a new `Idempotency-Key` per request, {CONNECTIONS} connections, {}, in a scratch directory; stopped at {} keys or {} whichever comes first.\n", records.describe, cfg.rss_keys, dur(time_cap));
    println!(
        "| keys sent | req/s in the step | VmRSS | RssAnon | RssFile | RssShmem | VmHWM (peak) |"
    );
    println!("|---|---|---|---|---|---|---|");
    println!("| 0 | — | {} |", memory(pid));
    let start = Instant::now();
    let step = cfg.rss_keys.div_ceil(STEPS);
    let mut sent = 0;
    let mut errors = 0;
    // RssAnon after the first step (the warm-up: pool connections, caches, buffers) and at the end.
    let mut first_step: Option<(u64, u64)> = None;
    let mut anon_end = None;
    while sent < cfg.rss_keys {
        let left = time_cap.saturating_sub(start.elapsed());
        if left.is_zero() {
            break;
        }
        let s = load::http(
            addr,
            "/payments",
            Keys::Fresh(format!("rss-{sent}").into()),
            CONNECTIONS,
            Bounds {
                time: left,
                requests: step.min(cfg.rss_keys - sent),
            },
        )
        .await;
        sent += s.ok;
        errors += s.errors;
        println!("| {sent} | {} | {} |", rate(s.throughput()), memory(pid));
        anon_end = status(pid, "RssAnon:");
        if first_step.is_none() {
            first_step = anon_end.map(|anon| (sent, anon));
        }
        if s.ok == 0 {
            break;
        }
    }
    let stored = match &records.file {
        Some(file) => Records::count(file).await,
        None => None,
    };
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "\n{sent} keys in {} ({errors} errors).",
        dur(start.elapsed())
    );
    if let (Some((keys, anon)), Some(end)) = (first_step, anon_end) {
        if sent > keys {
            let grown = end as f64 - anon as f64;
            println!(
                "RssAnon from the first step to the last: {:+.1} MiB over {} keys ({:+.0} bytes per key).",
                grown / 1024.0,
                sent - keys,
                grown * 1024.0 / (sent - keys) as f64
            );
        }
    }
    match (&records.file, stored) {
        (Some(file), Some(n)) => println!(
            "Records in `{}` at the end: {n}.",
            file.file_name().unwrap_or_default().to_string_lossy()
        ),
        (Some(file), None) => println!("Records in `{}`: could not be read.", file.display()),
        (None, _) => {}
    }
    if sent < cfg.rss_keys {
        println!("The time cap ended the run before {} keys: run `IDEM_BENCH_RSS_KEYS={} IDEM_BENCH_RSS_SECS=3600 cargo run --release -p idem-bench -- rss` for the full count.", cfg.rss_keys, cfg.rss_keys);
    }
}
