//! The Redis Cluster store (`cluster` section): new keys and replays through the engine, on one
//! Redis server and on a Redis Cluster, beside each one's floor, the commands idem sends issued
//! directly through the same client (`SET … NX GET PX` to claim or replay, `EVALSHA` of a fenced
//! completion script); and the same on the cluster with `wait_for_replicas(1)`, whose floor adds
//! `WAIT 1` after each command in the same pipeline. All cells interleaved in one run, each the
//! median of `IDEM_BENCH_ROUNDS` rounds.
//!
//! The cluster is `IDEM_BENCH_REDIS_CLUSTER_URL` (`redis-cluster://host:port[,host:port…]`;
//! default `.ci/redis-cluster`'s on 7000-7002). The bench's records there live under the prefix
//! `idem-bench` and are purged at the end; the floor's keys expire after ten minutes.

use crate::floors::{self, fingerprint};
use crate::load::{Bounds, Ops, Sample, Sliced};
use crate::report::{dur, median, rate, Config};
use crate::stores;
use idem_runtime::store::redis::RedisClusterStore;
use idem_runtime::store::Purge;
use idem_runtime::{Engine, FencingToken};
use redis::aio::ConnectionLike;
use std::sync::Arc;
use std::time::Duration;

/// Concurrent operations per cell.
const WORKERS: usize = 64;
/// Completed keys the replay cells read, round robin.
const REPLAY_KEYS: u64 = 1_000;
/// Slices per round (see `load::interleaved`).
const SLICES: u32 = 10;

/// Fences a completion as idem's `settle.lua` does: stores the response only if the key still
/// holds this claim's in-flight value, keeping its TTL.
const FENCED_COMPLETE: &str = "if redis.call('GET', KEYS[1]) == ARGV[1] then \
     return redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL') end return false";

/// The direct path: a connection, and whether each command is followed by `WAIT 1`.
#[derive(Clone)]
struct Floor<C> {
    conn: C,
    wait: bool,
    script: Arc<redis::Script>,
}

impl<C: ConnectionLike + Clone + Send + Sync + 'static> Floor<C> {
    /// `cmd`, then `WAIT 1 1000` in the same pipeline if the floor waits.
    async fn send<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> redis::RedisResult<T> {
        let mut conn = self.conn.clone();
        if !self.wait {
            return cmd.query_async(&mut conn).await;
        }
        let mut pipe = redis::pipe();
        pipe.add_command(cmd).cmd("WAIT").arg(1).arg(1000).ignore();
        let (reply,): (T,) = pipe.query_async(&mut conn).await?;
        Ok(reply)
    }

    /// The claim idem sends, with the floor's in-flight value (the fingerprint and a token).
    fn claim(key: &str, token: i64) -> redis::Cmd {
        let mut value = fingerprint().0.to_vec();
        value.extend_from_slice(&token.to_be_bytes());
        let mut cmd = redis::cmd("SET");
        cmd.arg(key)
            .arg(value)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(600_000);
        cmd
    }

    async fn new_request(&self, key: String) -> bool {
        let token = FencingToken::generate().0;
        let Ok(None) = self.send::<Option<Vec<u8>>>(Self::claim(&key, token)).await else {
            return false;
        };
        let mut in_flight = fingerprint().0.to_vec();
        in_flight.extend_from_slice(&token.to_be_bytes());
        let mut done = fingerprint().0.to_vec();
        done.extend_from_slice(&floors::response().body);
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.script.get_hash())
            .arg(1)
            .arg(&key)
            .arg(&in_flight)
            .arg(&done);
        match self.send::<Option<String>>(cmd.clone()).await {
            Err(e) if e.kind() == redis::ErrorKind::NoScriptError => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(FENCED_COMPLETE)
                    .arg(1)
                    .arg(&key)
                    .arg(&in_flight)
                    .arg(&done);
                self.send::<Option<String>>(eval).await
            }
            done => done,
        }
        .is_ok_and(|r| r.is_some())
    }

    /// The claim finds the completed value; the replay checks its fingerprint and reads the body.
    async fn replay(&self, key: String) -> bool {
        self.send::<Option<Vec<u8>>>(Self::claim(&key, 1))
            .await
            .ok()
            .flatten()
            .is_some_and(|v| v.starts_with(&fingerprint().0) && v.len() > 32)
    }
}

/// The floor's loads, new keys and replays (after completing the replay keys).
async fn floor_loads<C: ConnectionLike + Clone + Send + Sync + 'static>(
    floor: Floor<C>,
    run: &str,
) -> [Box<dyn Sliced>; 2] {
    let replay: Arc<str> = format!("{run}-replay").into();
    for n in 0..REPLAY_KEYS {
        floor.new_request(format!("{replay}-{n}")).await;
    }
    let (f, prefix): (_, Arc<str>) = (floor.clone(), format!("{run}-new").into());
    let new = Ops::new(WORKERS, move |w, n| {
        let (f, key) = (f.clone(), format!("{prefix}-{w}-{n}"));
        async move { f.new_request(key).await }
    });
    let replays = Ops::new(WORKERS, move |_, n| {
        let (f, key) = (floor.clone(), format!("{replay}-{}", n % REPLAY_KEYS));
        async move { f.replay(key).await }
    });
    [Box::new(new), Box::new(replays)]
}

/// The engine's loads, new keys and replays (after completing the replay keys).
async fn engine_loads(engine: Engine, run: &str) -> [Box<dyn Sliced>; 2] {
    let replay: Arc<str> = format!("{run}-replay").into();
    for n in 0..REPLAY_KEYS {
        floors::engine_new(&engine, &replay, n.to_string()).await;
    }
    let (e, scope): (_, Arc<str>) = (engine.clone(), format!("{run}-new").into());
    let new = Ops::new(WORKERS, move |w, n| {
        let (e, scope) = (e.clone(), scope.clone());
        async move { floors::engine_new(&e, &scope, format!("{w}-{n}")).await }
    });
    let replays = Ops::new(WORKERS, move |_, n| {
        let (e, scope) = (engine.clone(), replay.clone());
        async move { floors::engine_replay(&e, &scope, (n % REPLAY_KEYS).to_string()).await }
    });
    [Box::new(new), Box::new(replays)]
}

pub(crate) async fn run(cfg: &Config) {
    let (url, seeds) = stores::redis_cluster_seeds();
    let cluster = |wait: bool| {
        let builder = RedisClusterStore::builder(seeds.clone()).prefix("idem-bench");
        let builder = match wait {
            true => builder.wait_for_replicas(1, Duration::from_secs(1)),
            false => builder,
        };
        builder.connect()
    };
    let (Ok(plain), Ok(waiting), Ok(client)) = (
        cluster(false).await,
        cluster(true).await,
        redis::cluster::ClusterClient::new(seeds.clone()),
    ) else {
        println!("## Redis Cluster\n\nskipped: no cluster at {url} (`.ci/redis-cluster start`)\n");
        return;
    };
    let cluster_conn = client
        .get_async_connection()
        .await
        .expect("the floor's cluster connection");
    let (single, single_conn) = match stores::redis(None).await {
        Ok(redis) => redis,
        Err(e) => {
            println!("## Redis Cluster\n\nskipped: {e}\n");
            return;
        }
    };
    let (plain, waiting) = (Arc::new(plain), Arc::new(waiting));
    let script = Arc::new(redis::Script::new(FENCED_COMPLETE));
    let rows = [
        "Redis, one server",
        "Redis Cluster, 3 primaries",
        "Redis Cluster, `wait_for_replicas(1)`",
    ];
    let mut medians = vec![Vec::new(); 12];
    for round in 0..cfg.rounds {
        let run = format!("r{}-{round}", std::process::id());
        let single_floor = Floor {
            conn: single_conn.clone(),
            wait: false,
            script: script.clone(),
        };
        let floor = |wait| Floor {
            conn: cluster_conn.clone(),
            wait,
            script: script.clone(),
        };
        let mut loads: Vec<Box<dyn Sliced>> = Vec::new();
        loads.extend(engine_loads(Engine::from_arc(single.clone()), &format!("s{run}")).await);
        loads.extend(floor_loads(single_floor, &format!("fs{run}")).await);
        loads.extend(engine_loads(Engine::from_arc(plain.clone()), &format!("c{run}")).await);
        loads.extend(floor_loads(floor(false), &format!("fc{run}")).await);
        loads.extend(engine_loads(Engine::from_arc(waiting.clone()), &format!("w{run}")).await);
        loads.extend(floor_loads(floor(true), &format!("fw{run}")).await);
        let slice = Bounds {
            time: cfg.cell() / SLICES,
            requests: u64::MAX,
        };
        let count = loads.len();
        for turn in 0..SLICES as usize {
            for i in 0..count {
                loads[(i + turn) % count].run_slice(slice).await;
            }
        }
        for (cell, load) in loads.into_iter().enumerate() {
            medians[cell].push(load.into_sample());
        }
    }
    let cell = |i: usize| -> (f64, Duration) {
        let samples = &medians[i];
        let ops = median(samples.iter().map(Sample::throughput).collect());
        let p50 = median(samples.iter().map(|s| s.p50().as_secs_f64()).collect());
        (ops, Duration::from_secs_f64(p50))
    };
    println!("## Redis Cluster\n");
    println!(
        "Store-level (no HTTP), {WORKERS} concurrent operations, ops/s (p50); the floor sends the \
         same commands directly through the same client.\n"
    );
    println!("| store | new key: engine | new key: floor | replay: engine | replay: floor |");
    println!("|---|---|---|---|---|");
    for (r, name) in rows.iter().enumerate() {
        let [en, rn, fn_, fr] = [
            cell(4 * r),
            cell(4 * r + 1),
            cell(4 * r + 2),
            cell(4 * r + 3),
        ];
        let show = |(ops, p50): (f64, Duration)| format!("{} ({})", rate(ops), dur(p50));
        println!(
            "| {name} | {} | {} | {} | {} |",
            show(en),
            show(fn_),
            show(rn),
            show(fr)
        );
    }
    let errors: u64 = medians.iter().flatten().map(|s| s.errors).sum();
    println!("\nFailed operations in all cells: {errors}.\n");
    // The bench's records, on every primary: all past retention a few years from now, judged by a
    // store whose clock stands there (the servers' own clocks would keep them). Each call scans a
    // bounded part of the keyspace; these cover a million keys per primary.
    let later = idem_runtime::clock::Timestamp::from_millis(i64::MAX / 2);
    let sweeper = RedisClusterStore::builder(seeds.clone())
        .prefix("idem-bench")
        .clock(idem_runtime::clock::ManualClock::new(later))
        .connect()
        .await;
    for _ in 0..64 {
        let Ok(sweeper) = &sweeper else { break };
        if sweeper.purge_expired(100_000).await.is_err() {
            break;
        }
    }
}
