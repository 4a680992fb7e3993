//! The store conformance suite on the Redis store, and what only Redis has to show: completions
//! crossing instances through pub/sub, a replay in one round trip, and riding out an outage.
//!
//! Every backend instance (one per case) uses a fresh key prefix on the server at
//! `IDEM_TEST_REDIS_URL` and deletes its keys when dropped, also when the case fails.

use idem_runtime::store::redis::RedisStore;
use idem_tests::conformance::Backend;
use idem_tests::services;

struct Redis {
    url: String,
    prefix: String,
    _keys: services::RedisPrefix,
}

impl Redis {
    fn new(keys: services::RedisPrefix) -> Self {
        Self {
            url: keys.url().to_owned(),
            prefix: keys.prefix().to_owned(),
            _keys: keys,
        }
    }

    async fn store(&self) -> RedisStore {
        RedisStore::builder(&self.url)
            .prefix(&self.prefix)
            .connect()
            .await
            .expect("connect to redis")
    }
}

#[async_trait::async_trait]
impl Backend for Redis {
    type Store = RedisStore;
    async fn open(&self) -> RedisStore {
        self.store().await
    }
    fn durable(&self) -> bool {
        true
    }
    async fn unreachable(&self) -> Option<RedisStore> {
        // Nothing listens on port 1; a lazy store answers "unavailable" instead of failing to build.
        Some(
            RedisStore::builder("redis://127.0.0.1:1")
                .prefix(&self.prefix)
                .connect_lazy()
                .expect("valid url"),
        )
    }
}

async fn redis() -> Option<Redis> {
    services::RedisPrefix::create().await.map(Redis::new)
}

idem_tests::conformance_suite!(redis);

mod redis_only {
    use super::redis;
    use idem_runtime::clock::Clock;
    use idem_runtime::store::redis::RedisStore;
    use idem_runtime::store::{Claim, ClaimOutcome, Purge};
    use idem_runtime::sweeper::Sweeper;
    use idem_runtime::{Begin, Engine, FencingToken, Rejection, Store, StoreErrorKind};
    use idem_tests::conformance::{fp, fresh_key, policy, response, Harness, T0};
    use idem_tests::proxy::Proxy;
    use std::sync::Arc;
    use std::time::Duration;

    /// Bounds a step that should finish at once, so that a broken wake-up fails instead of hanging;
    /// it never decides a pass.
    const GENEROUS: Duration = Duration::from_secs(30);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_on_one_instance_wakes_waiters_on_another() {
        let Some(backend) = redis().await else { return };
        let a = Harness::new(backend.store().await);
        let b = Harness::with_clock(backend.store().await, a.clock.clone());

        // The store level: B's subscription fires for A's completion, which only pub/sub carries.
        let key = fresh_key();
        let guard = match a.engine.begin(key.clone(), fp("a"), &policy()).await {
            Ok(Begin::Execute(guard)) => guard,
            other => panic!("expected Execute, got {other:?}"),
        };
        let mut woken = b.store.subscribe(&key);
        guard.complete(&response("a")).await.expect("complete");
        tokio::time::timeout(GENEROUS, woken.changed())
            .await
            .expect("B was woken by A's completion");

        // The engine level: a duplicate waiting on B replays A's response. Lease and wait are far
        // longer than the bound, so only the wake-up can end the wait in time.
        let long = policy()
            .lease(Duration::from_secs(600))
            .wait(Duration::from_secs(600));
        let key = fresh_key();
        let guard = match a.engine.begin(key.clone(), fp("a"), &long).await {
            Ok(Begin::Execute(guard)) => guard,
            other => panic!("expected Execute, got {other:?}"),
        };
        let subscribed = b.store.subscribed.clone();
        let engine = b.engine.clone();
        let duplicate = tokio::spawn(async move { engine.begin(key, fp("a"), &long).await });
        subscribed.notified().await;
        guard.complete(&response("b")).await.expect("complete");
        match tokio::time::timeout(GENEROUS, duplicate)
            .await
            .expect("the waiter on B was woken")
            .expect("join")
        {
            Ok(Begin::Replay(replay)) => assert_eq!(replay.response, response("b")),
            other => panic!("expected Replay, got {other:?}"),
        }

        // A release wakes the other instance too.
        let key = fresh_key();
        let guard = match a.engine.begin(key.clone(), fp("a"), &policy()).await {
            Ok(Begin::Execute(guard)) => guard,
            other => panic!("expected Execute, got {other:?}"),
        };
        let mut woken = b.store.subscribe(&key);
        guard.release().await.expect("release");
        tokio::time::timeout(GENEROUS, woken.changed())
            .await
            .expect("B was woken by A's release");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_is_one_round_trip() {
        let Some(backend) = redis().await else { return };
        let proxy = Proxy::redis(&backend.url).await;
        let store = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect()
            .await
            .expect("connect through the proxy");
        let h = Harness::new(store);
        let key = fresh_key();
        match h.engine.begin(key.clone(), fp("a"), &policy()).await {
            Ok(Begin::Execute(guard)) => guard.complete(&response("a")).await.expect("complete"),
            other => panic!("expected Execute, got {other:?}"),
        }

        let before = proxy.commands().len();
        match h.engine.begin(key.clone(), fp("a"), &policy()).await {
            Ok(Begin::Replay(replay)) => assert_eq!(replay.response, response("a")),
            other => panic!("expected Replay, got {other:?}"),
        }
        let sent: Vec<String> = proxy.commands()[before..]
            .iter()
            .filter(|c| *c != "PING") // the pub/sub keepalive
            .cloned()
            .collect();
        assert_eq!(sent, ["EVALSHA"], "a replay is the claim script alone");

        // A mismatch and a fresh claim are one command too.
        let before = proxy.commands().len();
        let mismatch = h.engine.begin(key, fp("b"), &policy()).await;
        assert!(
            matches!(mismatch, Err(Rejection::Mismatch { .. })),
            "{mismatch:?}"
        );
        let fresh = h.engine.begin(fresh_key(), fp("a"), &policy()).await;
        assert!(matches!(fresh, Ok(Begin::Execute(_))), "{fresh:?}");
        let sent: Vec<String> = proxy.commands()[before..]
            .iter()
            .filter(|c| *c != "PING")
            .cloned()
            .collect();
        assert_eq!(sent, ["EVALSHA", "EVALSHA"]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_outage_fails_promptly_and_service_resumes_by_itself() {
        let Some(backend) = redis().await else { return };
        let proxy = Proxy::redis(&backend.url).await;
        let store = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect()
            .await
            .expect("connect through the proxy");
        let store = Arc::new(store);
        let clock = idem_runtime::clock::ManualClock::new(T0);
        let engine = Engine::from_arc(store.clone())
            .with_clock(clock.clone())
            .with_store_timeout(None);
        let now = clock.now();
        let claim = |key| fresh_claim(key, now);

        let key = fresh_key();
        assert!(matches!(
            store.claim(&claim(&key)).await,
            Ok(ClaimOutcome::Claimed { taken_over: false })
        ));

        proxy.cut();
        // No store timeout in the engine: the store itself must fail, and promptly.
        let outage = tokio::time::timeout(GENEROUS, engine.begin(fresh_key(), fp("a"), &policy()))
            .await
            .expect("fails instead of hanging");
        match outage {
            Err(Rejection::Unavailable { source, .. }) => {
                assert_eq!(source.kind(), StoreErrorKind::Unavailable)
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
        for _ in 0..3 {
            let err = tokio::time::timeout(GENEROUS, store.get(&key, now))
                .await
                .expect("fails instead of hanging")
                .expect_err("redis is cut off");
            assert_eq!(err.kind(), StoreErrorKind::Unavailable);
            let err = tokio::time::timeout(
                GENEROUS,
                store.complete(&key, FencingToken(1), &response("x")),
            )
            .await
            .expect("fails instead of hanging")
            .expect_err("redis is cut off");
            assert_eq!(err.kind(), StoreErrorKind::Unavailable);
        }

        proxy.restore();
        // The first call may still meet the connection attempt that failed during the outage; the
        // manager reconnects by itself within a few calls, with no restart and no new store.
        let mut recovered = None;
        for _ in 0..5 {
            if let Ok(found) = tokio::time::timeout(GENEROUS, store.get(&key, now))
                .await
                .expect("answers instead of hanging")
            {
                recovered = Some(found);
                break;
            }
        }
        let record = recovered
            .expect("service resumed")
            .expect("the record claimed before the outage");
        assert_eq!(record.fingerprint, fp("a"));
        let mut resumed = false;
        for _ in 0..5 {
            if let Ok(Begin::Execute(guard)) = engine.begin(fresh_key(), fp("a"), &policy()).await {
                guard.complete(&response("after")).await.expect("complete");
                resumed = true;
                break;
            }
        }
        assert!(resumed, "the engine runs requests again");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lazy_store_starts_while_redis_is_down_and_connects_when_it_returns() {
        let Some(backend) = redis().await else { return };
        let proxy = Proxy::redis(&backend.url).await;
        proxy.cut();
        let store = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect_lazy()
            .expect("valid url");
        let key = fresh_key();
        let err = tokio::time::timeout(GENEROUS, store.claim(&fresh_claim(&key, T0)))
            .await
            .expect("fails instead of hanging")
            .expect_err("redis is cut off");
        assert_eq!(err.kind(), StoreErrorKind::Unavailable);
        proxy.restore();
        let outcome = tokio::time::timeout(GENEROUS, store.claim(&fresh_claim(&key, T0)))
            .await
            .expect("answers instead of hanging")
            .expect("connected once redis returned");
        assert_eq!(outcome, ClaimOutcome::Claimed { taken_over: false });
        tokio::time::timeout(GENEROUS, store.subscription_is(true))
            .await
            .expect("the lazy store subscribes to completions once redis is back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_completions_subscription_comes_back_after_an_outage() {
        let Some(backend) = redis().await else { return };
        let proxy = Proxy::redis(&backend.url).await;
        let a = backend.store().await;
        let b = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect()
            .await
            .expect("connect through the proxy");
        assert!(b.is_subscribed(), "connect returns once subscribed");

        proxy.cut();
        tokio::time::timeout(GENEROUS, b.subscription_is(false))
            .await
            .expect("B notices the lost subscription");
        proxy.restore();
        tokio::time::timeout(GENEROUS, b.subscription_is(true))
            .await
            .expect("B subscribes again by itself");

        let key = fresh_key();
        let claim = fresh_claim(&key, T0);
        assert_eq!(
            a.claim(&claim).await.expect("claim"),
            ClaimOutcome::Claimed { taken_over: false }
        );
        let mut woken = b.subscribe(&key);
        a.complete(&key, claim.token, &response("a"))
            .await
            .expect("complete");
        tokio::time::timeout(GENEROUS, woken.changed())
            .await
            .expect("B is woken by A's completion again");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreadable_records_are_corrupt_and_left_alone() {
        let Some(backend) = redis().await else { return };
        let store = backend.store().await;
        let client = redis::Client::open(backend.url.as_str()).expect("url");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");

        // Another type at a record's key.
        let key = fresh_key();
        redis::cmd("SET")
            .arg(store.redis_key(&key))
            .arg("not a record")
            .query_async::<()>(&mut conn)
            .await
            .expect("set");
        let err = store
            .claim(&fresh_claim(&key, T0))
            .await
            .expect_err("corrupt");
        assert_eq!(err.kind(), StoreErrorKind::Corrupt);

        // A record with a field that does not parse: reported, never overwritten by a claim.
        let key = fresh_key();
        let claim = fresh_claim(&key, T0);
        store.claim(&claim).await.expect("claim");
        redis::cmd("HSET")
            .arg(store.redis_key(&key))
            .arg("expires")
            .arg("soon")
            .query_async::<()>(&mut conn)
            .await
            .expect("hset");
        let err = store.get(&key, T0).await.expect_err("corrupt");
        assert_eq!(err.kind(), StoreErrorKind::Corrupt);
        let err = store
            .claim(&fresh_claim(&key, T0 + Duration::from_secs(60)))
            .await
            .expect_err("corrupt");
        assert_eq!(err.kind(), StoreErrorKind::Corrupt);
        let token: String = redis::cmd("HGET")
            .arg(store.redis_key(&key))
            .arg("tok")
            .query_async(&mut conn)
            .await
            .expect("hget");
        assert_eq!(
            token,
            claim.token.0.to_string(),
            "the claim changed nothing"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purging_continues_one_pass_over_the_keyspace_and_skips_nothing() {
        let Some(backend) = redis().await else { return };
        let store = Arc::new(backend.store().await);
        let scope = format!("sweep-{}", uuid::Uuid::new_v4());
        let keys: Vec<_> = (0..300)
            .map(|i| idem_runtime::RecordKey::new(scope.clone(), format!("k{i}")))
            .collect();
        for key in &keys {
            store.claim(&fresh_claim(key, T0)).await.expect("claim");
        }
        let live = idem_runtime::RecordKey::new(scope.clone(), "live");
        let mut claim = fresh_claim(&live, T0);
        claim.retain_until = T0 + Duration::from_secs(8 * 3600);
        store.claim(&claim).await.expect("claim");

        let later = T0 + Duration::from_secs(4 * 3600);
        let batch = store.purge_expired(later, 40).await.expect("purge");
        assert_eq!(batch, 40, "a call deletes at most a batch");
        // One call continues the pass the first one started, to its end: a batch larger than what
        // is left shows that stopping inside a SCAN page skipped nothing.
        let clock = idem_runtime::clock::ManualClock::new(later);
        let swept = Sweeper::new(store.clone())
            .batch_size(1_000)
            .with_clock(clock)
            .sweep_once()
            .await
            .expect("sweep");
        assert_eq!(
            batch + swept,
            300,
            "the pass purged every record past retention"
        );
        for key in &keys {
            assert!(
                store.get(key, T0).await.expect("get").is_none(),
                "{key} purged"
            );
        }
        assert!(store.get(&live, later).await.expect("get").is_some());
    }

    fn fresh_claim(
        key: &idem_runtime::RecordKey,
        now: idem_runtime::clock::Timestamp,
    ) -> Claim<'_> {
        Claim {
            key,
            fingerprint: fp("a"),
            token: FencingToken::generate(),
            now,
            lease_until: now + Duration::from_secs(30),
            expires_at: now + Duration::from_secs(3600),
            retain_until: now + Duration::from_secs(4 * 3600),
        }
    }
}
