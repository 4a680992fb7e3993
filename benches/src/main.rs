//! Run with: cargo run --release -p idem-bench -- all
//!
//! What idempotency costs, per store, against the floor, in one run: see `BENCHMARKS.md` at the
//! repository root for the results and what each table measures. Sections can be run alone:
//! `all` (default), `memory`, `throughput`, `roundtrips`, `contention`, `scale`, `rss`, `cluster`
//! (the Redis Cluster store; `IDEM_BENCH_REDIS_CLUSTER_URL`, see `cluster.rs`).
//! `profile <plain|new|replay> <n>` sends `n` in-process requests (for callgrind);
//! `profile-http <plain|new|replay> [connections] [seconds]` runs one HTTP path on the memory store
//! (for `perf stat` / `perf record` over server and load generator, divided by the requests printed;
//! it prints the CPU per request of the load itself too); with `IDEM_BENCH_HELD=<n>` the store first
//! holds `n` completed records, as the throughput section's "records held" cells do.
//! `serve [port]` serves the bench's router (plain, the memory store, the memory floor by hand) and
//! `load <addr> <plain|new|replay|floor-new|floor-replay> [connections] [seconds] [server-pid]`
//! loads it from another process, printing the server's own CPU per request; `server-cpu [rounds]
//! [connections] [seconds]` compares the paths that way, a fresh server per path and round.
//! `profile-store <memory|sqlite|postgres|redis> <engine-new|floor-new|engine-replay|floor-replay|
//! statement-replay|floor-new-unfenced> [connections] [seconds]` runs one store-level path of the
//! throughput section alone and prints the CPU per operation of this process and of the store's
//! server processes (from `/proc`); `statement-replay` is PostgreSQL's and Redis', `floor-new-unfenced`
//! Redis' only.
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
mod cluster;
mod contention;
mod counting;
mod floors;
mod load;
mod memory;
mod report;
mod roundtrips;
mod rss;
mod scale;
mod server_cpu;
mod setup;
mod throughput;

#[global_allocator]
static ALLOCATOR: alloc::Counting = alloc::Counting;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let section = args.first().map_or("all", String::as_str);
    match section {
        "serve-payments" => serve_payments(),
        "serve" => serve(&args[1..]),
        "load" => load(&args[1..]),
        "server-cpu" => compare_server_cpu(&args[1..]),
        "profile" => profile(&args[1..]),
        "profile-http" => profile_http(&args[1..]),
        "profile-store" => profile_store(&args[1..]),
        _ => {
            multi_thread().block_on(run(section));
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
            "cluster",
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
    let needs_stores = all || ["throughput", "contention"].contains(&section);
    let handles = if needs_stores {
        setup::handles("http").await
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
        contention::transactional(&handles).await;
    }
    if all || section == "scale" {
        // Stores of its own, emptied: the sections before it leave records behind (the throughput
        // section hundreds of thousands), and its small point must hold what its table says.
        scale::run(&setup::handles("scale").await, &cfg).await;
    }
    if all || section == "rss" {
        rss::run(&cfg).await;
    }
    if all || section == "cluster" {
        cluster::run(&cfg).await;
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

/// The runtime every section but `profile` runs on: tokio's default multi-thread runtime (a worker
/// per core), with I/O and timers.
fn multi_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `profile-http <plain|new|replay> [connections] [seconds]`: one HTTP path on the memory store,
/// for `perf record` / `perf stat` over the whole process (server and load generator). Prints the
/// requests served, so that counts can be divided per request, and the CPU the load itself took per
/// request. With `IDEM_BENCH_HELD=<n>` the store first holds `n` completed records; filling it takes
/// CPU that `perf stat` counts too (the line printed says how much), so divide that out or use
/// `perf stat --delay`.
fn profile_http(args: &[String]) {
    alloc::stop_counting();
    let path = args.first().map_or("new", String::as_str).to_owned();
    let connections = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(16);
    let secs = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(5);
    multi_thread().block_on(async move {
        let store = std::sync::Arc::new(idem_runtime::store::memory::MemoryStore::new());
        let held: u64 = report::env("IDEM_BENCH_HELD", 0);
        let fill_cpu = process_cpu();
        throughput::hold(&store, held).await;
        let fill_cpu = process_cpu() - fill_cpu;
        let engine = idem_runtime::Engine::from_arc(store);
        let addr = setup::serve(setup::router(engine, Default::default())).await;
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
        let load_cpu = process_cpu();
        let s = load::http(addr, route, keys, connections, bounds).await;
        let load_cpu = process_cpu() - load_cpu;
        println!(
            "{path}: {} requests in {:?} on {connections} connections ({:.0} req/s, p50 {:?}), {} errors; \
             CPU per request {:.2} µs; store holding {held} records beforehand (filled in {fill_cpu:.2} s of CPU)",
            s.ok,
            s.elapsed,
            s.throughput(),
            s.p50(),
            s.errors,
            load_cpu * 1e6 / s.ok.max(1) as f64,
        );
        // Exit without dropping the server: freeing hundreds of thousands of stored records takes a
        // noticeable share of the run's CPU, which `perf stat` would otherwise charge to the requests.
        std::process::exit(0);
    });
}

/// `profile-store <store> <path> [connections] [seconds]`: one store-level path of the throughput
/// section (idem's engine or the direct floor, new keys or replays; on PostgreSQL and Redis also a
/// replay through idem's claim statement or command issued directly, `statement-replay`; on Redis
/// only, the floor's new request with an unconditional completion, `floor-new-unfenced`) on one
/// store, alone. Prints the operations done and the CPU each cost in this process and, on Redis and
/// PostgreSQL, in the server's processes (user + system time from `/proc`): where the time of a path
/// goes, which the throughput ratio alone does not tell on a machine whose two cores the store
/// shares. A path a store does not have counts every operation as an error.
fn profile_store(args: &[String]) {
    alloc::stop_counting();
    let store = args.first().map_or("redis", String::as_str).to_owned();
    let path = args.get(1).map_or("engine-new", String::as_str).to_owned();
    let connections = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(16);
    let secs = args.get(3).and_then(|n| n.parse().ok()).unwrap_or(5);
    multi_thread().block_on(async move {
        let handle = match store.as_str() {
            "memory" => Ok(setup::Handle::Memory(std::sync::Arc::new(
                idem_runtime::store::memory::MemoryStore::new(),
            ))),
            "sqlite" => Ok(setup::Handle::Sqlite(setup::sqlite("profile").await)),
            "postgres" => setup::postgres(None).await.map(setup::Handle::Postgres),
            "redis" => setup::redis(None)
                .await
                .map(|(s, c)| setup::Handle::Redis(s, c)),
            other => Err(format!("`{other}` is not a store")),
        };
        let handle = handle.unwrap_or_else(|e| {
            eprintln!("profile-store: {e}");
            std::process::exit(2);
        });
        let engine = idem_runtime::Engine::from_arc(handle.store());
        let floor = floors::Floor::for_handle(&handle);
        throughput::seed_replays(&engine, &floor).await;
        let bounds = load::Bounds {
            time: std::time::Duration::from_secs(secs),
            requests: u64::MAX,
        };
        let server = match &handle {
            setup::Handle::Redis(..) => "redis-server",
            setup::Handle::Postgres(_) => "postgres",
            _ => "",
        };
        let server_before = server_cpu(server);
        let cpu_before = process_cpu();
        let which = match path.as_str() {
            "engine-new" => throughput::Path::EngineNew,
            "engine-replay" => throughput::Path::EngineReplay,
            "floor-new" => throughput::Path::FloorNew,
            "floor-new-unfenced" => throughput::Path::FloorNewUnfenced,
            "floor-replay" => throughput::Path::FloorReplay,
            "statement-replay" => throughput::Path::StatementReplay,
            other => {
                eprintln!("profile-store: unknown path `{other}`");
                std::process::exit(2);
            }
        };
        let mut load = throughput::store_load(which, &engine, &floor, 0, connections)
            .expect("every path named above is a store-level one");
        load.run_slice(bounds).await;
        let s = load.into_sample();
        let cpu = process_cpu() - cpu_before;
        let server_cpu = server_cpu(server) - server_before;
        let ops = s.ok.max(1) as f64;
        println!(
            "{store} {path}: {} operations in {:?} on {connections} connections ({:.0}/s), {} errors; \
             CPU per operation: this process {:.2} µs{}",
            s.ok,
            s.elapsed,
            s.throughput(),
            s.errors,
            cpu * 1e6 / ops,
            if server_cpu > 0.0 {
                format!(", {server} processes {:.2} µs", server_cpu * 1e6 / ops)
            } else {
                String::new()
            }
        );
        std::process::exit(0);
    });
}

/// This process's CPU time so far (user + system), in seconds.
fn process_cpu() -> f64 {
    pid_cpu(std::process::id()).unwrap_or(0.0)
}

/// The CPU time so far (user + system, in seconds) of every process named `name` (`redis-server`,
/// `postgres`: the server and all its backends), from `/proc`. Backends that exit during the run
/// take their time with them, so this is a lower bound; the pools here keep their connections.
fn server_cpu(name: &str) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter_map(|stat| stat_cpu(&stat))
        .filter(|(comm, _)| comm == name)
        .map(|(_, cpu)| cpu)
        .sum()
}

/// The command name and the user + system CPU seconds of one `/proc/<pid>/stat` line.
fn stat_cpu(stat: &str) -> Option<(String, f64)> {
    // The command name is in parentheses and may hold spaces; utime and stime are the 12th and
    // 13th fields after it, in clock ticks (100 per second on Linux).
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_owned();
    let mut fields = rest.split_whitespace().skip(11);
    let utime: f64 = fields.next()?.parse().ok()?;
    let stime: f64 = fields.next()?.parse().ok()?;
    Some((comm, (utime + stime) / 100.0))
}

/// `serve [port]`: the bench's router (`/plain`; `/idem` on a memory store; `/floor`, the memory
/// floor by hand) on 127.0.0.1:`port` (any free port by default), for a load from another process
/// (`load` below, or wrk), so that the server's CPU per request is read apart from the load
/// generator's. With `IDEM_BENCH_HELD=<n>` the store and the floor first hold `n` completed records.
/// Prints `serving <addr> pid <pid>` once it listens, then serves until it is killed.
fn serve(args: &[String]) {
    alloc::stop_counting();
    let port: u16 = args.first().and_then(|n| n.parse().ok()).unwrap_or(0);
    multi_thread().block_on(async move {
        let store = std::sync::Arc::new(idem_runtime::store::memory::MemoryStore::new());
        let floor = std::sync::Arc::new(floors::MemoryMap::default());
        let held: u64 = report::env("IDEM_BENCH_HELD", 0);
        throughput::hold(&store, held).await;
        floors::memory_hold(&floor, held);
        let router = setup::router(idem_runtime::Engine::from_arc(store), floor);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| {
                eprintln!("serve: cannot listen on 127.0.0.1:{port}: {e}");
                std::process::exit(2);
            });
        let addr = listener.local_addr().expect("a bound listener's address");
        println!("serving {addr} pid {}", std::process::id());
        let _ = axum::serve(listener, router).await;
    });
}

/// `load <addr> <plain|new|replay|floor-new|floor-replay> [connections] [seconds] [server-pid]`:
/// one HTTP path, from this process, against a `serve` process at `addr` (the replay paths first
/// complete the keys they send). Prints the requests served, their rate and latency, and, given the
/// server's pid, the server's CPU per request (user + system time from `/proc`, over the load).
fn load(args: &[String]) {
    alloc::stop_counting();
    let Some(addr) = args
        .first()
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
    else {
        eprintln!("load: the first argument is the server's address, as `serve` prints it");
        std::process::exit(2);
    };
    let path = args.get(1).map_or("new", String::as_str).to_owned();
    let connections = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(16);
    let secs = args.get(3).and_then(|n| n.parse().ok()).unwrap_or(3);
    let server: Option<u32> = args.get(4).and_then(|n| n.parse().ok());
    multi_thread().block_on(async move {
        let Some((route, keys)) = server_cpu::route_and_keys(&path, addr).await else {
            eprintln!("load: unknown path `{path}`");
            std::process::exit(2);
        };
        let server_now = || server.map(|pid| pid_cpu(pid).unwrap_or(0.0));
        let before = server_now();
        let bounds = load::Bounds {
            time: std::time::Duration::from_secs(secs),
            requests: u64::MAX,
        };
        let s = load::http(addr, route, keys, connections, bounds).await;
        let per_request = |cpu: f64| format!("; server CPU per request {:.2} µs", cpu * 1e6 / s.ok.max(1) as f64);
        println!(
            "{path}: {} requests in {:?} on {connections} connections ({:.0} req/s, p50 {:?}, p99 {:?}), {} errors{}",
            s.ok,
            s.elapsed,
            s.throughput(),
            s.p50(),
            s.p99(),
            s.errors,
            before.zip(server_now()).map_or(String::new(), |(b, a)| per_request(a - b)),
        );
    });
}

/// `server-cpu [rounds] [connections] [seconds]`: see `server_cpu`.
fn compare_server_cpu(args: &[String]) {
    alloc::stop_counting();
    let rounds = args.first().and_then(|n| n.parse().ok()).unwrap_or(10);
    let connections = args.get(1).and_then(|n| n.parse().ok()).unwrap_or(16);
    let secs = args.get(2).and_then(|n| n.parse().ok()).unwrap_or(1);
    multi_thread().block_on(server_cpu::run(rounds, connections, secs));
}

/// The CPU time so far (user + system, in seconds) of process `pid`, from `/proc`.
pub(crate) fn pid_cpu(pid: u32) -> Option<f64> {
    stat_cpu(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?).map(|(_, cpu)| cpu)
}

/// The payments example, in a child process of the bench (for its RSS).
fn serve_payments() {
    alloc::stop_counting();
    let result = multi_thread().block_on(async {
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
