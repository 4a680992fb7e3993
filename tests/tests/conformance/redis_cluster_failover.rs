//! A Redis Cluster primary killed (SIGKILL) under load, and its replica promoted, with the Redis
//! Cluster store's `wait_for_replicas` on and off. Two instances (two stores, two engines) take
//! every key at once, as a client's retry landing on the other instance would; each request
//! retries until it gets an answer. Counted per key: executions of the handler, and completed
//! responses lost (a completion was acknowledged, yet the key ran again or its record is not the
//! completed one at the end). With the option on both must be 0; with it off the counts are
//! printed: replication is asynchronous, so whatever the primary had not yet sent its replica when
//! it died is lost, and how much that is depends on the moment of the kill.
//!
//! The test runs a cluster of its own ([`LocalCluster`], on free ports), since it kills its nodes,
//! and stops it at the end. After each promotion it restarts the killed node,
//! which rejoins as the new primary's replica (until then, with the option on, that primary can
//! confirm nothing).

use idem_runtime::store::redis::RedisClusterStore;
use idem_runtime::{Begin, Engine, Policy, RecordKey, RecordState, Rejection, StoredResponse};
use idem_tests::local_cluster::LocalCluster;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Concurrent clients; each sends every one of its keys to both instances at once.
const CLIENTS: usize = 12;
/// Keys answered before the kill, and after the promoted primary has a replica again.
const KEYS_BEFORE: usize = 150;
const KEYS_AFTER: usize = 150;
/// Bounds on waiting for the cluster and for the load: reaching one fails the test; none decides
/// a pass.
const PATIENCE: Duration = Duration::from_secs(60);

/// The test's own cluster (it kills its nodes, so it shares it with no other test), stopped when
/// dropped, also when the test fails.
#[derive(Clone)]
struct OwnCluster(Arc<LocalCluster>);

impl OwnCluster {
    fn start() -> Self {
        match LocalCluster::start() {
            Ok(cluster) => Self(Arc::new(cluster)),
            Err(e) => panic!("could not start the test's cluster: {e}"),
        }
    }

    fn seeds(&self) -> Vec<String> {
        self.0.seeds()
    }

    /// `CLUSTER NODES` as seen from `port`: (id, port, flags, primary id) per node.
    fn nodes(port: u16) -> Option<Vec<(String, u16, String, String)>> {
        let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .ok()?
            .get_connection_with_timeout(Duration::from_millis(500))
            .ok()?;
        let nodes: String = redis::cmd("CLUSTER").arg("NODES").query(&mut conn).ok()?;
        nodes
            .lines()
            .map(|line| {
                let f: Vec<&str> = line.split(' ').collect();
                let port = f.get(1)?.split(['@', ',']).next()?.rsplit_once(':')?.1;
                Some((
                    f[0].to_owned(),
                    port.parse().ok()?,
                    f.get(2)?.to_string(),
                    f.get(3)?.to_string(),
                ))
            })
            .collect()
    }

    /// Kills the primary with the lowest port (SIGKILL), and returns its port and its replica's.
    fn kill_a_primary(&self) -> (u16, u16) {
        let last = self.0.ports().last().expect("six nodes");
        let nodes = Self::nodes(last).expect("cluster nodes");
        let (id, port, ..) = nodes
            .iter()
            .filter(|(_, _, flags, _)| flags.contains("master") && !flags.contains("fail"))
            .min_by_key(|(_, port, ..)| *port)
            .expect("a primary")
            .clone();
        let replica = nodes
            .iter()
            .find(|(.., primary)| *primary == id)
            .expect("the primary has a replica")
            .1;
        if let Err(e) = self.0.kill(port) {
            panic!("{e}");
        }
        (port, replica)
    }

    /// Polls until `replica` is a primary and the cluster serves every slot again.
    fn await_promotion(replica: u16) {
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            let promoted = Self::nodes(replica).is_some_and(|nodes| {
                nodes
                    .iter()
                    .any(|(_, port, flags, _)| *port == replica && flags.contains("master"))
            });
            if promoted && Self::info(replica, "cluster", "cluster_state") == "ok" {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("127.0.0.1:{replica} was not promoted within {PATIENCE:?}");
    }

    /// Restarts the killed node and polls until the new primary has it as an online replica.
    fn revive(&self, killed: u16, primary: u16) {
        if let Err(e) = self.0.revive(killed) {
            panic!("{e}");
        }
        let deadline = Instant::now() + PATIENCE;
        while Instant::now() < deadline {
            if Self::info(primary, "replication", "slave0").contains("state=online") {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("127.0.0.1:{killed} did not rejoin as a replica within {PATIENCE:?}");
    }

    /// The value of `field` in `INFO <section>` (or of `CLUSTER INFO` for "cluster") at `port`.
    fn info(port: u16, section: &str, field: &str) -> String {
        let Ok(mut conn) = redis::Client::open(format!("redis://127.0.0.1:{port}"))
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(500)))
        else {
            return String::new();
        };
        let text: String = match section {
            "cluster" => redis::cmd("CLUSTER").arg("INFO").query(&mut conn),
            _ => redis::cmd("INFO").arg(section).query(&mut conn),
        }
        .unwrap_or_default();
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{field}:")))
            .unwrap_or_default()
            .trim()
            .to_owned()
    }
}

fn policy() -> Policy {
    // The lease outlasts a failover (a few node timeouts) plus a renewal interval, so that a
    // handler whose claim could not be renewed meanwhile is not taken over while it runs.
    Policy::new()
        .lease(Duration::from_secs(10))
        .wait(Duration::from_secs(10))
        .handler("failover")
}

fn response(key: usize) -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![],
        body: format!("payment {key}").into(),
    }
}

/// What happened to each key.
#[derive(Default)]
struct Ledger {
    executions: HashMap<usize, usize>,
    acknowledged: HashMap<usize, bool>,
    lost: HashMap<usize, bool>,
}

/// One request for key `k` on `engine`, retried until it has an answer.
async fn request(engine: &Engine, scope: &str, k: usize, ledger: &Mutex<Ledger>) {
    let key = RecordKey::new(scope, format!("key-{k}"));
    let fingerprint = idem_tests::conformance::fp(&k.to_string());
    let deadline = Instant::now() + PATIENCE;
    loop {
        assert!(
            Instant::now() < deadline,
            "key {k} got no answer in {PATIENCE:?}"
        );
        match engine.begin(key.clone(), fingerprint, &policy()).await {
            Ok(Begin::Execute(guard)) => {
                {
                    let mut ledger = ledger.lock().expect("ledger");
                    *ledger.executions.entry(k).or_default() += 1;
                    if ledger.acknowledged.get(&k) == Some(&true) {
                        ledger.lost.insert(k, true);
                    }
                }
                // The handler's work (its effect happens here).
                guard
                    .keep_alive(tokio::time::sleep(Duration::from_millis(5)))
                    .await;
                if guard.complete(&response(k)).await.is_ok() {
                    ledger.lock().expect("ledger").acknowledged.insert(k, true);
                }
                return;
            }
            Ok(Begin::Replay(replay)) => {
                assert_eq!(
                    replay.response,
                    response(k),
                    "key {k} replayed another response"
                );
                return;
            }
            Err(Rejection::InFlight { .. } | Rejection::Unavailable { .. }) => {
                // A client's retry backoff.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(other) => panic!("key {k}: {other:?}"),
        }
    }
}

/// Runs the load on two instances, kills a primary after `KEYS_BEFORE` keys, waits for the
/// promotion, revives the killed node, lets `KEYS_AFTER` more keys through, and counts.
async fn run(cluster: &OwnCluster, durable: bool) -> (usize, usize, usize) {
    let scope = format!("failover-{}", uuid::Uuid::new_v4());
    let store = || async {
        let builder = RedisClusterStore::builder(cluster.seeds()).prefix("failover");
        let builder = match durable {
            true => builder.wait_for_replicas(1, Duration::from_millis(500)),
            false => builder,
        };
        Engine::new(
            builder
                .connect()
                .await
                .expect("connect to the test's cluster"),
        )
    };
    let (a, b) = (Arc::new(store().await), Arc::new(store().await));
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let (next, answered, stop) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicBool::new(false)),
    );
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (a, b, ledger, scope) = (a.clone(), b.clone(), ledger.clone(), scope.clone());
            let (next, answered, stop) = (next.clone(), answered.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    tokio::join!(
                        request(&a, &scope, k, &ledger),
                        request(&b, &scope, k, &ledger)
                    );
                    answered.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let until = |count: usize| {
        let answered = answered.clone();
        async move {
            let deadline = Instant::now() + PATIENCE;
            while answered.load(Ordering::Relaxed) < count {
                assert!(Instant::now() < deadline, "the load stalled");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };

    until(KEYS_BEFORE).await;
    let (killed, replica) = cluster.kill_a_primary();
    tokio::task::spawn_blocking(move || OwnCluster::await_promotion(replica))
        .await
        .expect("join");
    let reviver = cluster.clone();
    tokio::task::spawn_blocking(move || reviver.revive(killed, replica))
        .await
        .expect("join");
    let now = answered.load(Ordering::Relaxed);
    until(now + KEYS_AFTER).await;
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.await.expect("a client failed");
    }

    // A key whose completion was acknowledged must still hold that completion.
    let keys = next.load(Ordering::Relaxed);
    let mut ledger = Arc::into_inner(ledger)
        .expect("clients done")
        .into_inner()
        .expect("ledger");
    for k in 0..keys {
        if ledger.acknowledged.get(&k) != Some(&true) {
            continue;
        }
        let key = RecordKey::new(scope.as_str(), format!("key-{k}"));
        let record = a
            .store()
            .get(&key)
            .await
            .expect("get")
            .map(|found| found.record.state);
        if record
            != Some(RecordState::Completed {
                response: response(k),
            })
        {
            ledger.lost.insert(k, true);
        }
    }
    let twice = ledger.executions.values().filter(|&&n| n > 1).count();
    let lost = ledger.lost.len();
    assert_eq!(ledger.executions.len(), keys, "every key ran at least once");
    (keys, twice, lost)
}

#[cfg_attr(
    skip_redis_cluster,
    ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_under_load_loses_nothing_when_claims_wait_for_a_replica() {
    let cluster = tokio::task::spawn_blocking(OwnCluster::start)
        .await
        .expect("join");
    let (keys, twice, lost) = run(&cluster, false).await;
    println!(
        "wait_for_replicas off: {keys} keys, a primary killed: {twice} executed twice, \
         {lost} completed responses lost"
    );
    let (keys, twice, lost) = run(&cluster, true).await;
    println!(
        "wait_for_replicas(1) on: {keys} keys, a primary killed: {twice} executed twice, \
         {lost} completed responses lost"
    );
    assert_eq!(twice, 0, "with wait_for_replicas no key runs twice");
    assert_eq!(
        lost, 0,
        "with wait_for_replicas no completed response is lost"
    );
}
