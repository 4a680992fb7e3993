//! Formatting, configuration and the list of targets checked.

use std::sync::Mutex;
use std::time::Duration;

/// Bench settings, from the environment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Config {
    /// Seconds per throughput cell (`IDEM_BENCH_SECS`, default 1).
    pub(crate) secs: f64,
    /// Interleaved rounds per cell; medians are reported (`IDEM_BENCH_ROUNDS`, default 3).
    pub(crate) rounds: usize,
    /// Records for the large scale point (`IDEM_BENCH_SCALE`, default 1,000,000).
    pub(crate) scale: u64,
    /// Keys sent to the payments example for its peak RSS (`IDEM_BENCH_RSS_KEYS`, default 1,000,000).
    pub(crate) rss_keys: u64,
}

pub(crate) fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
        .unwrap_or(default)
}

impl Config {
    pub(crate) fn from_env() -> Self {
        Self {
            secs: env("IDEM_BENCH_SECS", 1.0),
            rounds: env("IDEM_BENCH_ROUNDS", 3usize).max(1),
            scale: env("IDEM_BENCH_SCALE", 1_000_000u64),
            rss_keys: env("IDEM_BENCH_RSS_KEYS", 1_000_000u64),
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

/// One decimal, rounded down, for the targets' lines: `pct` prints 89.6% as "90%" beside a "no",
/// and rounding to nearest would print 89.96% as "90.0%".
pub(crate) fn pct1(r: f64) -> String {
    format!("{:.1}%", (r * 1000.0).floor() / 10.0)
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

static TARGETS: Mutex<Vec<(String, String, bool)>> = Mutex::new(Vec::new());

/// Records a target's outcome for the summary.
pub(crate) fn target(name: impl Into<String>, measured: impl Into<String>, met: bool) {
    TARGETS
        .lock()
        .expect("targets")
        .push((name.into(), measured.into(), met));
}

pub(crate) fn print_targets() {
    println!("\n## Targets\n");
    println!("| target | measured | met |");
    println!("|---|---|---|");
    for (name, measured, met) in TARGETS.lock().expect("targets").iter() {
        println!(
            "| {name} | {measured} | {} |",
            if *met { "yes" } else { "**no**" }
        );
    }
}
