//! Run with: cargo run --release -p idem-bench -- all
//!
//! What idempotency costs, per store, against the floor, in one run: see `BENCHMARKS.md` at the
//! repository root for the results and what each table measures. Sections can be run alone:
//! `all` (default), `memory`, `throughput`, `roundtrips`, `contention`, `scale`, `rss`.
//! `profile <plain|new|replay> <n>` sends `n` in-process requests (for callgrind);
//! `profile-http <plain|new|replay> [connections] [seconds]` runs one HTTP path on the memory store
//! (for `perf stat` / `perf record` over server and load generator, divided by the requests printed).
//!
//! Settings: `IDEM_BENCH_SECS` (seconds per throughput cell, 1), `IDEM_BENCH_ROUNDS` (3),
//! `IDEM_BENCH_SCALE` (records for the large scale point, 1000000), `IDEM_BENCH_RSS_KEYS` (1000000)
//! and `IDEM_BENCH_RSS_SECS` (time cap of the RSS run, 240), `IDEM_BENCH_RSS_STORE` (where the
//! payments example keeps its records in the RSS run: `shared`, the default, or `sqlite`, `memory`);
//! `IDEM_BENCH_POSTGRES_URL` (`postgres://postgres@127.0.0.1:5432`, database `idem_bench` is
//! created) and `IDEM_BENCH_REDIS_URL` (`redis://127.0.0.1:6379/7`, flushed). `IDEM_BENCH_STORES`
//! limits the throughput, contention and scale sections to some stores (comma-separated: `memory`,
//! `sqlite`, `postgres`, `redis`; default all): `IDEM_BENCH_STORES=redis … -- throughput` measures
//! the plain handler and Redis alone, in a quarter of the time. `IDEM_BENCH_HTTP_ONLY=1` skips the
//! store-level cells of the throughput section (HTTP only).

mod alloc;
mod contention;
mod counting;
mod floors;
mod load;
mod memory;
mod report;
mod roundtrips;
mod rss;
mod scale;
mod setup;
mod throughput;

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let section = args.first().map_or("all", String::as_str);
    match section {
        "serve-payments" => serve_payments(),
        "profile" => profile(&args[1..]),
        "profile-http" => profile_http(&args[1..]),
        _ => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            runtime.block_on(run(section));
        }
    }
}

async fn run(section: &str) {
    let cfg = report::Config::from_env();
    let all = section == "all";
    if !all
        && ![
            "memory",
            "throughput",
            "roundtrips",
            "contention",
            "scale",
            "rss",
        ]
        .contains(&section)
    {
        eprintln!("unknown section `{section}`");
        std::process::exit(2);
    }
    println!("# idem benchmarks\n");
    println!("{}", machine());
    println!("Settings: {cfg:?}.");
    if all || section == "memory" {
        // First, while the heap holds nothing else.
        memory::bytes_per_record().await;
        memory::request_path().await;
    }
    // Counting allocations costs a contended atomic per allocation under load: measured sections
    // run without it (see `alloc`).
    alloc::stop_counting();
    let needs_stores = all || ["throughput", "contention", "scale"].contains(&section);
    let handles = if needs_stores {
        setup::handles().await
    } else {
        Vec::new()
    };
    if all || section == "throughput" {
        throughput::run(&handles, &cfg).await;
    }
    if all || section == "roundtrips" {
        roundtrips::run().await;
        roundtrips::transactional().await;
    }
    if all || section == "contention" {
        contention::run(&handles).await;
    }
    if all || section == "scale" {
        scale::run(&handles, &cfg).await;
    }
    if all || section == "rss" {
        rss::run(&cfg).await;
    }
    report::print_targets();
    let _ = std::fs::remove_dir_all(setup::scratch());
}

/// The machine, as the report states it.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
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
    format!(
        "Machine: {cores} CPUs (nproc), {mem} memory, {cpu}. Load average at start: {}.\n",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    )
}

/// `profile-http <plain|new|replay> [connections] [seconds]`: one HTTP path on the memory store,
/// for `perf record` / `perf stat` over the whole process (server and load generator). Prints the
/// requests served, so that counts can be divided per request.
fn profile_http(args: &[String]) {
    alloc::stop_counting();
    let path = args.first().map_or("new", String::as_str).to_owned();
    let connections = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(16);
    let secs = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(5);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        let engine = idem_runtime::Engine::new(idem_runtime::store::memory::MemoryStore::new());
        let addr = setup::serve(setup::router(engine)).await;
        let (route, keys) = match path.as_str() {
            "plain" => ("/plain", load::Keys::Fresh("plain".into())),
            "replay" => {
                let mut sender = load::connect(addr).await.expect("connect");
                let keys: Vec<String> = (0..1000).map(|i| format!("replay-{i}")).collect();
                for key in &keys {
                    let status = load::send(&mut sender, load::post("/idem", key)).await;
                    assert!(status.is_some_and(|s| s.is_success()), "seeding");
                }
                ("/idem", load::Keys::Replay(std::sync::Arc::new(keys)))
            }
            _ => ("/idem", load::Keys::Fresh("new".into())),
        };
        let bounds = load::Bounds {
            time: std::time::Duration::from_secs(secs),
            requests: u64::MAX,
        };
        let s = load::http(addr, route, keys, connections, bounds).await;
        println!(
            "{path}: {} requests in {:?} on {connections} connections ({:.0} req/s, p50 {:?}), {} errors",
            s.ok,
            s.elapsed,
            s.throughput(),
            s.p50(),
            s.errors
        );
        // Exit without dropping the server: freeing hundreds of thousands of stored records takes a
        // noticeable share of the run's CPU, which `perf stat` would otherwise charge to the requests.
        std::process::exit(0);
    });
}

/// The payments example, in a child process of the bench (for its RSS).
fn serve_payments() {
    alloc::stop_counting();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let result = runtime.block_on(async {
        let config = payments::Config::from_env()?;
        payments::serve(config).await
    });
    if let Err(e) = result {
        eprintln!("payments: {e}");
        std::process::exit(1);
    }
}

/// `profile <plain|new|replay> <n>`: in-process requests on one thread, for callgrind.
fn profile(args: &[String]) {
    let kind = match args.first().map(String::as_str) {
        Some("plain") => memory::Kind::Plain,
        Some("replay") => memory::Kind::Replay,
        _ => memory::Kind::New,
    };
    let n = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(20_000);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let (allocs, per) = runtime.block_on(memory::in_process(kind, n));
    println!("{kind:?}: {n} requests, {allocs:.1} allocations and {per:?} per request");
}
