//! More instances: new keys over HTTP against one or more running servers (the payments example,
//! started by `benches/scale/instances`), 16 keep-alive connections per server, the aggregate rate
//! and latency; and what each group of processes spent of the machine's CPUs meanwhile, read from
//! `/proc`, which shows what bounds the rate.

use crate::load::{Bounds, Connections, Keys, Sample};
use crate::report::{dur, rate, Config};
use std::net::SocketAddr;
use std::time::Instant;

/// Connections per server.
const PER_SERVER: usize = 16;

/// CPU seconds (user and system) of the processes `pids`, from `/proc/<pid>/stat`.
fn cpu_secs(pids: &[u32]) -> f64 {
    // Clock ticks per second: 100 on Linux for every architecture this runs on.
    const TICKS: f64 = 100.0;
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // Fields after the command (which may hold spaces) from `) `: utime is the 12th, stime
            // the 13th.
            let rest = stat.rsplit_once(") ")?.1;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = fields.get(11)?.parse().ok()?;
            let stime: f64 = fields.get(12)?.parse().ok()?;
            Some((utime + stime) / TICKS)
        })
        .sum()
}

/// `IDEM_SCALE_CPU`: `name=pid,pid;name=pid`, the groups whose CPU time is reported.
fn groups() -> Vec<(String, Vec<u32>)> {
    std::env::var("IDEM_SCALE_CPU")
        .unwrap_or_default()
        .split(';')
        .filter_map(|g| {
            let (name, pids) = g.split_once('=')?;
            let pids = pids
                .split(',')
                .filter_map(|p| p.trim().parse().ok())
                .collect();
            Some((name.trim().to_owned(), pids))
        })
        .collect()
}

/// Loads the servers of `IDEM_SCALE_TARGETS` (comma-separated `host:port`) and prints one table
/// row, labelled `IDEM_SCALE_LABEL`.
pub(crate) async fn run(cfg: &Config) {
    let targets: Vec<SocketAddr> = std::env::var("IDEM_SCALE_TARGETS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|a| a.trim().parse().ok())
        .collect();
    if targets.is_empty() {
        eprintln!("instances: IDEM_SCALE_TARGETS names no server");
        return;
    }
    let label = std::env::var("IDEM_SCALE_LABEL").unwrap_or_else(|_| "servers".into());
    let mut loads = Vec::new();
    for (i, addr) in targets.iter().enumerate() {
        let keys = Keys::Fresh(format!("inst-{}-{i}", std::process::id()).into());
        loads.push(Connections::open(*addr, "/payments", keys, PER_SERVER).await);
    }
    let groups = groups();
    let own = [std::process::id()];
    let before: Vec<f64> = groups.iter().map(|(_, p)| cpu_secs(p)).collect();
    let own_before = cpu_secs(&own);
    let started = Instant::now();
    let bounds = Bounds {
        time: cfg.cell().mul_f64(cfg.rounds as f64),
        requests: u64::MAX,
    };
    let runs: Vec<_> = loads
        .into_iter()
        .map(|mut c| {
            tokio::spawn(async move {
                c.run(bounds).await;
                c.sample()
            })
        })
        .collect();
    let mut all = Sample::default();
    for run in runs {
        let s = run.await.expect("load");
        all.ok += s.ok;
        all.errors += s.errors;
        all.latencies.extend(s.latencies);
    }
    let wall = started.elapsed().as_secs_f64();
    all.latencies.sort_unstable();
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    let mut cpu = vec![format!(
        "load generator {:.0}%",
        100.0 * (cpu_secs(&own) - own_before) / wall
    )];
    for ((name, pids), b) in groups.iter().zip(before) {
        cpu.push(format!(
            "{name} {:.0}%",
            100.0 * (cpu_secs(pids) - b) / wall
        ));
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "| {label} | {} | {} | {} / {} | {} | {} (of {:.0}%) | {} |",
        targets.len(),
        rate(all.ok as f64 / wall),
        dur(all.quantile(0.5)),
        dur(all.quantile(0.99)),
        all.errors,
        cpu.join(", "),
        cores * 100.0,
        load.split_whitespace().next().unwrap_or("?"),
    );
}
