//! The server's own CPU per request, with the load generator in another process: plain, idem's new
//! keys and replays on the memory store, and the memory floor by hand (`setup::floor`).
//!
//! The throughput section's load generator shares the server's process, runtime and two cores, so
//! its cells price a request as the machine sees it: the server's work, the load generator's, and
//! how the two tasks wake each other. Here each path gets a fresh server process of its own
//! (`idem-bench serve`, so no path inherits another's records or heap), the load runs in this one,
//! and the server's user and system time is read from `/proc` around the load. The paths run in
//! rotating order within each round; each path's difference to plain is taken round by round, so
//! that the machine's drift between rounds (a quarter or more of plain's CPU per request here) falls
//! on both sides of each difference.

use crate::load::{self, Bounds, Keys, Sample};
use crate::report::median;
use crate::throughput;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The paths measured.
const PATHS: [&str; 5] = ["plain", "new", "replay", "floor-new", "floor-replay"];

/// The pairs compared round by round: each path against plain, and idem's against the floor's.
const COMPARED: [(&str, &str); 6] = [
    ("new", "plain"),
    ("replay", "plain"),
    ("floor-new", "plain"),
    ("floor-replay", "plain"),
    ("new", "floor-new"),
    ("replay", "floor-replay"),
];

/// The route a path of `load` and of this section posts to, and the keys it sends (a replay path
/// first completes its keys on `addr`); `None` for an unknown path.
pub(crate) async fn route_and_keys(path: &str, addr: SocketAddr) -> Option<(&'static str, Keys)> {
    let route = match path {
        "plain" => "/plain",
        "new" | "replay" => "/idem",
        "floor-new" | "floor-replay" => "/floor",
        _ => return None,
    };
    let keys = if path.ends_with("replay") {
        throughput::seed_http(addr, route).await;
        Keys::Replay(throughput::http_replay_keys())
    } else {
        // Unique to this process: a second load on the same server sends new keys too.
        Keys::Fresh(format!("{path}-{}", std::process::id()).into())
    };
    Some((route, keys))
}

/// One path's run: its throughput and the server's CPU per request, in microseconds.
#[derive(Debug, Clone, Copy)]
struct Run {
    rps: f64,
    cpu_us: f64,
}

/// `server-cpu [rounds] [connections] [seconds]`.
pub(crate) async fn run(rounds: usize, connections: usize, secs: u64) {
    println!("\n## Server CPU per request, the load generator in another process\n");
    let mut runs: BTreeMap<&str, Vec<Run>> = BTreeMap::new();
    for round in 0..rounds {
        eprintln!("server-cpu: round {} of {rounds}", round + 1);
        for i in 0..PATHS.len() {
            let path = PATHS[(i + round) % PATHS.len()];
            match one(path, connections, secs).await {
                Some(run) => runs.entry(path).or_default().push(run),
                None => eprintln!("server-cpu: `{path}` failed in round {}", round + 1),
            }
        }
    }
    println!("{rounds} rounds; in each, every path on a fresh `idem-bench serve` process for {secs} s on {connections} connections after a 0.3 s warm-up, in rotating order. Medians over the rounds.\n");
    println!("| path | req/s | server CPU per request |");
    println!("|---|---|---|");
    for path in PATHS {
        if let Some(these) = runs.get(path) {
            println!(
                "| {path} | {:.0} | {:.2} µs |",
                median(these.iter().map(|r| r.rps).collect()),
                median(these.iter().map(|r| r.cpu_us).collect()),
            );
        }
    }
    println!("\nPaired by round: the median of each round's difference (or ratio) between the two paths' runs, and the interquartile range of those.\n");
    println!("| path | against | server CPU more per request | req/s ratio |");
    println!("|---|---|---|---|");
    for (path, base) in COMPARED {
        let (Some(these), Some(bases)) = (runs.get(path), runs.get(base)) else {
            continue;
        };
        let pairs: Vec<(Run, Run)> = bases.iter().copied().zip(these.iter().copied()).collect();
        let more: Vec<f64> = pairs.iter().map(|(b, r)| r.cpu_us - b.cpu_us).collect();
        let ratio: Vec<f64> = pairs.iter().map(|(b, r)| r.rps / b.rps.max(1e-9)).collect();
        println!(
            "| {path} | {base} | {:+.2} µs ({:+.2} to {:+.2}) | {:.1}% ({:.1}–{:.1}%) |",
            median(more.clone()),
            quartile(&more, 0.25),
            quartile(&more, 0.75),
            median(ratio.clone()) * 100.0,
            quartile(&ratio, 0.25) * 100.0,
            quartile(&ratio, 0.75) * 100.0,
        );
    }
}

/// The `q` quantile of `values` (nearest rank; 0 for none).
fn quartile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n => sorted[((n - 1) as f64 * q).round() as usize],
    }
}

/// Serves `path` from a fresh `serve` process and loads it from this one.
async fn one(path: &str, connections: usize, secs: u64) -> Option<Run> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .ok()?
        .port();
    let exe = std::env::current_exe().ok()?;
    let mut child = Command::new(exe)
        .args(["serve", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    let run = measure(
        path,
        child.id(),
        SocketAddr::from(([127, 0, 0, 1], port)),
        connections,
        secs,
    )
    .await;
    let _ = child.kill();
    let _ = child.wait();
    run
}

async fn measure(
    path: &str,
    pid: u32,
    addr: SocketAddr,
    connections: usize,
    secs: u64,
) -> Option<Run> {
    let started = Instant::now();
    while load::connect(addr).await.is_err() {
        if started.elapsed() > Duration::from_secs(30) {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (route, keys) = route_and_keys(path, addr).await?;
    let warm_up = Bounds {
        time: Duration::from_millis(300),
        requests: u64::MAX,
    };
    let warm_keys = match &keys {
        Keys::Fresh(prefix) => Keys::Fresh(format!("{prefix}-warm-up").into()),
        replays => replays.clone(),
    };
    let _ = load::http(addr, route, warm_keys, connections, warm_up).await;
    let before = crate::pid_cpu(pid)?;
    let bounds = Bounds {
        time: Duration::from_secs(secs),
        requests: u64::MAX,
    };
    let s: Sample = load::http(addr, route, keys, connections, bounds).await;
    let cpu = crate::pid_cpu(pid)? - before;
    (s.ok > 0 && s.errors == 0).then(|| Run {
        rps: s.throughput(),
        cpu_us: cpu * 1e6 / s.ok as f64,
    })
}
