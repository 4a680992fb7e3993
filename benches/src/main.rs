//! Writes `BENCHMARKS.md` in one run: `cargo run --release --manifest-path benches/Cargo.toml -- all > BENCHMARKS.md`.
//!
//! Sections run alone too: `http`, `store`, `function`, `roundtrips`, `cluster`; `scale` (records already
//! stored, purging under load; see `scale.rs`) runs only alone. Settings: `IDEM_BENCH_SECS`
//! (seconds per throughput cell, 1), `IDEM_BENCH_ROUNDS` (interleaved rounds, 5),
//! `IDEM_BENCH_STORES` (comma-separated `memory`, `sqlite`, `postgres`, `mysql`, `redis`, and for
//! `scale` `redis-cluster`; default all), `IDEM_BENCH_POSTGRES_URL` (`postgres://postgres@127.0.0.1:5432`; database `idem_bench` is
//! created), `IDEM_BENCH_MYSQL_URL` (`mysql://root@127.0.0.1:3306/idem_bench`, created if missing,
//! emptied), `IDEM_BENCH_REDIS_URL` (`redis://127.0.0.1:6379/7`, flushed) and
//! `IDEM_BENCH_REDIS_CLUSTER_URL` (see `cluster.rs`). Progress goes to stderr, the report to stdout.
//!
//! `before-after BEFORE AFTER LABEL` (two `host:port`) is the load side of
//! `benches/before-after/run`, which builds and starts the two servers it compares;
//! `before-after-requests ADDR (new|replay) N` sends it N requests in a row.

mod before_after;
mod cluster;
mod counting;
mod floors;
mod function;
mod http;
mod load;
mod report;
mod roundtrips;
mod scale;
mod store_level;
mod stores;

const SECTIONS: [&str; 10] = [
    "all",
    "scale",
    "http",
    "store",
    "function",
    "roundtrips",
    "cluster",
    "before-after",
    "before-after-header",
    "before-after-requests",
];

fn main() {
    let section = std::env::args().nth(1).unwrap_or_else(|| "all".into());
    if !SECTIONS.contains(&section.as_str()) {
        eprintln!(
            "unknown section `{section}`; one of: {}",
            SECTIONS.join(", ")
        );
        std::process::exit(2);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("tokio runtime: {e}");
            std::process::exit(1);
        });
    runtime.block_on(run(&section));
}

async fn run(section: &str) {
    let started = std::time::Instant::now();
    let cfg = report::Config::from_env();
    if section.starts_with("before-after") {
        let args: Vec<String> = std::env::args().skip(2).collect();
        let addrs: Vec<std::net::SocketAddr> = args.iter().filter_map(|a| a.parse().ok()).collect();
        match (section, &addrs[..], args.get(2)) {
            ("before-after-header", _, _) => before_after::header(&cfg),
            ("before-after-requests", [addr], Some(count)) => {
                let replay = args.get(1).is_some_and(|kind| kind == "replay");
                let count = count.parse().unwrap_or(0);
                if let Err(e) = before_after::requests(*addr, replay, count).await {
                    eprintln!("before-after-requests {addr}: {e}");
                    std::process::exit(1);
                }
            }
            (_, [before, after], Some(label)) => {
                before_after::run(*before, *after, label, &cfg).await
            }
            _ => {
                eprintln!(
                    "usage: idem-bench before-after BEFORE_ADDR AFTER_ADDR LABEL, \
                     or idem-bench before-after-requests ADDR (new|replay) COUNT"
                );
                std::process::exit(2);
            }
        }
        return;
    }
    if section == "scale" {
        scale::run(&cfg, &services().await).await;
        let _ = std::fs::remove_dir_all(stores::scratch());
        return;
    }
    let all = section == "all";
    let stores = if all || ["http", "store", "function"].contains(&section) {
        stores::handles("bench").await
    } else {
        Vec::new()
    };
    println!("{}", report::intro(&cfg, &services().await));
    if all || section == "http" {
        http::run(&stores, &cfg).await;
    }
    if all || section == "store" {
        store_level::run(&stores, &cfg).await;
    }
    if all || section == "function" {
        function::run(&stores, &cfg).await;
    }
    if all || section == "roundtrips" {
        roundtrips::run().await;
    }
    if all || section == "cluster" {
        cluster::run(&cfg).await;
    }
    println!(
        "---\n\nThis run took {:.0} minutes.",
        started.elapsed().as_secs_f64() / 60.0
    );
    let _ = std::fs::remove_dir_all(stores::scratch());
}

/// The services' versions, as the report states them.
async fn services() -> String {
    let postgres = match sqlx::PgPool::connect(&format!(
        "{}/postgres?sslmode=disable",
        stores::postgres_base()
    ))
    .await
    {
        Ok(pool) => sqlx::query_scalar::<_, String>("SHOW server_version")
            .fetch_one(&pool)
            .await
            .map_or_else(
                |_| "PostgreSQL".into(),
                |v| format!("PostgreSQL {}", v.split_whitespace().next().unwrap_or("")),
            ),
        Err(_) => "no PostgreSQL".into(),
    };
    let redis = match redis::Client::open(stores::redis_url()) {
        Ok(client) => match client.get_multiplexed_async_connection().await {
            Ok(mut conn) => redis::cmd("INFO")
                .arg("server")
                .query_async::<String>(&mut conn)
                .await
                .ok()
                .and_then(|info| {
                    info.lines()
                        .find_map(|l| l.strip_prefix("redis_version:"))
                        .map(|v| format!("Redis {}", v.trim()))
                })
                .unwrap_or_else(|| "Redis".into()),
            Err(_) => "no Redis".into(),
        },
        Err(_) => "no Redis".into(),
    };
    let mysql = match stores::mysql_url().rsplit_once('/') {
        Some((server, _)) => match sqlx::MySqlPool::connect(server).await {
            Ok(pool) => sqlx::query_scalar::<_, String>("SELECT VERSION()")
                .fetch_one(&pool)
                .await
                .map_or_else(|_| "MySQL".into(), |v| mysql_version(&v)),
            Err(_) => "no MySQL".into(),
        },
        None => "no MySQL".into(),
    };
    format!(
        "{postgres} (durable commits), {mysql} (the MySQL store's server; InnoDB, durable \
         commits), {redis}, SQLite in WAL mode with `synchronous=NORMAL`"
    )
}

/// `10.11.19-MariaDB-0+deb12u1` as `MariaDB 10.11.19`, `8.4.3` as `MySQL 8.4.3`.
fn mysql_version(version: &str) -> String {
    let number = version.split('-').next().unwrap_or(version);
    if version.contains("MariaDB") {
        format!("MariaDB {number}")
    } else {
        format!("MySQL {number}")
    }
}

#[cfg(test)]
mod tests {
    /// The machine line names the server the MySQL store ran on, without the distribution's suffix.
    #[test]
    fn mysql_versions_name_their_server() {
        assert_eq!(
            super::mysql_version("10.11.19-MariaDB-0+deb12u1"),
            "MariaDB 10.11.19"
        );
        assert_eq!(super::mysql_version("8.4.3"), "MySQL 8.4.3");
    }
}
