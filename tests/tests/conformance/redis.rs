//! The store conformance suite on the Redis store, and what only Redis has to show: completions
//! crossing instances through pub/sub, a replay in one round trip, and riding out an outage.
//!
//! Every backend instance (one per case) uses a fresh key prefix on the server at
//! `IDEM_TEST_REDIS_URL` and deletes its keys when dropped, also when the case fails.

use idem_runtime::clock::Clock;
use idem_runtime::store::redis::RedisStore;
use idem_tests::conformance::Backend;
use idem_tests::conformance::T0;
use idem_tests::services;
use std::sync::Arc;

struct Redis {
    url: String,
    prefix: String,
    /// The clock the stores of [`store`](Self::store) judge time by, standing at `T0`.
    clock: idem_runtime::clock::ManualClock,
    _keys: services::RedisPrefix,
}

impl Redis {
    fn new(keys: services::RedisPrefix) -> Self {
        Self {
            url: keys.url().to_owned(),
            prefix: keys.prefix().to_owned(),
            clock: idem_runtime::clock::ManualClock::new(T0),
            _keys: keys,
        }
    }

    async fn store(&self) -> RedisStore {
        self.store_on(Arc::new(self.clock.clone())).await
    }

    async fn store_on(&self, clock: Arc<dyn Clock>) -> RedisStore {
        let builder = self.builder().clock(clock);
        builder.connect().await.expect("connect to redis")
    }

    fn builder(&self) -> idem_runtime::store::redis::RedisStoreBuilder {
        RedisStore::builder(&self.url).prefix(&self.prefix)
    }
}

#[async_trait::async_trait]
impl Backend for Redis {
    type Store = RedisStore;
    async fn open(&self, clock: Arc<dyn Clock>) -> RedisStore {
        self.store_on(clock).await
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

async fn redis() -> Redis {
    Redis::new(services::RedisPrefix::create().await)
}

idem_tests::conformance_suite!(
    redis,
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
);

mod redis_only {
    use super::redis;
    use futures_util::StreamExt;

    use idem_runtime::clock::Timestamp;
    use idem_runtime::store::redis::RedisStore;
    use idem_runtime::store::{Claim, ClaimOutcome, Claimed, Found, Purge};
    use idem_runtime::sweeper::Sweeper;
    use idem_runtime::{
        Begin, Engine, FencingToken, RecordKey, RecordState, Rejection, Store, StoreErrorKind,
    };
    use idem_tests::conformance::{fp, fresh_key, policy, response, Harness, T0};
    use idem_tests::proxy::Proxy;
    use std::sync::Arc;
    use std::time::Duration;

    /// Bounds a step that should finish at once, so that a broken wake-up fails instead of hanging;
    /// it never decides a pass.
    const GENEROUS: Duration = Duration::from_secs(30);

    /// A plain connection to the test server, for looking at and writing raw values.
    async fn raw(backend: &super::Redis) -> redis::aio::MultiplexedConnection {
        redis::Client::open(backend.url.as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect")
    }

    async fn value(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<Vec<u8>> {
        redis::cmd("GET")
            .arg(key)
            .query_async(conn)
            .await
            .expect("get")
    }

    /// The message a completion publishes for `key`: the hash tag of its Redis key.
    fn tag(store: &RedisStore, key: &RecordKey) -> String {
        let redis_key = store.redis_key(key);
        let open = redis_key.find('{').expect("a hash tag");
        redis_key[open + 1..redis_key.len() - 1].to_owned()
    }

    /// A completion or release on instance A wakes a waiter on instance B, which shares nothing
    /// with A but the Redis server: the wake-up can only come through pub/sub, and only because B
    /// announced itself.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completion_on_one_instance_wakes_a_waiter_on_another() {
        let backend = redis().await;
        let (a, b) = (backend.store().await, backend.store().await);
        assert!(b.is_subscribed(), "connect returns once subscribed");
        idem_tests::conformance::a_completion_or_release_wakes_its_key_on_another_instance(&a, &b)
            .await;
    }

    /// Through the engine, woken through pub/sub (the shared case in `idem_tests::conformance`).
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiting_duplicate_on_another_instance_is_woken_through_redis() {
        let backend = redis().await;
        idem_tests::conformance::a_waiting_duplicate_on_another_instance_is_woken(
            backend.store().await,
            backend.store().await,
        )
        .await;
    }

    /// Completions and releases publish only records a waiter announced: every message reaches every
    /// instance's listener, so a message per completion would cost every instance work for every
    /// request. Observed by a raw subscriber on the channel; a sentinel published after each operation
    /// proves that nothing came before it.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn only_awaited_records_are_published() {
        let backend = redis().await;
        let store = backend.store().await;
        let channel = format!("{}:done", backend.prefix);
        let mut conn = raw(&backend).await;
        let mut pubsub = redis::Client::open(backend.url.as_str())
            .expect("url")
            .get_async_pubsub()
            .await
            .expect("pubsub");
        pubsub.subscribe(&channel).await.expect("subscribe");
        let mut messages = pubsub.on_message();
        let mut next = async || -> String {
            tokio::time::timeout(GENEROUS, messages.next())
                .await
                .expect("a message arrives")
                .expect("subscribed")
                .get_payload()
                .expect("text")
        };
        let mut sentinel = async || {
            redis::cmd("PUBLISH")
                .arg(&channel)
                .arg("sentinel")
                .query_async::<i64>(&mut conn)
                .await
                .expect("sentinel");
        };

        // Nobody waits: completion and release send nothing before the sentinel.
        let done = fresh_key();
        let claim = fresh_claim(&done);
        store.claim(&claim).await.expect("claim");
        store
            .complete(&done, claim.token, &response("a"))
            .await
            .expect("complete");
        let released = fresh_key();
        let claim = fresh_claim(&released);
        store.claim(&claim).await.expect("claim");
        store
            .release(&released, claim.token)
            .await
            .expect("release");
        sentinel().await;
        assert_eq!(next().await, "sentinel");

        // Announced (twice: the second changes nothing): each sends its key's tag, then the
        // sentinel follows.
        for release in [false, true] {
            let key = fresh_key();
            let claim = fresh_claim(&key);
            store.claim(&claim).await.expect("claim");
            store.announce_waiter(&key).await.expect("announce");
            store
                .announce_waiter(&key)
                .await
                .expect("a second announce");
            if release {
                store.release(&key, claim.token).await.expect("release");
            } else {
                store
                    .complete(&key, claim.token, &response("a"))
                    .await
                    .expect("complete");
            }
            sentinel().await;
            assert_eq!(next().await, tag(&store, &key));
            assert_eq!(next().await, "sentinel", "one message per change");
        }

        // A takeover keeps the announcement: the duplicate waiting for the dead worker's claim
        // hears the completion of the claim that replaced it.
        let key = fresh_key();
        let dead = fresh_claim(&key);
        store.claim(&dead).await.expect("claim");
        store.announce_waiter(&key).await.expect("announce");
        backend.clock.set(T0 + Duration::from_secs(60));
        let taker = fresh_claim(&key);
        assert!(matches!(
            store.claim(&taker).await.expect("claim"),
            ClaimOutcome::Claimed(Claimed {
                taken_over: true,
                ..
            })
        ));
        store
            .complete(&key, taker.token, &response("b"))
            .await
            .expect("complete");
        sentinel().await;
        assert_eq!(next().await, tag(&store, &key));
        assert_eq!(next().await, "sentinel");

        // Announcing a completed record or an absent key changes nothing.
        let before = value(&mut conn, &store.redis_key(&done)).await;
        store.announce_waiter(&done).await.expect("announce");
        assert_eq!(value(&mut conn, &store.redis_key(&done)).await, before);
        let absent = fresh_key();
        store.announce_waiter(&absent).await.expect("announce");
        assert_eq!(value(&mut conn, &store.redis_key(&absent)).await, None);
    }

    /// Many claims at once on a record whose worker died, and on one past retention: the store
    /// decodes the record, then replaces it with a script that checks it is still the one decoded, so
    /// exactly one claim wins and every other sees the winner's claim. A takeover keeps the key's TTL
    /// and the record's times; a replaced forgotten record gets the new claim's.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_replacements_elect_exactly_one() {
        let backend = redis().await;
        let store = Arc::new(backend.store().await);
        let mut conn = raw(&backend).await;
        let pttl = async |conn: &mut redis::aio::MultiplexedConnection, key: &str| -> i64 {
            redis::cmd("PTTL")
                .arg(key)
                .query_async(conn)
                .await
                .expect("pttl")
        };
        let four_hours = 4 * 3600 * 1000;

        for (at, taken_over) in [
            (T0 + Duration::from_secs(60), true),
            (T0 + Duration::from_secs(5 * 3600), false),
        ] {
            let key = fresh_key();
            backend.clock.set(T0);
            let first = fresh_claim(&key);
            store.claim(&first).await.expect("claim");
            backend.clock.set(at);
            let tasks: Vec<_> = (0..16)
                .map(|_| {
                    let (store, key) = (store.clone(), key.clone());
                    tokio::spawn(async move {
                        let mut claim = fresh_claim(&key);
                        claim.retain = Duration::from_secs(8 * 3600);
                        let outcome = store.claim(&claim).await.expect("claim");
                        (claim.token, outcome)
                    })
                })
                .collect();
            let mut winners = Vec::new();
            let mut seen = Vec::new();
            for task in tasks {
                match task.await.expect("join") {
                    (token, ClaimOutcome::Claimed(Claimed { taken_over: t, .. })) => {
                        assert_eq!(t, taken_over);
                        winners.push(token);
                    }
                    (_, ClaimOutcome::Existing(Found { record, .. })) => seen.push(record.token),
                }
            }
            assert_eq!(winners.len(), 1, "exactly one claim wins");
            assert!(seen.iter().all(|t| *t == winners[0]), "the others see it");
            let record = store
                .get(&key)
                .await
                .map(|found| found.map(|f| f.record))
                .expect("get")
                .expect("record");
            assert_eq!(record.token, winners[0]);
            let ttl = pttl(&mut conn, &store.redis_key(&key)).await;
            if taken_over {
                assert_eq!(record.retain_until, T0 + first.retain, "times are kept");
                assert_eq!(record.created_at, T0);
                assert!(ttl > 0 && ttl <= four_hours, "the TTL is kept: {ttl}");
            } else {
                assert_eq!(record.created_at, at, "a new record");
                assert!(ttl > four_hours, "a fresh TTL: {ttl}");
            }
        }
    }

    /// A replay, a mismatch and a fresh claim are each one script (`claim.lua`, which reads the
    /// server's time and decides in the same step); a new request adds one script, the completion.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_is_one_script() {
        let backend = redis().await;
        let proxy = Proxy::redis(&backend.url).await;
        let store = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect()
            .await
            .expect("connect through the proxy");
        let h = Harness::new(store, idem_runtime::clock::ManualClock::new(T0));
        let sent_since = |before: usize| -> Vec<String> {
            proxy.commands()[before..]
                .iter()
                .filter(|c| *c != "PING") // the pub/sub keepalive
                .cloned()
                .collect()
        };
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
        assert_eq!(sent_since(before), ["EVALSHA"], "a replay is one script");

        let before = proxy.commands().len();
        let mismatch = h.engine.begin(key, fp("b"), &policy()).await;
        assert!(
            matches!(mismatch, Err(Rejection::Mismatch { .. })),
            "{mismatch:?}"
        );
        let fresh = h.engine.begin(fresh_key(), fp("a"), &policy()).await;
        let Ok(Begin::Execute(guard)) = fresh else {
            panic!("expected Execute, got {fresh:?}");
        };
        assert_eq!(sent_since(before), ["EVALSHA", "EVALSHA"]);
        let before = proxy.commands().len();
        guard.complete(&response("b")).await.expect("complete");
        assert_eq!(sent_since(before), ["EVALSHA"], "the completion script");
    }

    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_outage_fails_promptly_and_service_resumes_by_itself() {
        let backend = redis().await;
        let proxy = Proxy::redis(&backend.url).await;
        let store = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect()
            .await
            .expect("connect through the proxy");
        let store = Arc::new(store);
        let engine = Engine::from_arc(store.clone()).with_store_timeout(None);
        let claim = |key| fresh_claim(key);

        let key = fresh_key();
        assert!(matches!(
            store.claim(&claim(&key)).await,
            Ok(ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            }))
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
            let err = tokio::time::timeout(GENEROUS, store.get(&key))
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
            if let Ok(found) = tokio::time::timeout(GENEROUS, store.get(&key))
                .await
                .expect("answers instead of hanging")
            {
                recovered = Some(found.map(|found| found.record));
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

    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lazy_store_starts_while_redis_is_down_and_connects_when_it_returns() {
        let backend = redis().await;
        let proxy = Proxy::redis(&backend.url).await;
        proxy.cut();
        let store = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect_lazy()
            .expect("valid url");
        let key = fresh_key();
        let err = tokio::time::timeout(GENEROUS, store.claim(&fresh_claim(&key)))
            .await
            .expect("fails instead of hanging")
            .expect_err("redis is cut off");
        assert_eq!(err.kind(), StoreErrorKind::Unavailable);
        proxy.restore();
        let outcome = tokio::time::timeout(GENEROUS, store.claim(&fresh_claim(&key)))
            .await
            .expect("answers instead of hanging")
            .expect("connected once redis returned");
        assert!(matches!(
            outcome,
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        tokio::time::timeout(GENEROUS, store.subscription_is(true))
            .await
            .expect("the lazy store subscribes to completions once redis is back");
    }

    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_completions_subscription_comes_back_after_an_outage() {
        let backend = redis().await;
        let proxy = Proxy::redis(&backend.url).await;
        let a = backend.store().await;
        let b = RedisStore::builder(proxy.url())
            .prefix(&backend.prefix)
            .connect()
            .await
            .expect("connect through the proxy");
        assert!(b.is_subscribed(), "connect returns once subscribed");
        // A waiter whose completion may be published while B is not listening.
        let mut waiting = b.subscribe(&fresh_key());

        proxy.cut();
        tokio::time::timeout(GENEROUS, b.subscription_is(false))
            .await
            .expect("B notices the lost subscription");
        proxy.restore();
        tokio::time::timeout(GENEROUS, b.subscription_is(true))
            .await
            .expect("B subscribes again by itself");
        // Messages sent meanwhile are lost: the resubscription wakes every waiter to re-read.
        tokio::time::timeout(GENEROUS, waiting.changed())
            .await
            .expect("B's waiter is woken when B subscribes again");

        let key = fresh_key();
        let claim = fresh_claim(&key);
        assert!(matches!(
            a.claim(&claim).await.expect("claim"),
            ClaimOutcome::Claimed(Claimed {
                taken_over: false,
                ..
            })
        ));
        let mut woken = b.subscribe(&key);
        // B's command connection went through the cut too: its first call may meet the dead
        // connection, and the manager reconnects on the next.
        let mut announced = false;
        for _ in 0..5 {
            if b.announce_waiter(&key).await.is_ok() {
                announced = true;
                break;
            }
        }
        assert!(announced, "B announces once reconnected");
        a.complete(&key, claim.token, &response("a"))
            .await
            .expect("complete");
        tokio::time::timeout(GENEROUS, woken.changed())
            .await
            .expect("B is woken by A's completion again");
    }

    /// Values the store cannot read are reported as corrupt, by every operation, and never changed:
    /// not by a claim (even one that would find the record past retention), an announcement, a
    /// completion, a release or a purge.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreadable_records_are_corrupt_and_left_alone() {
        let backend = redis().await;
        let store = backend.store().await;
        let mut conn = raw(&backend).await;
        let later = T0 + Duration::from_secs(5 * 3600);

        // A hash at a record's key: what the layout before this one wrote.
        let key = fresh_key();
        redis::cmd("HSET")
            .arg(store.redis_key(&key))
            .arg("state")
            .arg("inflight")
            .query_async::<()>(&mut conn)
            .await
            .expect("hset");
        for err in [
            store.claim(&fresh_claim(&key)).await.expect_err("claim"),
            store
                .get(&key)
                .await
                .map(|found| found.map(|f| f.record))
                .expect_err("get"),
            store
                .complete(&key, FencingToken(1), &response("a"))
                .await
                .expect_err("complete"),
        ] {
            assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{err}");
        }

        // A string that is not a record; and a record of another layout version.
        let garbage = fresh_key();
        redis::cmd("SET")
            .arg(store.redis_key(&garbage))
            .arg("not a record, but long enough to hold a record's header: 75 bytes or more")
            .query_async::<()>(&mut conn)
            .await
            .expect("set");
        let versioned = fresh_key();
        let claim = fresh_claim(&versioned);
        store.claim(&claim).await.expect("claim");
        redis::cmd("SETRANGE")
            .arg(store.redis_key(&versioned))
            .arg(0)
            .arg(&[2u8][..])
            .query_async::<()>(&mut conn)
            .await
            .expect("setrange");
        backend.clock.set(later);
        for key in [&garbage, &versioned] {
            let before = value(&mut conn, &store.redis_key(key)).await;
            assert!(before.is_some());
            let errors = [
                store
                    .get(key)
                    .await
                    .map(|found| found.map(|f| f.record))
                    .expect_err("get"),
                store.claim(&fresh_claim(key)).await.expect_err("claim"),
                store
                    .complete(key, claim.token, &response("a"))
                    .await
                    .expect_err("complete"),
                store.release(key, claim.token).await.expect_err("release"),
            ];
            for err in errors {
                assert_eq!(err.kind(), StoreErrorKind::Corrupt, "{key}: {err}");
            }
            store.announce_waiter(key).await.expect("announce");
            store.purge_expired(1_000).await.expect("purge");
            assert_eq!(
                value(&mut conn, &store.redis_key(key)).await,
                before,
                "{key} changed"
            );
        }
        let kind: String = redis::cmd("TYPE")
            .arg(store.redis_key(&key))
            .query_async(&mut conn)
            .await
            .expect("type");
        assert_eq!(
            kind, "hash",
            "the purges left the hash alone, and did not fail on it"
        );
    }

    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn purging_continues_one_pass_over_the_keyspace_and_skips_nothing() {
        let backend = redis().await;
        let store = Arc::new(backend.store().await);
        let scope = format!("sweep-{}", uuid::Uuid::new_v4());
        let keys: Vec<_> = (0..300)
            .map(|i| idem_runtime::RecordKey::new(scope.clone(), format!("k{i}")))
            .collect();
        for key in &keys {
            store.claim(&fresh_claim(key)).await.expect("claim");
        }
        let live = idem_runtime::RecordKey::new(scope.clone(), "live");
        let mut claim = fresh_claim(&live);
        claim.retain = Duration::from_secs(8 * 3600);
        store.claim(&claim).await.expect("claim");

        backend.clock.set(T0 + Duration::from_secs(4 * 3600));
        let batch = store.purge_expired(40).await.expect("purge");
        assert_eq!(batch, 40, "a call deletes at most a batch");
        // One call continues the pass the first one started, to its end: a batch larger than what
        // is left shows that stopping inside a SCAN page skipped nothing.
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
        for key in &keys {
            assert!(
                store
                    .get(key)
                    .await
                    .map(|found| found.map(|f| f.record))
                    .expect("get")
                    .is_none(),
                "{key} purged"
            );
        }
        assert!(store
            .get(&live)
            .await
            .map(|found| found.map(|f| f.record))
            .expect("get")
            .is_some());
    }

    /// An operator's forget or erase on instance A wakes a waiter on instance B that announced
    /// itself, as a completion does: B re-reads and finds the key free.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn forget_and_erase_wake_waiters_on_another_instance() {
        use idem_runtime::store::StateKind;
        let backend = redis().await;
        let (a, b) = (backend.store().await, backend.store().await);
        let scope = format!("wake-{}", uuid::Uuid::new_v4());
        for erase in [false, true] {
            let key = RecordKey::new(scope.clone(), format!("k-{erase}"));
            let claim = fresh_claim(&key);
            a.claim(&claim).await.expect("claim");
            let mut woken = b.subscribe(&key);
            b.announce_waiter(&key).await.expect("announce");
            if erase {
                assert_eq!(a.erase_scope(&scope, 100).await.expect("erase"), 1);
            } else {
                assert!(a
                    .forget(&key, claim.token, StateKind::InFlight)
                    .await
                    .expect("forget"));
            }
            tokio::time::timeout(GENEROUS, woken.changed())
                .await
                .expect("b was woken by a's forget or erase");
            assert!(b.get(&key).await.expect("get").is_none(), "the key is free");
        }
    }

    /// The server's time, in ms, as `TIME` reads it.
    async fn server_time(conn: &mut redis::aio::MultiplexedConnection) -> Timestamp {
        let (secs, micros): (i64, i64) = redis::cmd("TIME").query_async(conn).await.expect("time");
        Timestamp::from_millis(secs * 1000 + micros / 1000)
    }

    /// Without a clock of its own the store judges by the server's `TIME`: a claim's instants are
    /// the server's, a read carries the server's time, and a renewal counts from it. Two instances
    /// share nothing but the server, so nothing can come from theirs.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn without_a_clock_the_servers_time_decides() {
        let backend = redis().await;
        let (a, b) = (
            backend.builder().connect().await.expect("connect"),
            backend.builder().connect().await.expect("connect"),
        );
        let mut conn = raw(&backend).await;
        let key = fresh_key();
        let claim = fresh_claim(&key);
        let before = server_time(&mut conn).await;
        let ClaimOutcome::Claimed(claimed) = a.claim(&claim).await.expect("claim") else {
            panic!("a new key is claimed");
        };
        let after = server_time(&mut conn).await;
        assert!(
            before <= claimed.created_at && claimed.created_at <= after,
            "{before:?} <= {:?} <= {after:?}",
            claimed.created_at
        );
        assert_eq!(claimed.expires_at, claimed.created_at + claim.ttl);
        let found = b.get(&key).await.expect("get").expect("the record");
        assert!(found.now >= claimed.created_at && found.now <= server_time(&mut conn).await);
        assert_eq!(found.record.retain_until, claimed.created_at + claim.retain);
        let RecordState::InFlight { lease_until } = found.record.state else {
            panic!("in flight");
        };
        assert_eq!(lease_until, claimed.created_at + claim.lease);
        // Another instance's claim finds it held: nobody's lease ran out on the server's clock.
        let other = fresh_claim(&key);
        assert!(matches!(
            b.claim(&other).await.expect("claim"),
            ClaimOutcome::Existing(Found { .. })
        ));
        a.renew(&key, claim.token, Duration::from_secs(90))
            .await
            .expect("renew");
        let renewed = b.get(&key).await.expect("get").expect("the record");
        let RecordState::InFlight { lease_until } = renewed.record.state else {
            panic!("in flight");
        };
        assert!(lease_until >= found.now + Duration::from_secs(90));
        assert!(lease_until <= renewed.now + Duration::from_secs(90));
    }

    fn fresh_claim(key: &idem_runtime::RecordKey) -> Claim<'_> {
        Claim {
            key,
            fingerprint: fp("a"),
            token: FencingToken::generate(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(3600),
            retain: Duration::from_secs(4 * 3600),
        }
    }

    /// An erase leaves no key of its scope on the server, bodies included (a record's body lives in
    /// its own value), and every key of another scope: counted with SCAN, not through the store.
    #[cfg_attr(skip_redis, ignore = "needs Redis, skipped by IDEM_TEST_SKIP")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn erase_leaves_no_key_of_the_scope_on_the_server() {
        let backend = redis().await;
        let store = backend.store().await;
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let (erased, kept) = (format!("erased-{tag}"), format!("kept-{tag}"));
        for scope in [&erased, &kept] {
            for i in 0..3 {
                let key = RecordKey::new(scope.clone(), format!("k{i}"));
                let token = FencingToken::generate();
                let claim = Claim {
                    key: &key,
                    fingerprint: fp("a"),
                    token,
                    lease: Duration::from_secs(30),
                    ttl: Duration::from_secs(3600),
                    retain: Duration::from_secs(4 * 3600),
                };
                store.claim(&claim).await.expect("claim");
                store
                    .complete(&key, token, &response("secret"))
                    .await
                    .expect("complete");
            }
        }
        assert_eq!(store.erase_scope(&erased, 100).await.expect("erase"), 3);
        let mut conn = raw(&backend).await;
        let mut names: Vec<String> = Vec::new();
        let mut cursor: u64 = 0;
        loop {
            let (next, page): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{}*", backend.prefix))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("scan");
            names.extend(page);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        assert!(
            !names.iter().any(|name| name.contains(&erased)),
            "keys of the erased scope left: {names:?}"
        );
        assert_eq!(
            names.iter().filter(|name| name.contains(&kept)).count(),
            3,
            "{names:?}"
        );
    }
}
