//! `IDEM_TEST_SKIP`: the services (`postgres`, `mysql`, `redis`, `redis-cluster`, `amqp`, comma-separated) a developer
//! chose to run the tests without. Each one named sets a cfg (`skip_postgres`, `skip_mysql`, `skip_redis`,
//! `skip_redis_cluster`, `skip_amqp`) under which the tests that need that service carry `#[ignore = "…"]`, so
//! that `cargo test` lists them as ignored, with the reason, and counts them in its summary. A test cannot mark itself ignored once running,
//! hence a build-time choice. Under CI (`CI=true`) nothing is skipped. The payments example's
//! build script runs this too, for its own tests.

const SERVICES: [&str; 5] = ["postgres", "mysql", "redis", "redis-cluster", "amqp"];

pub(crate) fn main() {
    println!("cargo::rerun-if-env-changed=IDEM_TEST_SKIP");
    println!("cargo::rerun-if-env-changed=CI");
    println!(
        "cargo::rustc-check-cfg=cfg(skip_postgres, skip_mysql, skip_redis, skip_redis_cluster, skip_amqp)"
    );
    let Ok(skip) = std::env::var("IDEM_TEST_SKIP") else {
        return;
    };
    let named: Vec<&str> = skip
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(unknown) = named.iter().find(|name| !SERVICES.contains(name)) {
        eprintln!(
            "IDEM_TEST_SKIP names `{unknown}`; the services it can name are postgres, mysql, redis, redis-cluster and amqp"
        );
        std::process::exit(1);
    }
    if matches!(std::env::var("CI").as_deref(), Ok("true" | "1")) {
        println!("cargo::warning=IDEM_TEST_SKIP={skip} is ignored: under CI=true every test runs");
        return;
    }
    for name in named {
        println!("cargo::rustc-cfg=skip_{}", name.replace('-', "_"));
    }
}
