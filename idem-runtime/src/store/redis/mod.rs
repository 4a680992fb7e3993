//! The Redis store: records shared by every instance of a service, kept by one Redis server.
//!
//! # Layout
//! One hash per record at `<prefix>:{<n>:<scope>:<key>}`, where `n` is the byte length of the
//! (escaped) scope, so that scopes and keys containing `:` can never meet, and `%`, `{` and `}` are
//! percent-escaped so that the braces are always the key's [hash tag]: every script touches exactly one
//! key, so each runs within one Redis Cluster slot. Fields: `state` (`inflight` or `done`), `fp`,
//! `tok`, `created`, `expires`, `retain`, `lease` (in flight), `status`, `headers`, `body` (done).
//!
//! # Operations
//! Each operation is one Lua script (sent as `EVALSHA` through [`::redis::Script`]; the scripts, with
//! their KEYS, ARGV and replies documented at the top, live next to this file):
//!
//! - `claim.lua` inserts, takes over or returns the existing record in one step: a replay costs one
//!   round trip.
//! - `complete.lua` and `release.lua` check the fencing token and the in-flight state, write or
//!   delete, and `PUBLISH` the record's tag on `<prefix>:done`.
//! - `get` is one `HMGET`.
//!
//! Every time is the engine's clock, passed in; Redis's clock is never compared with it.
//!
//! # Expiry
//! A fresh claim sets the hash's TTL to `retain_until - now`, so Redis deletes the record by itself
//! when retention ends. Between `expires_at` and `retain_until` the record is a tombstone the engine
//! answers "expired" from. Records past retention by the caller's clock count as absent whether or not
//! Redis has deleted them yet (claim replaces them, get hides them).
//!
//! [`Purge`] is therefore rarely needed with Redis: it exists for when the engine's clock runs ahead of
//! the TTL Redis applied (tests on a manual clock, a clock that jumped). It walks the store's keys with
//! `SCAN MATCH <prefix>:{*` and deletes, one script per record, those whose `retain_until` has passed,
//! at most a batch per call; consecutive calls continue one pass over the keyspace. That costs a scan
//! of the database per sweep, in exchange for nothing on the request path: an index such as a sorted
//! set by `retain_until` would cost a write on every claim and, being one key, would live in another
//! Cluster slot than the records, so the claim could no longer be one single-slot script. If you run
//! the [`Sweeper`](crate::sweeper::Sweeper) against Redis at all, give it a long interval.
//!
//! # Waking waiters across instances
//! Each store keeps one pub/sub connection, subscribed to `<prefix>:done` by a background task that
//! wakes this process's waiters for each published tag. The task reconnects with backoff and pings
//! the server every 15 s to notice a dead connection; it stops when the store is dropped. A completion
//! published while this instance's subscription is down is missed: waiters here then wake when the
//! lease runs out or their wait bound is reached, and re-read the record (never a wrong answer, only a
//! late one).
//!
//! # Outages
//! Commands go through a [`ConnectionManager`] with connection and response timeouts (1 s and 2 s by
//! default) and no retry inside a call, so while Redis is down every operation fails promptly with
//! [`StoreErrorKind::Unavailable`](super::StoreErrorKind::Unavailable) (HTTP 503), and the manager
//! reconnects by itself when Redis returns.
//!
//! # What Redis must be configured to keep
//! An idempotency record that disappears early means a retry runs the handler again, so:
//! - **No eviction.** Every record carries a TTL, so any `maxmemory-policy` other than `noeviction`
//!   (`volatile-*` included) may drop records under memory pressure. [`RedisStoreBuilder::connect`]
//!   logs a warning when it can read another policy.
//! - **Persistence.** Records survive a Redis restart only as far as its persistence goes (AOF with
//!   `appendfsync everysec` may lose the last second; RDB snapshots, everything since the last one).
//! - **Failover.** Writes are acknowledged by the primary alone (no `WAIT`): a claim not yet
//!   replicated when a replica is promoted is lost, and its retry runs again.
//!
//! Within those limits the guarantee is the engine's: at most one execution per lease.
//!
//! # Redis Cluster
//! Keys and scripts are Cluster-ready (one hash-tagged key per script), but this store talks to a
//! single server through a [`ConnectionManager`]; a Cluster client, sharded pub/sub (`SPUBLISH`) and
//! a per-node purge scan are out of scope for now.
//!
//! [hash tag]: https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/#hash-tags

use super::{Claim, ClaimOutcome, Purge, Store, StoreError, Subscription, Waiters};
use crate::clock::Timestamp;
use crate::fingerprint::Fingerprint;
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use ::redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSub};
use ::redis::{Client, ErrorKind, RedisError, RedisResult, Script};
use futures_util::StreamExt;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::{watch, OnceCell};
use tokio::task::AbortHandle;

/// The hash fields, in the order `claim.lua` returns them and `get` reads them.
const FIELDS: [&str; 10] = [
    "state", "fp", "tok", "created", "expires", "retain", "lease", "status", "headers", "body",
];

/// The longest TTL set on a record (100 years): Redis refuses expiry times that overflow its clock.
const MAX_TTL_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

/// How many keys one `SCAN` step asks for while purging.
const SCAN_COUNT: usize = 256;

/// How many `SCAN` steps one purge call takes at most, so that every call is short; the next call
/// continues where it stopped.
const SCAN_STEPS_PER_CALL: usize = 64;

/// How often the pub/sub connection is pinged to detect a connection that died silently.
const PING_EVERY: Duration = Duration::from_secs(15);

/// The pub/sub task's reconnection backoff.
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// A [`Store`] on Redis, shared by every instance of a service that uses the same server and prefix.
///
/// See the [module documentation](self) for the layout, the scripts and what each operation costs.
///
/// ```no_run
/// use idem_runtime::{Engine, store::redis::RedisStore};
/// # async fn run() -> Result<(), idem_runtime::redis::RedisError> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379")
///     .prefix("payments-idem")
///     .connect()
///     .await?;
/// let engine = Engine::new(store);
/// # let _ = engine;
/// # Ok(())
/// # }
/// ```
pub struct RedisStore {
    client: Client,
    config: ConnectionManagerConfig,
    conn: OnceCell<ConnectionManager>,
    prefix: String,
    channel: String,
    scripts: Scripts,
    waiters: Arc<Waiters>,
    /// Where the current purge pass over the keyspace stands (0: start a new pass).
    scan_cursor: Mutex<u64>,
    listener: AbortHandle,
    /// Whether the listener is subscribed right now.
    subscribed: watch::Receiver<bool>,
}

struct Scripts {
    claim: Script,
    complete: Script,
    release: Script,
    purge: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Script::new(include_str!("claim.lua")),
            complete: Script::new(include_str!("complete.lua")),
            release: Script::new(include_str!("release.lua")),
            purge: Script::new(include_str!("purge.lua")),
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.client.get_connection_info().addr)
            .field("prefix", &self.prefix)
            .field("connected", &self.conn.initialized())
            .field("subscribed", &self.is_subscribed())
            .finish_non_exhaustive()
    }
}

impl Drop for RedisStore {
    fn drop(&mut self) {
        self.listener.abort();
    }
}

/// Configures and connects a [`RedisStore`]; see [`RedisStore::builder`].
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    connection_timeout: Duration,
    response_timeout: Duration,
    reconnect_retries: usize,
}

impl RedisStoreBuilder {
    /// The prefix of every key and of the notification channel (default `"idem"`). Services that
    /// share records must use the same prefix; give unrelated ones different prefixes. It may not
    /// contain `{` or `}` (the braces are the record's hash tag).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How long one connection attempt may take (default 1 s).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How long a command may wait for its reply before failing as unavailable (default 2 s).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How many times a connection attempt is retried, with backoff, before the commands waiting on
    /// it fail (default 0). Whatever the number, the next command tries again, so the store recovers by
    /// itself; retries ride out short blips at the cost of slower failures during an outage (with
    /// redis 0.32 the first retry waits 1 to 2 s), and the engine answers 503 + Retry-After anyway.
    pub fn reconnect_retries(mut self, retries: usize) -> Self {
        self.reconnect_retries = retries;
        self
    }

    /// Connects now: fails if the server cannot be reached, and returns once this store is subscribed
    /// to completions from other instances.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), idem_runtime::redis::RedisError> {
    /// use idem_runtime::store::redis::RedisStore;
    /// use std::time::Duration;
    /// let store = RedisStore::builder("redis://127.0.0.1:6379")
    ///     .response_timeout(Duration::from_millis(500))
    ///     .connect()
    ///     .await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(self) -> RedisResult<RedisStore> {
        let (client, config) = self.prepare()?;
        let conn = ConnectionManager::new_with_config(client.clone(), config.clone()).await?;
        let channel = channel_name(&self.prefix);
        let pubsub = subscribe(&client, &channel, self.connection_timeout).await?;
        warn_if_evicting(conn.clone()).await;
        Ok(self.assemble(client, config, Some(conn), Some(pubsub)))
    }

    /// Builds the store without connecting: the first operation connects, and until the server answers
    /// every operation fails as unavailable. Lets a service start (and answer 503) while Redis is down.
    /// Fails only on an invalid URL or prefix, or outside a Tokio runtime.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use idem_runtime::store::redis::RedisStore;
    /// let store = RedisStore::builder("redis://127.0.0.1:6379").connect_lazy().expect("valid url");
    /// # let _ = store;
    /// # }
    /// ```
    pub fn connect_lazy(self) -> RedisResult<RedisStore> {
        let (client, config) = self.prepare()?;
        tokio::runtime::Handle::try_current().map_err(|e| {
            RedisError::from((
                ErrorKind::ClientError,
                "RedisStore needs a Tokio runtime",
                e.to_string(),
            ))
        })?;
        Ok(self.assemble(client, config, None, None))
    }

    fn prepare(&self) -> RedisResult<(Client, ConnectionManagerConfig)> {
        if self.prefix.contains(['{', '}']) {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "the RedisStore prefix may not contain '{' or '}'",
                self.prefix.clone(),
            )));
        }
        let client = Client::open(self.url.as_str())?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(self.connection_timeout)
            .set_response_timeout(self.response_timeout)
            .set_number_of_retries(self.reconnect_retries)
            // redis 0.32 hands these to backon: the first retry waits 1 s (plus jitter) and each next
            // one `factor` times longer, capped at `max_delay` ms.
            .set_factor(2)
            .set_max_delay(4_000);
        Ok((client, config))
    }

    fn assemble(
        self,
        client: Client,
        config: ConnectionManagerConfig,
        conn: Option<ConnectionManager>,
        pubsub: Option<PubSub>,
    ) -> RedisStore {
        let channel = channel_name(&self.prefix);
        let waiters = Arc::new(Waiters::new());
        let (state, subscribed) = watch::channel(pubsub.is_some());
        let listener = tokio::spawn(listen(
            Listener {
                client: client.clone(),
                channel: channel.clone(),
                waiters: waiters.clone(),
                state,
                connection_timeout: self.connection_timeout,
                response_timeout: self.response_timeout,
            },
            pubsub,
        ))
        .abort_handle();
        RedisStore {
            client,
            config,
            conn: OnceCell::new_with(conn),
            prefix: self.prefix,
            channel,
            scripts: Scripts::new(),
            waiters,
            scan_cursor: Mutex::new(0),
            listener,
            subscribed,
        }
    }
}

impl RedisStore {
    /// Connects to `url` (`redis://[user:password@]host:port[/db]` or `redis+unix:///path`; TLS needs
    /// redis features idem does not enable) with the default settings and the prefix `"idem"`. Same
    /// as `RedisStore::builder(url).connect()`.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), idem_runtime::redis::RedisError> {
    /// use idem_runtime::{Engine, store::redis::RedisStore};
    /// let engine = Engine::new(RedisStore::connect("redis://127.0.0.1:6379").await?);
    /// # let _ = engine;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: &str) -> RedisResult<Self> {
        Self::builder(url).connect().await
    }

    /// A builder for a store on `url`, to set the prefix and timeouts.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            prefix: "idem".to_owned(),
            connection_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(2),
            reconnect_retries: 0,
        }
    }

    /// The prefix of this store's keys and channel.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Whether this store is subscribed, right now, to the completions other instances publish. While
    /// it is not (Redis unreachable, or the subscription reconnecting), this instance's waiters are
    /// woken only by its own completions, and otherwise at the lease end or their wait bound. For
    /// health checks and tests.
    pub fn is_subscribed(&self) -> bool {
        *self.subscribed.borrow()
    }

    /// Resolves once [`is_subscribed`](Self::is_subscribed) equals `subscribed`: `true` waits for the
    /// subscription to be live (say, after [`connect_lazy`](RedisStoreBuilder::connect_lazy)),
    /// `false` for it to be lost.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), idem_runtime::redis::RedisError> {
    /// use idem_runtime::store::redis::RedisStore;
    /// let store = RedisStore::builder("redis://127.0.0.1:6379").connect_lazy()?;
    /// store.subscription_is(true).await;
    /// assert!(store.is_subscribed());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn subscription_is(&self, subscribed: bool) {
        let mut state = self.subscribed.clone();
        // The listener lives as long as the store, so the sender is never dropped while we wait.
        let _ = state.wait_for(|now| *now == subscribed).await;
    }

    /// The Redis key of `key`'s record: `<prefix>:{<tag>}`.
    pub fn redis_key(&self, key: &RecordKey) -> String {
        format!("{}:{{{}}}", self.prefix, encode_tag(key))
    }

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        self.conn
            .get_or_try_init(|| {
                ConnectionManager::new_with_config(self.client.clone(), self.config.clone())
            })
            .await
            .cloned()
            .map_err(StoreError::unavailable)
    }

    /// Deletes those of `keys` that are past retention at `now` (one pipelined round trip, one
    /// script per key); returns how many were deleted.
    async fn purge_keys(
        &self,
        conn: &mut ConnectionManager,
        keys: &[Vec<u8>],
        now: Timestamp,
    ) -> Result<u64, StoreError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let mut pipe = ::redis::pipe();
        pipe.load_script(&self.scripts.purge).ignore();
        for key in keys {
            pipe.invoke_script(self.scripts.purge.key(key).arg(now.as_millis()));
        }
        let deleted: Vec<i64> = pipe.query_async(conn).await.map_err(redis_error)?;
        Ok(deleted.iter().filter(|&&d| d == 1).count() as u64)
    }
}

#[async_trait::async_trait]
impl Store for RedisStore {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        let mut conn = self.conn().await?;
        let now = claim.now.as_millis();
        let ttl = claim
            .retain_until
            .as_millis()
            .saturating_sub(now)
            .clamp(1, MAX_TTL_MS);
        let reply: Vec<Option<Vec<u8>>> = self
            .scripts
            .claim
            .key(self.redis_key(claim.key))
            .arg(now)
            .arg(claim.fingerprint.to_hex())
            .arg(claim.token.0)
            .arg(claim.lease_until.as_millis())
            .arg(claim.expires_at.as_millis())
            .arg(claim.retain_until.as_millis())
            .arg(ttl)
            .invoke_async(&mut conn)
            .await
            .map_err(redis_error)?;
        match reply.split_first() {
            Some((Some(tag), _)) if tag == b"claimed" => {
                Ok(ClaimOutcome::Claimed { taken_over: false })
            }
            Some((Some(tag), _)) if tag == b"taken_over" => {
                Ok(ClaimOutcome::Claimed { taken_over: true })
            }
            Some((Some(tag), fields)) if tag == b"existing" => {
                let record = decode_record(fields)?
                    .ok_or_else(|| StoreError::corrupt("claim returned an empty record"))?;
                Ok(ClaimOutcome::Existing(record))
            }
            _ => Err(StoreError::corrupt(
                "unexpected reply from the claim script",
            )),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let applied: i64 = self
            .scripts
            .complete
            .key(self.redis_key(key))
            .arg(token.0)
            .arg(response.status)
            .arg(response.encode_headers())
            .arg(response.body.as_ref())
            .arg(&self.channel)
            .arg(encode_tag(key))
            .invoke_async(&mut conn)
            .await
            .map_err(redis_error)?;
        if applied != 1 {
            return Err(StoreError::fenced());
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        let mut conn = self.conn().await?;
        let applied: i64 = self
            .scripts
            .release
            .key(self.redis_key(key))
            .arg(token.0)
            .arg(&self.channel)
            .arg(encode_tag(key))
            .invoke_async(&mut conn)
            .await
            .map_err(redis_error)?;
        if applied != 1 {
            return Err(StoreError::fenced());
        }
        self.waiters.notify(key);
        Ok(())
    }

    async fn get(&self, key: &RecordKey, now: Timestamp) -> Result<Option<Record>, StoreError> {
        let mut conn = self.conn().await?;
        let fields: Vec<Option<Vec<u8>>> = ::redis::cmd("HMGET")
            .arg(self.redis_key(key))
            .arg(&FIELDS)
            .query_async(&mut conn)
            .await
            .map_err(redis_error)?;
        Ok(decode_record(&fields)?.filter(|r| !r.is_forgotten(now)))
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.waiters.subscribe(key)
    }
}

#[async_trait::async_trait]
impl Purge for RedisStore {
    /// Deletes at most `batch` records past retention at `now`, continuing one `SCAN` pass over the
    /// store's keys across calls. A call stops at the end of the pass or after 64 `SCAN` steps, and
    /// may then return fewer than `batch`, which ends a [`Sweeper`](crate::sweeper::Sweeper) sweep; the
    /// next sweep continues the pass. See the [module documentation](self).
    async fn purge_expired(&self, now: Timestamp, batch: usize) -> Result<u64, StoreError> {
        let mut conn = self.conn().await?;
        let pattern = format!("{}:{{*", glob_escape(&self.prefix));
        let budget = batch as u64;
        let mut deleted = 0u64;
        let mut cursor = *self
            .scan_cursor
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut steps = 0;
        loop {
            steps += 1;
            let (next, keys): (u64, Vec<Vec<u8>>) = ::redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(SCAN_COUNT)
                .query_async(&mut conn)
                .await
                .map_err(redis_error)?;
            let mut done = 0;
            while done < keys.len() && deleted < budget {
                let take = usize::try_from(budget - deleted)
                    .unwrap_or(usize::MAX)
                    .min(keys.len() - done);
                deleted += self
                    .purge_keys(&mut conn, &keys[done..done + take], now)
                    .await?;
                done += take;
            }
            // SCAN cursors are stateless on the server: stopping inside a page means scanning that
            // page again next time (its deleted keys are gone), so nothing is skipped.
            let resume = if done < keys.len() { cursor } else { next };
            if deleted >= budget || resume == 0 || steps >= SCAN_STEPS_PER_CALL {
                *self
                    .scan_cursor
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = resume;
                return Ok(deleted);
            }
            cursor = resume;
        }
    }
}

/// Warns when the server may evict records. Managed services often refuse `CONFIG`: then say nothing.
async fn warn_if_evicting(mut conn: ConnectionManager) {
    let policy: RedisResult<Vec<String>> = ::redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut conn)
        .await;
    if let Ok(reply) = policy {
        if let Some(policy) = reply.get(1).filter(|p| *p != "noeviction") {
            tracing::warn!(
                target: "idem", maxmemory_policy = %policy,
                "Redis may evict idempotency records under memory pressure, and a retry of an \
                 evicted key runs again; set maxmemory-policy to noeviction"
            );
        }
    }
}

/// The record and tag decoders, for the fuzz targets in `fuzz/` only: compiled under `cargo fuzz`
/// (which sets `--cfg fuzzing`), never in a normal build.
#[cfg(fuzzing)]
#[doc(hidden)]
#[allow(missing_docs)]
pub mod fuzzing {
    use crate::{Record, RecordKey, StoreError};

    pub fn decode_record(fields: &[Option<Vec<u8>>]) -> Result<Option<Record>, StoreError> {
        super::decode_record(fields)
    }

    pub fn encode_tag(key: &RecordKey) -> String {
        super::encode_tag(key)
    }

    pub fn decode_tag(tag: &[u8]) -> Option<RecordKey> {
        super::decode_tag(tag)
    }
}

fn channel_name(prefix: &str) -> String {
    format!("{prefix}:done")
}

/// Redis errors are outages, except a key holding another type than a hash (someone else wrote it).
fn redis_error(e: RedisError) -> StoreError {
    if e.code() == Some("WRONGTYPE") {
        StoreError::corrupt(e)
    } else {
        StoreError::unavailable(e)
    }
}

fn escape(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            c => out.push(c),
        }
    }
}

fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 3)?;
        out.push(match code {
            "25" => '%',
            "7B" => '{',
            "7D" => '}',
            _ => return None,
        });
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// `<n>:<scope>:<key>` with `%`, `{`, `}` escaped and `n` the escaped scope's byte length: injective,
/// brace-free, and the message published on completion.
fn encode_tag(key: &RecordKey) -> String {
    let mut scope = String::with_capacity(key.scope.len());
    escape(&key.scope, &mut scope);
    let mut out = format!("{}:{scope}:", scope.len());
    escape(&key.key, &mut out);
    out
}

fn decode_tag(tag: &[u8]) -> Option<RecordKey> {
    let tag = std::str::from_utf8(tag).ok()?;
    let (len, rest) = tag.split_once(':')?;
    let len: usize = len.parse().ok()?;
    let scope = rest.get(..len)?;
    let key = rest.get(len..)?.strip_prefix(':')?;
    Some(RecordKey::new(unescape(scope)?, unescape(key)?))
}

/// `*`, `?`, `[`, `]` and `\` are glob syntax in `SCAN MATCH`.
fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Decodes the fields in [`FIELDS`] order; `None` if the record does not exist.
fn decode_record(fields: &[Option<Vec<u8>>]) -> Result<Option<Record>, StoreError> {
    if fields.iter().all(Option::is_none) {
        return Ok(None);
    }
    let [state, fp, tok, created, expires, retain, lease, status, headers, body] = fields else {
        return Err(StoreError::corrupt(format!(
            "expected {} record fields, got {}",
            FIELDS.len(),
            fields.len()
        )));
    };
    let fingerprint = Fingerprint::from_hex(text(fp, "fp")?)
        .ok_or_else(|| StoreError::corrupt("field fp is not a fingerprint"))?;
    let state = match text(state, "state")? {
        "inflight" => RecordState::InFlight {
            lease_until: Timestamp::from_millis(number(lease, "lease")?),
        },
        "done" => RecordState::Completed {
            response: StoredResponse {
                status: u16::try_from(number(status, "status")?)
                    .map_err(|e| StoreError::corrupt(format!("field status: {e}")))?,
                headers: StoredResponse::decode_headers(text(headers, "headers")?)
                    .map_err(|e| StoreError::corrupt(format!("field headers: {e}")))?,
                body: bytes::Bytes::from(required(body, "body")?.to_vec()),
            },
        },
        other => {
            return Err(StoreError::corrupt(format!(
                "field state is {other:?}, not inflight or done"
            )))
        }
    };
    Ok(Some(Record {
        fingerprint,
        token: FencingToken(number(tok, "tok")?),
        created_at: Timestamp::from_millis(number(created, "created")?),
        expires_at: Timestamp::from_millis(number(expires, "expires")?),
        retain_until: Timestamp::from_millis(number(retain, "retain")?),
        state,
    }))
}

fn required<'a>(field: &'a Option<Vec<u8>>, name: &str) -> Result<&'a [u8], StoreError> {
    field
        .as_deref()
        .ok_or_else(|| StoreError::corrupt(format!("field {name} is missing")))
}

fn text<'a>(field: &'a Option<Vec<u8>>, name: &str) -> Result<&'a str, StoreError> {
    std::str::from_utf8(required(field, name)?)
        .map_err(|e| StoreError::corrupt(format!("field {name}: {e}")))
}

fn number(field: &Option<Vec<u8>>, name: &str) -> Result<i64, StoreError> {
    text(field, name)?
        .parse()
        .map_err(|e| StoreError::corrupt(format!("field {name}: {e}")))
}

async fn subscribe(client: &Client, channel: &str, timeout: Duration) -> RedisResult<PubSub> {
    let connect = async {
        let mut pubsub = client.get_async_pubsub().await?;
        pubsub.subscribe(channel).await?;
        Ok(pubsub)
    };
    match tokio::time::timeout(timeout, connect).await {
        Ok(result) => result,
        Err(_) => Err(RedisError::from((
            ErrorKind::IoError,
            "timed out subscribing to the idem channel",
        ))),
    }
}

/// What the store's pub/sub task needs.
struct Listener {
    client: Client,
    channel: String,
    waiters: Arc<Waiters>,
    state: watch::Sender<bool>,
    connection_timeout: Duration,
    response_timeout: Duration,
}

/// The store's pub/sub task: wakes local waiters for every tag published on the channel, and
/// reconnects with backoff whenever the connection fails. Runs until the store aborts it.
async fn listen(l: Listener, mut initial: Option<PubSub>) {
    let channel = &l.channel;
    let mut backoff = MIN_BACKOFF;
    loop {
        let pubsub = match initial.take() {
            Some(pubsub) => pubsub,
            None => match subscribe(&l.client, channel, l.connection_timeout).await {
                Ok(pubsub) => {
                    tracing::debug!(target: "idem", %channel, "subscribed to completions");
                    pubsub
                }
                Err(error) => {
                    tracing::warn!(
                        target: "idem", %channel, %error,
                        "cannot subscribe to completions; retrying"
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            },
        };
        backoff = MIN_BACKOFF;
        l.state.send_replace(true);
        let (mut sink, mut stream) = pubsub.split();
        let mut ping =
            tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                message = stream.next() => match message {
                    Some(message) => match decode_tag(message.get_payload_bytes()) {
                        Some(key) => l.waiters.notify(&key),
                        None => tracing::debug!(
                            target: "idem", %channel, "ignored a malformed completion message"
                        ),
                    },
                    None => break,
                },
                _ = ping.tick() => {
                    let pong = tokio::time::timeout(
                        l.response_timeout,
                        sink.ping::<::redis::Value>(),
                    )
                    .await;
                    if !matches!(pong, Ok(Ok(_))) {
                        break;
                    }
                }
            }
        }
        l.state.send_replace(false);
        tracing::warn!(target: "idem", %channel, "lost the completions subscription; reconnecting");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_never_collide() {
        let keys = [
            RecordKey::new("a", "b:c"),
            RecordKey::new("a:b", "c"),
            RecordKey::new("", "a:b:c"),
            RecordKey::new("1:a", ""),
            RecordKey::new("{x}", "}{"),
            RecordKey::new("%7B", "%"),
            RecordKey::new("한글", "키"),
        ];
        let tags: Vec<String> = keys.iter().map(encode_tag).collect();
        for (key, tag) in keys.iter().zip(&tags) {
            assert!(!tag.contains(['{', '}']), "{tag}");
            assert_eq!(decode_tag(tag.as_bytes()).as_ref(), Some(key));
        }
        let mut unique = tags.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), tags.len());
    }

    #[test]
    fn malformed_tags_are_rejected() {
        for bad in ["", "x:a:b", "5:ab:c", "1:a", "1:a;b", "1:%:b", "1:a:%7"] {
            assert_eq!(decode_tag(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn glob_syntax_in_the_prefix_is_escaped() {
        assert_eq!(glob_escape("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }

    #[test]
    fn records_decode_or_report_corruption() {
        let f = |s: &str| Some(s.as_bytes().to_vec());
        let fp = Fingerprint([7; 32]).to_hex();
        let mut fields = vec![
            f("done"),
            f(&fp),
            f("9007199254740993"),
            f("1"),
            f("2"),
            f("3"),
            None,
            f("201"),
            f(r#"[["location","/p/1"]]"#),
            Some(vec![0, 255]),
        ];
        let record = decode_record(&fields).expect("decodes").expect("exists");
        assert_eq!(record.token, FencingToken(9_007_199_254_740_993));
        assert_eq!(
            record.state,
            RecordState::Completed {
                response: StoredResponse {
                    status: 201,
                    headers: vec![("location".into(), "/p/1".into())],
                    body: bytes::Bytes::from_static(&[0, 255]),
                }
            }
        );
        assert_eq!(decode_record(&vec![None; 10]).expect("decodes"), None);
        fields[0] = f("inflight");
        let err = decode_record(&fields).expect_err("no lease");
        assert_eq!(err.kind(), crate::store::StoreErrorKind::Corrupt);
        fields[0] = f("weird");
        assert!(decode_record(&fields).is_err());
    }

    #[test]
    fn braces_in_the_prefix_are_refused() {
        let err = RedisStore::builder("redis://127.0.0.1:1")
            .prefix("a{b}")
            .prepare()
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidClientConfig);
    }
}
