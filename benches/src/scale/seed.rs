//! Bulk loads in each store's own format: the records a store holds before a measurement, written
//! directly (one server-side `INSERT … SELECT` per chunk on SQLite and PostgreSQL, pipelined `SET`s
//! on Redis, each primary's share pipelined to it directly on a Redis Cluster), never through idem.
//!
//! Record `i` (numbered from 0, so a larger size extends a smaller one) is in scope
//! `tenant-<i % 16>` under key `<8 hex digits of a multiplicative hash of i>-<i>`, so keys spread
//! over the whole index as real ones do. One in twenty is in flight (a claim whose worker died:
//! its lease ran out long ago), one in twenty completed but expired (still retained), the rest
//! completed with a ~300-byte body, all created within the last day and retained for a week. Every
//! record carries the bench's request fingerprint, so a completed one replays.
//!
//! The purge's records are past retention: scope `expired-<i % 16>`, completed, created more than
//! eight days ago.

use crate::floors;
use std::time::{Duration, Instant};

/// The scopes the live records share.
pub(crate) const SCOPES: u64 = 16;
/// Records per `INSERT … SELECT` (a transaction each) and per progress line.
const CHUNK: u64 = 500_000;
const HOUR: i64 = 3_600_000;
const DAY: i64 = 24 * HOUR;

/// The stored body, about 300 bytes of JSON.
pub(crate) const BODY: &str = concat!(
    r#"{"id":"pay_7f3a9c2e41b8","amount":1000,"currency":"KRW","status":"captured","#,
    r#""description":"two apples","customer":"cus_51c0ffee","method":"card","#,
    r#""card":{"brand":"visa","last4":"4242","exp":"12/29"},"#,
    r#""created":"2026-12-07T12:00:00Z","captured":"2026-12-07T12:00:01Z","#,
    r#""metadata":{"order":"ord_20261207_000123","channel":"web"},"receipt":"rcpt_0001"}"#
);
/// The stored headers, in the SQL stores' JSON column format.
pub(crate) const HEADERS_JSON: &str = r#"[["content-type","application/json"]]"#;

/// Which records a load writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Set {
    /// The live records (mixed states, retained).
    Live,
    /// Records past retention, for the purge.
    Expired,
}

impl Set {
    fn scope_prefix(self) -> &'static str {
        match self {
            Set::Live => "tenant-",
            Set::Expired => "expired-",
        }
    }

    /// How long before the load's `now` the newest record was created.
    fn age(self) -> i64 {
        match self {
            Set::Live => HOUR,
            Set::Expired => 8 * DAY,
        }
    }
}

/// Record `i`'s scope.
pub(crate) fn scope(set: Set, i: u64) -> String {
    format!("{}{}", set.scope_prefix(), i % SCOPES)
}

/// Record `i`'s key (the SQL loads compute the same).
pub(crate) fn key(i: u64) -> String {
    format!("{:08x}-{i}", i.wrapping_mul(2_654_435_761) % (1 << 32))
}

/// The `n`th of the live completed records (not expired) among the first `size`: `size` at
/// least 20.
pub(crate) fn completed(n: u64, size: u64) -> u64 {
    let blocks = (size / 20).max(1);
    let h = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
    (h % blocks) * 20 + 2 + (h / blocks) % 18
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn progress(store: &str, set: Set, done: u64, to: u64, started: Instant) {
    eprintln!(
        "seed {store} {set:?}: {done}/{to} ({:.0} records/s)",
        done as f64 / started.elapsed().as_secs_f64().max(1e-9)
    );
}

/// The columns every SQL load writes, from `i` (the row number) and `c` (its creation time), with
/// `?`-style placeholders named by the caller: `scope_prefix`, `fp`, `live` (1 or 0), `headers`,
/// `body`. `hex` is the dialect's `printf('%08x', x)`.
fn select_columns(p: [&str; 5], hex8: &str) -> String {
    let [scope_prefix, fp, live, headers, body] = p;
    format!(
        "{scope_prefix} || (i % 16), {hex8} || '-' || i, {fp}, i, c,
         CASE WHEN {live} = 1 AND i % 20 = 1 THEN c + 60000 ELSE c + {exp} END,
         c + {retain},
         CASE WHEN {live} = 1 AND i % 20 = 0 THEN 'in_flight' ELSE 'completed' END,
         CASE WHEN {live} = 1 AND i % 20 = 0 THEN c + 30000 END,
         CASE WHEN {live} = 1 AND i % 20 = 0 THEN NULL ELSE 201 END,
         CASE WHEN {live} = 1 AND i % 20 = 0 THEN NULL ELSE {headers} END,
         CASE WHEN {live} = 1 AND i % 20 = 0 THEN NULL ELSE {body} END",
        exp = 2 * DAY,
        retain = 7 * DAY,
    )
}

const COLUMNS: &str = "scope, key, fingerprint, token, created_at, expires_at, retain_until, \
                       state, lease_until, status, headers, body";

/// Writes records `from..to` of `set` on a SQLite connection of its own (a large page cache,
/// `synchronous = OFF` for the load alone; the file stays in WAL mode), checkpointing the log
/// after each chunk.
pub(crate) async fn sqlite(url: &str, set: Set, from: u64, to: u64) -> Result<(), String> {
    use sqlx::ConnectOptions;
    let options: sqlx::sqlite::SqliteConnectOptions = url.parse().map_err(|e| format!("{e}"))?;
    let mut conn = options.connect().await.map_err(|e| e.to_string())?;
    for pragma in [
        "PRAGMA cache_size = -1000000",
        "PRAGMA synchronous = OFF",
        "PRAGMA temp_store = MEMORY",
    ] {
        sqlx::query(pragma)
            .execute(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
    }
    let sql = format!(
        "WITH RECURSIVE s(i) AS (SELECT ?1 UNION ALL SELECT i + 1 FROM s WHERE i + 1 < ?2)
         INSERT INTO idem_records ({COLUMNS})
         SELECT {} FROM (SELECT i, ?4 - ?5 - (i % {spread}) AS c FROM s)",
        select_columns(
            ["?3", "?6", "?7", "?8", "?9"],
            "printf('%08x', (i * 2654435761) % 4294967296)"
        ),
        spread = 23 * HOUR,
    );
    let (now, fp, started) = (now_ms(), floors::fingerprint().0, Instant::now());
    let mut at = from;
    while at < to {
        let end = (at + CHUNK).min(to);
        sqlx::query(&sql)
            .bind(at as i64)
            .bind(end as i64)
            .bind(set.scope_prefix())
            .bind(now)
            .bind(set.age())
            .bind(&fp[..])
            .bind(i64::from(set == Set::Live))
            .bind(HEADERS_JSON)
            .bind(BODY.as_bytes())
            .execute(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
            .execute(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        at = end;
        progress("SQLite", set, at - from, to - from, started);
    }
    sqlx::query("ANALYZE")
        .execute(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Writes records `from..to` of `set` into `idem.records` with server-side `INSERT … SELECT`s
/// (`synchronous_commit = off` for the load's session alone), then `VACUUM ANALYZE`s the table so
/// that autovacuum does not start in the middle of a measurement.
pub(crate) async fn postgres(
    pool: &sqlx::PgPool,
    set: Set,
    from: u64,
    to: u64,
) -> Result<(), String> {
    let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
    sqlx::query("SET synchronous_commit = off")
        .execute(&mut *conn)
        .await
        .map_err(|e| e.to_string())?;
    let sql = format!(
        "INSERT INTO idem.records ({COLUMNS})
         SELECT {} FROM (SELECT i, $4 - $5 - (i % {spread}) AS c
                         FROM generate_series($1::bigint, $2::bigint - 1) AS i) AS s",
        select_columns(
            ["$3", "$6", "$7", "$8", "$9"],
            "lpad(to_hex((i * 2654435761) % 4294967296), 8, '0')"
        ),
        spread = 23 * HOUR,
    );
    let (now, fp, started) = (now_ms(), floors::fingerprint().0, Instant::now());
    let mut at = from;
    while at < to {
        let end = (at + CHUNK).min(to);
        sqlx::query(&sql)
            .bind(at as i64)
            .bind(end as i64)
            .bind(set.scope_prefix())
            .bind(now)
            .bind(set.age())
            .bind(&fp[..])
            .bind(i64::from(set == Set::Live))
            .bind(HEADERS_JSON)
            .bind(BODY.as_bytes())
            .execute(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
        at = end;
        progress("PostgreSQL", set, at - from, to - from, started);
    }
    sqlx::query("RESET synchronous_commit")
        .execute(&mut *conn)
        .await
        .map_err(|e| e.to_string())?;
    let vacuum = Instant::now();
    sqlx::query("VACUUM ANALYZE idem.records")
        .execute(&mut *conn)
        .await
        .map_err(|e| e.to_string())?;
    eprintln!(
        "seed PostgreSQL: VACUUM ANALYZE in {:.1} s",
        vacuum.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Record `i`'s Redis key under `prefix` (idem's layout: `<prefix>:{<len>:<scope>:<key>}`; the
/// seeded scopes and keys need no escaping).
pub(crate) fn redis_key(prefix: &str, scope: &str, key: &str) -> String {
    format!("{prefix}:{{{}:{scope}:{key}}}", scope.len())
}

/// Record `i` of `set` as idem's Redis store writes it (`blob.rs`): the 75-byte header, then a
/// completed record's response; and its retention (the key's expiry), in ms since the epoch.
fn redis_value(set: Set, i: u64, now: i64, retain_at: Option<i64>) -> (Vec<u8>, i64) {
    let c = now - set.age() - (i as i64 % (23 * HOUR));
    let live = set == Set::Live;
    let in_flight = live && i % 20 == 0;
    let expires = if live && i % 20 == 1 {
        c + 60_000
    } else {
        c + 2 * DAY
    };
    let retain = retain_at.unwrap_or(c + 7 * DAY);
    let mut v = Vec::with_capacity(75 + 6 + 8 + 30 + BODY.len());
    v.push(1);
    v.push(if in_flight { b'F' } else { b'D' });
    v.push(0);
    v.extend_from_slice(&(i as i64).to_be_bytes());
    for t in [c, expires, retain, if in_flight { c + 30_000 } else { 0 }] {
        v.extend_from_slice(&t.to_be_bytes());
    }
    v.extend_from_slice(&floors::fingerprint().0);
    if !in_flight {
        let (name, value) = ("content-type", "application/json");
        v.extend_from_slice(&201u16.to_be_bytes());
        v.extend_from_slice(&1u32.to_be_bytes());
        v.extend_from_slice(&(name.len() as u32).to_be_bytes());
        v.extend_from_slice(name.as_bytes());
        v.extend_from_slice(&(value.len() as u32).to_be_bytes());
        v.extend_from_slice(value.as_bytes());
        v.extend_from_slice(BODY.as_bytes());
    }
    (v, retain)
}

/// Writes records `from..to` of `set` under `prefix`, each a `SET … PXAT <retention>` as the
/// store's claim and completion leave it, in pipelines of 1,000 records (split among `nodes`: one
/// server, or a cluster's primaries, each key on the node `node_of` names), eight per node in
/// flight. `retain_at` overrides every record's retention (the purge's records, which must still
/// exist when written).
pub(crate) async fn redis<C>(
    nodes: &[C],
    node_of: impl Fn(&[u8]) -> usize,
    prefix: &str,
    set: Set,
    from: u64,
    to: u64,
    retain_at: Option<i64>,
) -> Result<(), String>
where
    C: redis::aio::ConnectionLike + Clone + Send + 'static,
{
    const PIPE: u64 = 1_000;
    const IN_FLIGHT: usize = 8;
    let (now, started) = (now_ms(), Instant::now());
    let mut pending = tokio::task::JoinSet::new();
    let mut at = from;
    let mut reported = from;
    while at < to {
        let end = (at + PIPE).min(to);
        let mut pipes: Vec<redis::Pipeline> = nodes.iter().map(|_| redis::pipe()).collect();
        for i in at..end {
            let (value, retain) = redis_value(set, i, now, retain_at);
            let k = redis_key(prefix, &scope(set, i), &key(i));
            pipes[node_of(k.as_bytes())]
                .cmd("SET")
                .arg(k)
                .arg(value)
                .arg("PXAT")
                .arg(retain)
                .ignore();
        }
        for (pipe, conn) in pipes.into_iter().zip(nodes) {
            if pipe.is_empty() {
                continue;
            }
            let mut conn = conn.clone();
            pending.spawn(async move { pipe.query_async::<()>(&mut conn).await });
        }
        while pending.len() >= IN_FLIGHT * nodes.len() {
            if let Some(done) = pending.join_next().await {
                done.map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())?;
            }
        }
        at = end;
        if at - reported >= CHUNK || at == to {
            reported = at;
            progress("Redis", set, at - from, to - from, started);
        }
    }
    while let Some(done) = pending.join_next().await {
        done.map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The slots of a Redis Cluster.
const SLOTS: usize = 16_384;

/// The cluster slot of `key`: CRC16 (XMODEM) of its hash tag (the text between the first `{`
/// and the next `}`, if not empty) or of the whole key, modulo [`SLOTS`].
pub(crate) fn slot(key: &[u8]) -> usize {
    let tag = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            rest.iter()
                .position(|&b| b == b'}')
                .filter(|&len| len > 0)
                .map(|len| &rest[..len])
        })
        .unwrap_or(key);
    let mut crc: u16 = 0;
    for &b in tag {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    usize::from(crc) % SLOTS
}

/// A cluster's primaries, each connected directly, and for each slot the index of the primary
/// that serves it (`CLUSTER SLOTS`): what lets a load pipeline each primary's share of the keys
/// (the cluster connection refuses a pipeline over several slots).
pub(crate) async fn primaries(
    conn: &redis::cluster_async::ClusterConnection,
) -> Result<(Vec<redis::aio::MultiplexedConnection>, Vec<usize>), String> {
    let mut conn = conn.clone();
    let ranges: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("CLUSTER SLOTS: {e}"))?;
    let (mut addrs, mut nodes, mut owner) = (Vec::new(), Vec::new(), vec![usize::MAX; SLOTS]);
    let bad = |e: redis::RedisError| format!("CLUSTER SLOTS: {e}");
    for range in &ranges {
        let [start, end, primary, ..] = range.as_slice() else {
            return Err("CLUSTER SLOTS: a range without a primary".to_owned());
        };
        let node: Vec<redis::Value> = redis::from_redis_value(primary).map_err(bad)?;
        let [host, port, ..] = node.as_slice() else {
            return Err("CLUSTER SLOTS: a primary without an address".to_owned());
        };
        let start: usize = redis::from_redis_value(start).map_err(bad)?;
        let end: usize = redis::from_redis_value(end).map_err(bad)?;
        let host: String = redis::from_redis_value(host).map_err(bad)?;
        let port: u16 = redis::from_redis_value(port).map_err(bad)?;
        let addr = format!("{host}:{port}");
        let index = match addrs.iter().position(|a| *a == addr) {
            Some(i) => i,
            None => {
                let client =
                    redis::Client::open(format!("redis://{addr}")).map_err(|e| e.to_string())?;
                nodes.push(
                    client
                        .get_multiplexed_async_connection()
                        .await
                        .map_err(|e| format!("{addr}: {e}"))?,
                );
                addrs.push(addr);
                addrs.len() - 1
            }
        };
        for slot in owner.iter_mut().take(end.min(SLOTS - 1) + 1).skip(start) {
            *slot = index;
        }
    }
    if owner.contains(&usize::MAX) {
        return Err("CLUSTER SLOTS: some slots have no primary".to_owned());
    }
    Ok((nodes, owner))
}

/// Deletes every key under `prefix` on each of the cluster's primaries (`SCAN` and `UNLINK`, one
/// key per command: a node refuses a command over several slots).
pub(crate) async fn clear_cluster(
    conn: &redis::cluster_async::ClusterConnection,
    prefix: &str,
) -> Result<u64, String> {
    let (nodes, _) = primaries(conn).await?;
    let mut deleted = 0;
    for mut node in nodes {
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}:*"))
                .arg("COUNT")
                .arg(10_000)
                .query_async(&mut node)
                .await
                .map_err(|e| format!("SCAN: {e}"))?;
            if !keys.is_empty() {
                let mut pipe = redis::pipe();
                for k in &keys {
                    pipe.cmd("UNLINK").arg(k).ignore();
                }
                pipe.query_async::<()>(&mut node)
                    .await
                    .map_err(|e| format!("UNLINK: {e}"))?;
                deleted += keys.len() as u64;
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
    Ok(deleted)
}

/// How long a load of `n` took, for the report.
pub(crate) fn rate(n: u64, took: Duration) -> f64 {
    n as f64 / took.as_secs_f64().max(1e-9)
}

#[cfg(test)]
mod tests {
    /// The slots Redis itself gives (`CLUSTER KEYSLOT`): the load sends each key to the primary
    /// that serves it, or the pipeline fails.
    #[test]
    fn slots_are_redis_cluster_slots() {
        assert_eq!(super::slot(b"foo"), 12_182);
        assert_eq!(super::slot(b"123456789"), 0x31C3);
        assert_eq!(
            super::slot(b"{user1000}.following"),
            super::slot(b"user1000")
        );
        assert_eq!(super::slot(b"a{bc}d"), super::slot(b"bc"));
    }
}
