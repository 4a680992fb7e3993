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
}

impl Redis {
    fn new(url: String) -> Self {
        Self {
            url,
            prefix: format!("idem-test-{}", uuid::Uuid::new_v4()),
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

impl Drop for Redis {
    /// Deletes every key under this instance's prefix (a blocking connection: Drop cannot await).
    fn drop(&mut self) {
        let cleanup = || -> redis::RedisResult<()> {
            let client = redis::Client::open(self.url.as_str())?;
            let mut conn = client.get_connection()?;
            let keys: Vec<String> =
                redis::Commands::scan_match::<_, String>(&mut conn, format!("{}:*", self.prefix))?
                    .collect();
            for chunk in keys.chunks(500) {
                redis::cmd("DEL").arg(chunk).query::<()>(&mut conn)?;
            }
            Ok(())
        };
        if let Err(e) = cleanup() {
            eprintln!("could not delete the test keys under {}: {e}", self.prefix);
        }
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
    let url = services::redis_url();
    match RedisStore::builder(&url).connect().await {
        Ok(_) => Some(Redis::new(url)),
        Err(e) => services::unreachable_service("Redis", &e),
    }
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
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::watch;

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
        let proxy = Proxy::start(&backend.url).await;
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
        let proxy = Proxy::start(&backend.url).await;
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
        let proxy = Proxy::start(&backend.url).await;
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
        let proxy = Proxy::start(&backend.url).await;
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

    /// A TCP proxy in front of Redis that can be cut off (existing connections closed, new ones
    /// dropped at once) and restored, and that records the name of every command clients send.
    struct Proxy {
        addr: SocketAddr,
        up: Arc<AtomicBool>,
        cuts: watch::Sender<u64>,
        commands: Arc<Mutex<Vec<String>>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Proxy {
        fn drop(&mut self) {
            self.task.abort();
            self.cuts.send_modify(|n| *n += 1);
        }
    }

    impl Proxy {
        async fn start(redis_url: &str) -> Self {
            let upstream = upstream(redis_url).await;
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let up = Arc::new(AtomicBool::new(true));
            let (cuts, _) = watch::channel(0u64);
            let commands = Arc::new(Mutex::new(Vec::new()));
            let task = tokio::spawn({
                let (up, cuts, commands) = (up.clone(), cuts.clone(), commands.clone());
                async move {
                    while let Ok((client, _)) = listener.accept().await {
                        if !up.load(Ordering::SeqCst) {
                            drop(client);
                            continue;
                        }
                        let mut cut = cuts.subscribe();
                        let commands = commands.clone();
                        tokio::spawn(async move {
                            let Ok(server) = TcpStream::connect(upstream).await else {
                                return;
                            };
                            tokio::select! {
                                _ = pump(client, server, commands) => {}
                                _ = cut.changed() => {}
                            }
                        });
                    }
                }
            });
            Self {
                addr,
                up,
                cuts,
                commands,
                task,
            }
        }

        fn url(&self) -> String {
            format!("redis://{}", self.addr)
        }

        fn cut(&self) {
            self.up.store(false, Ordering::SeqCst);
            self.cuts.send_modify(|n| *n += 1);
        }

        fn restore(&self) {
            self.up.store(true, Ordering::SeqCst);
        }

        fn commands(&self) -> Vec<String> {
            self.commands.lock().expect("lock").clone()
        }
    }

    async fn upstream(redis_url: &str) -> SocketAddr {
        let client = redis::Client::open(redis_url).expect("redis url");
        let target = match &client.get_connection_info().addr {
            redis::ConnectionAddr::Tcp(host, port) => format!("{host}:{port}"),
            other => panic!("the proxy needs a TCP redis url, got {other:?}"),
        };
        tokio::net::lookup_host(target)
            .await
            .expect("resolve")
            .next()
            .expect("an address")
    }

    async fn pump(client: TcpStream, server: TcpStream, commands: Arc<Mutex<Vec<String>>>) {
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = server.into_split();
        let requests = async {
            let mut pending = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match client_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                pending.extend_from_slice(&buf[..n]);
                let names = take_commands(&mut pending);
                commands.lock().expect("lock").extend(names);
                if server_write.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        };
        let replies = async {
            let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        };
        tokio::select! {
            _ = requests => {}
            _ = replies => {}
        }
    }

    /// Removes the complete RESP commands (arrays of bulk strings, as clients send them) from the
    /// front of `buf` and returns their names in upper case.
    fn take_commands(buf: &mut Vec<u8>) -> Vec<String> {
        fn line(buf: &[u8], at: usize) -> Option<(&[u8], usize)> {
            let end = buf.get(at..)?.windows(2).position(|w| w == b"\r\n")?;
            Some((&buf[at..at + end], at + end + 2))
        }
        fn number(bytes: &[u8]) -> usize {
            std::str::from_utf8(bytes)
                .ok()
                .and_then(|s| s.parse().ok())
                .expect("a RESP length")
        }
        let mut names = Vec::new();
        let mut consumed = 0;
        'commands: while let Some((header, mut at)) = line(buf, consumed) {
            assert_eq!(header.first(), Some(&b'*'), "clients send arrays");
            let mut name = None;
            for _ in 0..number(&header[1..]) {
                let Some((len, start)) = line(buf, at) else {
                    break 'commands;
                };
                let end = start + number(&len[1..]);
                if buf.len() < end + 2 {
                    break 'commands;
                }
                name.get_or_insert_with(|| {
                    String::from_utf8_lossy(&buf[start..end]).to_uppercase()
                });
                at = end + 2;
            }
            names.push(name.unwrap_or_default());
            consumed = at;
        }
        buf.drain(..consumed);
        names
    }

    #[test]
    fn the_proxy_counts_commands_split_across_reads() {
        let wire =
            b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n*1\r\n$4\r\nPING\r\n*3\r\n$7\r\nevalsha\r\n$2\r\nab";
        let mut buf = wire.to_vec();
        assert_eq!(take_commands(&mut buf), ["GET", "PING"]);
        buf.extend_from_slice(b"\r\n$0\r\n\r\n");
        assert_eq!(take_commands(&mut buf), ["EVALSHA"]);
        assert!(buf.is_empty());
    }
}
