//! Configuration, the report's opening (the machine, how to run) and number formatting.

use std::time::Duration;

/// Bench settings, from the environment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    /// Seconds per throughput cell (`IDEM_BENCH_SECS`, default 1).
    pub(crate) secs: f64,
    /// Interleaved rounds per cell; medians are reported (`IDEM_BENCH_ROUNDS`, default 5).
    pub(crate) rounds: usize,
}

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
        .unwrap_or(default)
}

impl Config {
    pub(crate) fn from_env() -> Self {
        Self {
            secs: env("IDEM_BENCH_SECS", 1.0),
            rounds: env("IDEM_BENCH_ROUNDS", 5usize).max(1),
        }
    }

    pub(crate) fn cell(&self) -> Duration {
        Duration::from_secs_f64(self.secs)
    }
}

/// A duration in ns (below 1 µs: the memory store's claims), µs or ms, 3 significant digits.
pub(crate) fn dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1.0 {
        format!("{} ns", d.as_nanos())
    } else if us < 1000.0 {
        format!("{us:.0} µs")
    } else if us < 10_000_000.0 {
        format!("{:.2} ms", us / 1000.0)
    } else {
        format!("{:.1} s", us / 1e6)
    }
}

/// A sample's p50 / p99 / p99.9 latencies, as the tables show them.
pub(crate) fn tails(s: &crate::load::Sample) -> String {
    format!(
        "{} / {} / {}",
        dur(s.quantile(0.5)),
        dur(s.quantile(0.99)),
        dur(s.quantile(0.999))
    )
}

pub(crate) fn rate(r: f64) -> String {
    if r >= 10_000.0 {
        format!("{:.1}k", r / 1000.0)
    } else {
        format!("{r:.0}")
    }
}

pub(crate) fn pct(r: f64) -> String {
    format!("{:.0}%", r * 100.0)
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The report's title, how to run it, and the machine it ran on.
pub(crate) fn intro(cfg: &Config, services: &str) -> String {
    format!(
        "# Benchmarks

What idempotency costs with idem: over HTTP beside the same handler without it and beside the
peer crate axum-idempotent, at the store level against each store's own floor, as a function call
(`Engine::once`) beside the engine's own path, and in store operations per request. Every table below comes from one run of

```sh
cargo run --release --manifest-path benches/Cargo.toml -- all > BENCHMARKS.md
```

with PostgreSQL at `postgres://postgres@127.0.0.1:5432` (the bench creates its own database
`idem_bench`), MySQL or MariaDB at `mysql://root@127.0.0.1:3306/idem_bench` (created if missing,
emptied) and Redis at `redis://127.0.0.1:6379/7` (flushed); override them with
`IDEM_BENCH_POSTGRES_URL`, `IDEM_BENCH_MYSQL_URL` and `IDEM_BENCH_REDIS_URL`. The Redis Cluster section needs a cluster
(`.ci/redis-cluster start`, or `IDEM_BENCH_REDIS_CLUSTER_URL`) and is skipped without one.
`IDEM_BENCH_SECS` sets the seconds per throughput cell and `IDEM_BENCH_ROUNDS` the interleaved
rounds; `IDEM_BENCH_STORES=memory,redis` limits the stores. One section runs alone with `-- http`,
`-- store`, `-- function`, `-- roundtrips` or `-- cluster`. `cargo bench --manifest-path benches/Cargo.toml --bench hot_path` runs the
criterion micro-benchmarks of the in-process path. The last section, before and after a change,
comes from `benches/before-after/run <commit> >> BENCHMARKS.md`, which builds the same server from
that commit and from HEAD and loads the two in turns.

## The machine

{machine}; {services}. This run: {secs} s per cell, {rounds} rounds. The load generator, the
servers and the stores share the same CPUs, so absolute figures move with the machine and the day:
compare the ratios, which are taken between cells measured in the same round, interleaved in
slices so that a slow moment of the machine falls on every cell alike.
",
        machine = machine(),
        secs = cfg.secs,
        rounds = cfg.rounds,
    )
}

/// The machine, from `/proc`.
pub(crate) fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or_else(
            || "?".into(),
            |kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0),
        );
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    format!(
        "{cores} CPUs, {mem} memory, {cpu}, load average {} at the start",
        load.join(" ")
    )
}
