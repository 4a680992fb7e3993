//! The store conformance suite on the Redis Cluster store, and what only a cluster has to show:
//! records spread over every primary and purged on each, completions crossing instances subscribed
//! on different nodes, scripts a node lacks, and claims refused when the replicas asked for cannot
//! confirm them.
//!
//! Every backend instance (one per case) uses a fresh key prefix on the cluster at
//! `IDEM_TEST_REDIS_CLUSTER_URL`, or on the test binary's own (started by the first case that needs it:
//! `idem_tests::local_cluster`), and deletes its keys when
//! dropped, also when the case fails.

use idem_runtime::clock::Clock;
use idem_runtime::store::redis::RedisClusterStore;
use idem_tests::conformance::Backend;
use idem_tests::services;
use std::sync::Arc;

struct Cluster {
    seeds: Vec<String>,
    prefix: String,
    keys: services::RedisClusterPrefix,
}

impl Cluster {
    async fn store(&self) -> RedisClusterStore {
        self.store_with(self.seeds.clone()).await
    }

    async fn store_with(&self, seeds: Vec<String>) -> RedisClusterStore {
        RedisClusterStore::builder(seeds)
            .prefix(&self.prefix)
            .connect()
            .await
            .expect("connect to the cluster")
    }

    async fn store_on(&self, clock: Arc<dyn Clock>) -> RedisClusterStore {
        RedisClusterStore::builder(self.seeds.clone())
            .prefix(&self.prefix)
            .clock(clock)
            .connect()
            .await
            .expect("connect to the cluster")
    }
}

#[async_trait::async_trait]
impl Backend for Cluster {
    type Store = RedisClusterStore;
    async fn open(&self, clock: Arc<dyn Clock>) -> RedisClusterStore {
        self.store_on(clock).await
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<RedisClusterStore> {
        // Nothing listens on port 1; a lazy store answers "unavailable" instead of failing to build.
        Some(
            RedisClusterStore::builder(["redis://127.0.0.1:1"])
                .prefix(&self.prefix)
                .connect_lazy()
                .expect("valid url"),
        )
    }
}

async fn cluster() -> Cluster {
    let keys = services::RedisClusterPrefix::create().await;
    Cluster {
        seeds: keys.seeds(),
        prefix: keys.prefix().to_owned(),
        keys,
    }
}

idem_tests::conformance_suite!(
    cluster,
    #[cfg_attr(skip_redis_cluster, ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP")]
);

mod cluster_only {
    use super::cluster;
    use idem_runtime::store::redis::RedisClusterStore;
    use idem_runtime::store::{Claim, ClaimOutcome, Claimed, Found, Purge};
    use idem_runtime::sweeper::Sweeper;
    use idem_runtime::{Begin, Engine, FencingToken, RecordKey, Rejection, Store, StoreErrorKind};
    use idem_tests::conformance::{fp, fresh_key, policy, response, T0};
    use std::sync::Arc;
    use std::time::Duration;

    fn fresh_claim(key: &RecordKey) -> Claim<'_> {
        Claim {
            key,
            fingerprint: fp("a"),
            token: FencingToken::generate(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
            retain: Duration::from_secs(4 * 3600),
        }
    }

    /// Records land on every primary (each in one slot: a claim, completion or release touching two
    /// slots would fail with CROSSSLOT), and a purge pass walks every primary: calls continue one
    /// pass across primaries and skip nothing.
    #[cfg_attr(
        skip_redis_cluster,
        ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
    )]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn records_spread_over_every_primary_and_the_purge_walks_each() {
        let backend = cluster().await;
        let clock = idem_runtime::clock::ManualClock::new(T0);
        let store = Arc::new(backend.store_on(Arc::new(clock.clone())).await);
        let scope = format!("sweep-{}", uuid::Uuid::new_v4());
        let keys: Vec<_> = (0..300)
            .map(|i| RecordKey::new(scope.clone(), format!("k{i}")))
            .collect();
        for key in &keys {
            store.claim(&fresh_claim(key)).await.expect("claim");
        }
        let live = RecordKey::new(scope.clone(), "live");
        let mut claim = fresh_claim(&live);
        claim.retain = Duration::from_secs(8 * 3600);
        store.claim(&claim).await.expect("claim");
        store
            .complete(&live, claim.token, &response("live"))
            .await
            .expect("complete");

        let placed = backend.keys.keys().await;
        assert!(placed.len() >= 3, "three primaries: {placed:?}");
        for (primary, keys) in &placed {
            assert!(keys.len() > 50, "{primary} holds {} records", keys.len());
        }
        assert_eq!(placed.iter().map(|(_, k)| k.len()).sum::<usize>(), 301);

        clock.set(T0 + Duration::from_secs(4 * 3600));
        let batch = store.purge_expired(40).await.expect("purge");
        assert_eq!(batch, 40, "a call deletes at most a batch");
        let swept = Sweeper::new(store.clone())
            .batch_size(1_000)
            .sweep_once()
            .await
            .expect("sweep");
        assert_eq!(
            batch + swept,
            300,
            "the pass purged every record past retention"
        );
        let left = backend.keys.keys().await;
        assert_eq!(
            left.iter().map(|(_, k)| k.len()).sum::<usize>(),
            1,
            "only the live record is left: {left:?}"
        );
        assert!(store
            .get(&live)
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get")
            .is_some());
    }

    /// A completion on instance A wakes a waiter on instance B, subscribed through another seed
    /// node: the message crosses the cluster, and only because B announced itself.
    #[cfg_attr(
        skip_redis_cluster,
        ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
    )]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_on_one_instance_wakes_a_waiter_subscribed_on_another_node() {
        let backend = cluster().await;
        let mut seeds = backend.seeds.clone();
        let a = backend.store_with(seeds.clone()).await;
        seeds.rotate_left(1);
        let b = backend.store_with(seeds).await;
        assert!(b.is_subscribed(), "connect returns once subscribed");

        idem_tests::conformance::a_completion_or_release_wakes_its_key_on_another_instance(&a, &b)
            .await;
        // Through the engine too (the shared case in `idem_tests::conformance`).
        idem_tests::conformance::a_waiting_duplicate_on_another_instance_is_woken(a, b).await;
    }

    /// A node that does not know a script (a fresh node, a promoted replica, `SCRIPT FLUSH`) gets it
    /// with the call that needs it.
    #[cfg_attr(
        skip_redis_cluster,
        ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
    )]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scripts_are_loaded_on_the_node_that_lacks_them() {
        let backend = cluster().await;
        let store = backend.store().await;
        let engine = Engine::new(store);
        let flush = || {
            for node in idem_tests::services::cluster_primaries(&backend.seeds).expect("nodes") {
                let mut conn = redis::Client::open(node.as_str())
                    .and_then(|c| c.get_connection())
                    .expect("connect");
                redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query::<()>(&mut conn)
                    .expect("flush");
            }
        };
        for _ in 0..2 {
            flush();
            let key = fresh_key();
            let Ok(Begin::Execute(guard)) = engine.begin(key.clone(), fp("a"), &policy()).await
            else {
                panic!("a new key executes");
            };
            guard.complete(&response("a")).await.expect("complete");
            match engine.begin(key, fp("a"), &policy()).await {
                Ok(Begin::Replay(replay)) => assert_eq!(replay.response, response("a")),
                other => panic!("expected Replay, got {other:?}"),
            }
        }
    }

    /// With `wait_for_replicas`, a claim that the replicas asked for cannot confirm (each primary
    /// here has one) fails as unavailable, and the handler never runs; with as many as there are,
    /// claims and completions go through.
    #[cfg_attr(
        skip_redis_cluster,
        ignore = "needs a Redis Cluster, skipped by IDEM_TEST_SKIP"
    )]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claims_the_replicas_do_not_confirm_are_unavailable() {
        let backend = cluster().await;
        // Each primary has one replica: asking for two always runs to the bound (kept short), asking
        // for one returns as soon as the replica confirms (the bound only fails a stuck replica, and
        // is generous for a machine the whole suite keeps busy).
        let store = |replicas, bound| {
            RedisClusterStore::builder(backend.seeds.clone())
                .prefix(&backend.prefix)
                .wait_for_replicas(replicas, bound)
                .connect()
        };
        let two = Engine::new(store(2, Duration::from_millis(50)).await.expect("connect"));
        for _ in 0..3 {
            match two.begin(fresh_key(), fp("a"), &policy()).await {
                Err(Rejection::Unavailable { source, .. }) => {
                    assert_eq!(source.kind(), StoreErrorKind::Unavailable, "{source}")
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
        }

        let one = store(1, Duration::from_secs(10)).await.expect("connect");
        let key = fresh_key();
        let claim = fresh_claim(&key);
        assert!(matches!(
            one.claim(&claim).await.expect("confirmed by the replica"),
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        one.complete(&key, claim.token, &response("a"))
            .await
            .expect("confirmed by the replica");
        let replay = one.claim(&fresh_claim(&key)).await.expect("replay");
        assert!(
            matches!(replay, ClaimOutcome::Existing(Found { record: _, .. })),
            "{replay:?}"
        );
    }
}
