//! Peak RSS of the payments example (its default configuration: ledger and idempotency records in
//! one SQLite file) over a run of new keys, read from /proc/<pid>/status (VmHWM).

use crate::load::{self, Bounds, Keys};
use crate::report::{dur, rate, Config};
use crate::setup;
use std::net::SocketAddr;
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
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .arg("serve-payments")
        .env("PORT", port.to_string())
        .env(
            "DATABASE_URL",
            format!("sqlite://{}/payments.db?mode=rwc", dir.display()),
        )
        .env_remove("IDEM_STORE_URL")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn payments");
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
    println!("`POST /payments`, a new `Idempotency-Key` per request, {CONNECTIONS} connections, the default configuration (SQLite ledger and records, WAL, in a scratch directory); stopped at {} keys or {} whichever comes first.\n", cfg.rss_keys, dur(time_cap));
    println!("| keys sent | req/s in the step | VmRSS | VmHWM (peak) |");
    println!("|---|---|---|---|");
    println!(
        "| 0 | — | {} | {} |",
        mib(status(pid, "VmRSS:")),
        mib(status(pid, "VmHWM:"))
    );
    let start = Instant::now();
    let step = cfg.rss_keys.div_ceil(STEPS);
    let mut sent = 0;
    let mut errors = 0;
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
        println!(
            "| {sent} | {} | {} | {} |",
            rate(s.throughput()),
            mib(status(pid, "VmRSS:")),
            mib(status(pid, "VmHWM:"))
        );
        if s.ok == 0 {
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "\n{sent} keys in {} ({errors} errors).",
        dur(start.elapsed())
    );
    if sent < cfg.rss_keys {
        println!("The time cap ended the run before {} keys: run `IDEM_BENCH_RSS_KEYS={} IDEM_BENCH_RSS_SECS=3600 cargo run --release -p idem-bench -- rss` for the full count.", cfg.rss_keys, cfg.rss_keys);
    }
}
