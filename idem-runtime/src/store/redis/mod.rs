//! The Redis store: records shared by every instance of a service, kept by one Redis server.
//!
//! # Layout
//! One Redis string per record at `<prefix>:{<n>:<scope>:<key>}`, where `n` is the byte length of
//! the (escaped) scope, so that scopes and keys containing `:` can never meet, and `%`, `{` and `}`
//! are percent-escaped so that the braces are always the key's [hash tag]: every command and script
//! touches exactly one key, so each runs within one Redis Cluster slot.
//!
//! The value is a compact binary record (`blob.rs`): a fixed 75-byte header (layout version, state,
//! a `watched` flag, fencing token, created/expires/retain/lease times, fingerprint), followed, once
//! completed, by the status, headers and body. The fields the scripts check sit at fixed offsets, so
//! they check a token by slicing the value. Values in any other layout, including the hashes of the
//! layout before this one, are reported as corrupt and never overwritten.
//!
//! # Operations
//! Every operation on a record is one Lua script on the record's one key (sent as `EVALSHA`, and
//! loaded when the server answers `NOSCRIPT`; the scripts, with their KEYS, ARGV and replies
//! documented at the top, live next to this file). Every command is built at its final size, and
//! keys and responses are written straight into it: at high concurrency the client's allocations,
//! not the round trips, are what separates the store from plain commands.
//!
//! - **claim** is `claim.lua`: it reads the server's time and the record, and applies
//!   [`Claim::decide`] in the same step: writes a fresh in-flight record (with the key's TTL set to
//!   the retention), takes over or resumes the record (new token and lease, its times and TTL
//!   kept), or returns the record untouched, so a replay (or a mismatch, or "in flight") costs this
//!   one script.
//! - **complete** and **release** are `settle.lua`: it checks the token and the in-flight state,
//!   then appends the response to the header or turns the state byte to "released" (both keep the
//!   TTL and the record's times), and `PUBLISH`es the record's tag on `<prefix>:done` only if the
//!   record is watched.
//! - **renew** is `renew.lua`: the same check, then the lease field becomes the server's time plus
//!   the lease, overwritten in place (`SETRANGE`, which keeps the TTL).
//! - **announce_waiter** is `announce.lua`: sets the `watched` flag of an in-flight record, so that
//!   its completion publishes. See "Waking waiters across instances".
//! - **get** is `get.lua`: the value and the server's time of the read.
//!
//! The scripts need Redis 7.0 or later (Valkey 7.2 or later), which replicates a script's effects
//! rather than the script, so that a script may read `TIME` and then write.
//!
//! # Time is the server's
//! Every instant is set and judged by the Redis server's clock, read with `TIME` inside the script
//! that decides (see "Time is the store's" in [`crate::store`]): the engine sends durations, and
//! reads instants back with the server's time of the read. On a cluster each primary judges the
//! records it holds by its own clock; a record lives on one primary (and its replica, which takes
//! the primary's clock's place on failover: keep the nodes' clocks synchronised). A store given a
//! clock ([`RedisStoreBuilder::clock`]) passes that clock's time to the scripts instead, which is
//! how tests move time.
//!
//! # Expiry
//! A fresh claim sets the key's TTL to the retention, so Redis deletes the record by itself when
//! retention ends. Between `expires_at` and `retain_until` the record is a tombstone the engine
//! answers "expired" from. Records past retention by the server's time count as absent whether or
//! not Redis has deleted them yet (claim replaces them, get hides them).
//!
//! [`Purge`] is therefore rarely needed with Redis: it exists for when the TTL Redis applied and the
//! records' `retain_until` disagree (tests on a manual clock, a server clock that jumped). It walks
//! the store's keys with `SCAN MATCH <prefix>:{*` and deletes, one script per record (`purge.lua`,
//! which reads `retain_until` from the record's header and the time from the server), those whose
//! `retain_until` has passed, at most a batch per call; consecutive calls continue one pass over
//! the keyspace. That costs a scan of the database per sweep, in exchange for nothing on the
//! request path: an index such as a sorted set by `retain_until` would cost a write on every claim
//! and, being one key, would live in another Cluster slot than the records, so the claim could no
//! longer be one single-key script. If you run the [`Sweeper`](crate::sweeper::Sweeper) against
//! Redis at all, give it a long interval.
//!
//! # Operators
//! [`Store::forget`] is one script on the record's key (`forget.lua`: deleted only if it still has
//! the token and state it was read with). The operations over many records walk the keyspace of
//! every server that holds records (each primary of a cluster) with `SCAN`, one pipelined script per
//! key found: [`Store::erase_scope`] with `SCAN MATCH <prefix>:{<n>:<scope>:*` (the tag begins with
//! the scope's length and the scope, so the pattern matches that scope's keys and no other's) and
//! `erase.lua`; [`Store::list_in_flight`] and [`Store::stats`] with `peek.lua`, which reads each
//! record's header (a completed record's response is not read). There is no per-scope index: a set
//! per scope would be another key, in another hash slot than the scope's records (each record's
//! hash tag is its own key, so that records spread over a cluster), so keeping it in step with the
//! records would take a second command on every claim and purge, and could never be atomic with
//! them on a cluster; a scope's own hash tag would put a large tenant's records all on one node.
//! These are rare operator calls, so they pay a scan of the keyspace instead of every request
//! paying an index. Erased and forgotten records wake their waiters as completions do.
//!
//! # Waking waiters across instances
//! Each store keeps one pub/sub connection, subscribed to `<prefix>:done` by a background task that
//! wakes this process's waiters for each published tag. Every message reaches every instance, so only
//! records a duplicate waits for publish one: a waiting duplicate subscribes locally, then
//! [announces](Store::announce_waiter) itself (the record's `watched` flag), then reads the record
//! again before it sleeps. Redis runs scripts one at a time, so a completion either runs before the
//! announcement (the re-read sees the completed record) or after it (and publishes): no wake-up is
//! lost, and a completion nobody waits for costs no message. The task reconnects with backoff and pings
//! the server every 15 s to notice a dead connection; it stops when the store is dropped. A completion
//! published while this instance's subscription is down is missed, so whenever the task subscribes
//! it wakes every local waiter to re-read its record; while it cannot subscribe, waiters wake when the
//! lease runs out or their wait bound is reached (never a wrong answer, only a late one).
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
//! - **Failover.** By default writes are acknowledged by the primary alone: a claim or completion
//!   not yet replicated when a replica is promoted is lost, and its retry runs again.
//!   [`RedisStoreBuilder::wait_for_replicas`] closes that gap; see there what it guarantees.
//!
//! Within those limits the guarantee is the engine's: at most one execution per lease.
//!
//! # Redis Cluster
//! Every command and script touches one hash-tagged key, so the same records, commands and scripts
//! run on a Redis (or Valkey) Cluster: see `RedisClusterStore` (feature `redis-cluster`).
//!
//! [hash tag]: https://redis.io/docs/latest/operate/oss_and_stack/reference/cluster-spec/#hash-tags

use super::{
    Claim, ClaimOutcome, Claimed, Found, Listed, Purge, StateKind, Stats, Store, StoreError,
    Subscription, Waiters,
};
use crate::clock::{Clock, Timestamp};
use crate::record::{FencingToken, Record, RecordKey, RecordState, StoredResponse};
use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, PubSub};
use ::redis::{
    Client, Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, RedisWrite, Script,
    ToRedisArgs,
};
use futures_util::StreamExt;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::{watch, OnceCell};
use tokio::task::AbortHandle;

mod blob;

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

/// A [`Store`] on Redis, reached through `C`: one server ([`RedisStore`]) or a cluster
/// (`RedisClusterStore`). Records, commands and scripts are the same for both; only how a command
/// reaches its server, and which servers hold records, differ.
///
/// See the [module documentation](self) for the layout, the scripts and what each operation costs.
pub struct Redis<C: Connector> {
    link: C,
    records: Records,
    subscriber: Subscriber,
}

/// A [`Store`] on one Redis server, shared by every instance of a service that uses the same server
/// and prefix.
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
pub type RedisStore = Redis<Server>;

/// How a [`Redis`] store reaches one server: a connection manager, connected on first use.
pub struct Server {
    client: Client,
    config: ConnectionManagerConfig,
    conn: OnceCell<ConnectionManager>,
    /// Where the current purge pass over the keyspace stands (0: start a new pass).
    scan_cursor: Mutex<u64>,
}

/// How a [`Redis`] store reaches the servers that hold its records: [`Server`] or, with the
/// `redis-cluster` feature, `Cluster`. Implemented in this crate only.
pub trait Connector: sealed::Sealed + Send + Sync + 'static {
    /// A connection that sends each command to the server of its key.
    #[doc(hidden)]
    type Conn: ConnectionLike + Send;
    /// A connection to one server that holds records.
    #[doc(hidden)]
    type Node: ConnectionLike + Send;
    /// The `store` label of idem's metrics.
    #[doc(hidden)]
    const KIND: &'static str;
    /// A connection, connecting first if needed.
    #[doc(hidden)]
    fn conn(&self) -> impl Future<Output = Result<Self::Conn, StoreError>> + Send;
    /// A connection to each server that holds records, for the operations that walk them all.
    #[doc(hidden)]
    fn nodes(&self) -> impl Future<Output = Result<Vec<Self::Node>, StoreError>> + Send;
}

mod sealed {
    /// Keeps [`Connector`](super::Connector) to this crate.
    pub trait Sealed {}
    impl Sealed for super::Server {}
    #[cfg(feature = "redis-cluster")]
    impl Sealed for super::Cluster {}
}

impl Connector for Server {
    type Conn = ConnectionManager;
    type Node = ConnectionManager;
    const KIND: &'static str = "redis";

    async fn conn(&self) -> Result<ConnectionManager, StoreError> {
        if let Some(conn) = self.conn.get() {
            return Ok(conn.clone());
        }
        // Boxed: connecting is a large future, and inlined it would make every operation's
        // future (which the store trait boxes and moves) kilobytes larger.
        Box::pin(self.conn.get_or_try_init(|| {
            ConnectionManager::new_with_config(self.client.clone(), self.config.clone())
        }))
        .await
        .cloned()
        .map_err(StoreError::unavailable)
    }

    async fn nodes(&self) -> Result<Vec<ConnectionManager>, StoreError> {
        Ok(vec![self.conn().await?])
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("server", &self.link.client.get_connection_info().addr)
            .field("prefix", &self.records.prefix)
            .field("connected", &self.link.conn.initialized())
            .field("subscribed", &self.is_subscribed())
            .finish_non_exhaustive()
    }
}

/// Configures and connects a [`RedisStore`] (from [`RedisStore::builder`]) or, with the
/// `redis-cluster` feature, a `RedisClusterStore` (from `RedisClusterStore::builder`).
#[derive(Debug)]
pub struct RedisStoreBuilder<S = RedisStore> {
    nodes: Vec<String>,
    prefix: String,
    connection_timeout: Duration,
    response_timeout: Duration,
    reconnect_retries: usize,
    durability: Option<Durability>,
    clock: Option<Arc<dyn Clock>>,
    store: PhantomData<fn() -> S>,
}

impl<S> Clone for RedisStoreBuilder<S> {
    fn clone(&self) -> Self {
        Self {
            nodes: self.nodes.clone(),
            prefix: self.prefix.clone(),
            durability: self.durability,
            clock: self.clock.clone(),
            store: PhantomData,
            ..*self
        }
    }
}

/// `WAIT <replicas> <timeout>` after each claim and completion.
#[derive(Debug, Clone, Copy)]
struct Durability {
    replicas: u32,
    timeout_ms: u64,
}

impl<S> RedisStoreBuilder<S> {
    fn new(nodes: Vec<String>) -> Self {
        Self {
            nodes,
            prefix: "idem".to_owned(),
            connection_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(2),
            reconnect_retries: 0,
            durability: None,
            clock: None,
            store: PhantomData,
        }
    }

    /// Judges every time by `clock` instead of the server's `TIME` (tests move a
    /// [`ManualClock`](crate::clock::ManualClock) to expire keys and leases). Every instance that
    /// shares the records must then use the same clock: it is passed to each script in place of
    /// the server's. Not for production, where the server's clock is what lets instances whose
    /// clocks disagree agree on who owns a key.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

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

    /// Makes claims and completions survive the failover of their primary (default: off): each
    /// claim and completion is followed, on the same connection, by `WAIT <replicas> <timeout>`,
    /// and counts as done only once that many replicas confirmed it. Unconfirmed in time, it fails
    /// as [unavailable](super::StoreErrorKind::Unavailable): a claim then never runs its handler
    /// (a retry finds the claim in flight, or nothing if it was lost, and runs once its lease has
    /// run out), and the engine keeps trying a completion until it lands. So with one replica per
    /// primary and `replicas` = 1, a primary that dies does not lose an acknowledged claim or
    /// completion: the replica that confirmed it is the only one that can take over.
    ///
    /// What it does not cover: with several replicas, failover may promote one that had not
    /// confirmed (ask for as many as there are); releases, renewals and announcements are not
    /// waited for (a lost release leaves the key to its lease; a lost renewal shortens a lease by
    /// at most a third); `WAIT` counts replicas that received the write, not ones that persisted
    /// it; and while a primary has fewer live replicas than `replicas`, every claim on it fails.
    /// Replays pay the wait too: the claim that finds a completed record is the same command.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), idem_runtime::redis::RedisError> {
    /// use idem_runtime::store::redis::RedisStore;
    /// use std::time::Duration;
    /// let store = RedisStore::builder("redis://127.0.0.1:6379")
    ///     .wait_for_replicas(1, Duration::from_millis(200))
    ///     .connect()
    ///     .await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.durability = (replicas > 0).then(|| Durability {
            replicas,
            // `WAIT … 0` would block for ever.
            timeout_ms: u64::try_from(timeout.as_millis())
                .unwrap_or(u64::MAX)
                .max(1),
        });
        self
    }

    fn records(&self) -> RedisResult<Records> {
        if self.prefix.contains(['{', '}']) {
            return Err(RedisError::from((
                ErrorKind::InvalidClientConfig,
                "the Redis store prefix may not contain '{' or '}'",
                self.prefix.clone(),
            )));
        }
        Ok(Records {
            prefix: self.prefix.clone(),
            scripts: Scripts::new(),
            waiters: Arc::new(Waiters::new()),
            durability: self.durability,
            clock: self.clock.clone(),
        })
    }

    /// Starts the pub/sub task on `clients`, tried in turn, starting with `pubsub` if given.
    fn subscriber(
        &self,
        records: &Records,
        clients: Vec<Client>,
        pubsub: Option<PubSub>,
    ) -> Subscriber {
        let (state, subscribed) = watch::channel(pubsub.is_some());
        let listener = Listener {
            clients,
            channel: channel_name(&self.prefix),
            waiters: records.waiters.clone(),
            state,
            connection_timeout: self.connection_timeout,
            response_timeout: self.response_timeout,
        };
        Subscriber {
            task: tokio::spawn(listen(listener, pubsub)).abort_handle(),
            subscribed,
        }
    }
}

/// Fails outside a Tokio runtime (a lazy store spawns its listener at once).
fn runtime_present() -> RedisResult<()> {
    tokio::runtime::Handle::try_current()
        .map(drop)
        .map_err(|e| {
            RedisError::from((
                ErrorKind::ClientError,
                "the Redis store needs a Tokio runtime",
                e.to_string(),
            ))
        })
}

impl RedisStoreBuilder<RedisStore> {
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
        warn_if_evicting(&mut conn.clone()).await;
        self.assemble(client, config, Some(conn), Some(pubsub))
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
        runtime_present()?;
        self.assemble(client, config, None, None)
    }

    fn prepare(&self) -> RedisResult<(Client, ConnectionManagerConfig)> {
        self.records()?;
        let client = Client::open(self.nodes[0].as_str())?;
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
    ) -> RedisResult<RedisStore> {
        let records = self.records()?;
        Ok(Redis {
            subscriber: self.subscriber(&records, vec![client.clone()], pubsub),
            link: Server {
                client,
                config,
                conn: OnceCell::new_with(conn),
                scan_cursor: Mutex::new(0),
            },
            records,
        })
    }
}

impl Redis<Server> {
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
        RedisStoreBuilder::new(vec![url.into()])
    }
}

impl<C: Connector> Redis<C> {
    /// The prefix of this store's keys and channel.
    pub fn prefix(&self) -> &str {
        &self.records.prefix
    }

    /// Whether this store is subscribed, right now, to the completions other instances publish. While
    /// it is not (Redis unreachable, or the subscription reconnecting), this instance's waiters are
    /// woken only by its own completions, and otherwise at the lease end or their wait bound. For
    /// health checks and tests.
    pub fn is_subscribed(&self) -> bool {
        self.subscriber.is_subscribed()
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
        self.subscriber.wait_for(subscribed).await
    }

    /// The Redis key of `key`'s record: `<prefix>:{<tag>}`.
    pub fn redis_key(&self, key: &RecordKey) -> String {
        self.records.redis_key(key)
    }
}

/// The store's pub/sub task, and whether it is subscribed right now. Dropping it stops the task.
struct Subscriber {
    task: AbortHandle,
    subscribed: watch::Receiver<bool>,
}

impl Subscriber {
    fn is_subscribed(&self) -> bool {
        *self.subscribed.borrow()
    }

    async fn wait_for(&self, subscribed: bool) {
        let mut state = self.subscribed.clone();
        // The listener lives as long as the store, so the sender is never dropped while we wait.
        let _ = state.wait_for(|now| *now == subscribed).await;
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What both Redis stores share: the key layout, the scripts, the local waiters, and each
/// operation, sent on a connection to one server or to a cluster (which routes each command by
/// its one key).
struct Records {
    prefix: String,
    scripts: Scripts,
    waiters: Arc<Waiters>,
    durability: Option<Durability>,
    /// The clock the store judges time by instead of the server's `TIME` (tests move it).
    clock: Option<Arc<dyn Clock>>,
}

/// A Lua script: its hash for `EVALSHA`, and its code for `EVAL` on a server that lacks it.
struct Lua {
    script: Script,
    code: &'static str,
}

impl Lua {
    fn new(code: &'static str) -> Self {
        Self {
            script: Script::new(code),
            code,
        }
    }
}

struct Scripts {
    claim: Lua,
    get: Lua,
    settle: Lua,
    renew: Lua,
    announce: Lua,
    purge: Lua,
    forget: Lua,
    erase: Lua,
    peek: Lua,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Lua::new(include_str!("claim.lua")),
            get: Lua::new(include_str!("get.lua")),
            settle: Lua::new(include_str!("settle.lua")),
            renew: Lua::new(include_str!("renew.lua")),
            announce: Lua::new(include_str!("announce.lua")),
            purge: Lua::new(include_str!("purge.lua")),
            forget: Lua::new(include_str!("forget.lua")),
            erase: Lua::new(include_str!("erase.lua")),
            peek: Lua::new(include_str!("peek.lua")),
        }
    }
}

impl Records {
    /// The time the scripts judge by: the given clock's now, or the server's.
    fn script_now(&self) -> ScriptNow {
        ScriptNow(self.clock.as_ref().map(|clock| clock.now()))
    }

    fn key<'a>(&'a self, key: &'a RecordKey) -> RedisKey<'a> {
        RedisKey {
            prefix: &self.prefix,
            key,
        }
    }

    fn redis_key(&self, key: &RecordKey) -> String {
        let key = self.key(key);
        let mut out = String::with_capacity(key.max_len());
        // Writing to a String cannot fail.
        let _ = fmt::Write::write_fmt(&mut out, format_args!("{key}"));
        out
    }

    /// Sends `cmd`, followed on the same connection by `WAIT` if `durable` and the store waits for
    /// replicas. Returns the reply and whether the write is as durable as asked (always, without
    /// `WAIT`): the caller decides, from the reply, whether a write happened at all.
    async fn send<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        cmd: Cmd,
        durable: bool,
    ) -> RedisResult<(T, bool)> {
        match self.durability.filter(|_| durable) {
            None => Ok((cmd.query_async(conn).await?, true)),
            Some(Durability {
                replicas,
                timeout_ms,
            }) => {
                let mut pipe = ::redis::Pipeline::with_capacity(2);
                pipe.add_command(cmd)
                    .cmd("WAIT")
                    .arg(replicas)
                    .arg(timeout_ms);
                let (reply, acked): (T, u32) = pipe.query_async(conn).await?;
                Ok((reply, acked >= replicas))
            }
        }
    }

    /// Runs `lua` on `key` with the arguments `args` appends (`bytes` bytes in all): as `EVALSHA`,
    /// or, on a server that does not know the script (restarted, flushed, or a cluster node that
    /// never ran it), as `EVAL`, which also caches it there. The command is built at its final size.
    async fn eval<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        lua: &Lua,
        key: RedisKey<'_>,
        (count, bytes): (usize, usize),
        args: impl Fn(&mut Cmd),
        durable: bool,
    ) -> Result<(T, bool), StoreError> {
        let build = |code: bool| {
            let body = if code {
                lua.code
            } else {
                lua.script.get_hash()
            };
            let mut cmd = Cmd::with_capacity(4 + count, 32 + body.len() + key.max_len() + bytes);
            cmd.arg(if code { "EVAL" } else { "EVALSHA" })
                .arg(body)
                .arg(1)
                .arg(key);
            args(&mut cmd);
            cmd
        };
        match self.send(conn, build(false), durable).await {
            Err(e) if e.kind() == ErrorKind::NoScriptError => {
                Box::pin(self.send(conn, build(true), durable)).await
            }
            found => found,
        }
        .map_err(redis_error)
    }

    /// Applies [`Claim::decide`] at the store's time in one script (`claim.lua`): inserts, takes
    /// over, resumes, or returns the record found, unchanged.
    async fn claim<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        claim: &Claim<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        let key = self.key(claim.key);
        let token = blob::token(claim.token);
        let now = self.script_now();
        let retain = claim.retain.max(claim.ttl);
        let args = |cmd: &mut Cmd| {
            cmd.arg(&token[..])
                .arg(&claim.fingerprint.0[..])
                .arg(millis(claim.lease))
                .arg(millis(claim.ttl))
                .arg(millis(retain))
                .arg(now);
        };
        let ((rule, now, value), durable): ((i64, i64, Vec<u8>), bool) = self
            .eval(
                conn,
                &self.scripts.claim,
                key,
                (6, 8 + 32 + 3 * 20 + 20),
                args,
                true,
            )
            .await?;
        let now = Timestamp::from_millis(now);
        let record = blob::decode(value)?;
        let taken_over = match rule {
            KEPT => return Ok(ClaimOutcome::Existing(Found { record, now })),
            INSERTED | RESUMED => false,
            TAKEN_OVER => true,
            // A cluster client resent the script after a lost reply: the first one won. A fresh
            // record's lease ends exactly one lease after its creation.
            RESENT => !matches!(record.state, RecordState::InFlight { lease_until }
                if lease_until == record.created_at + claim.lease),
            other => {
                return Err(StoreError::corrupt(format!(
                    "claim.lua answered the unknown rule {other}"
                )))
            }
        };
        confirmed(durable)?;
        Ok(ClaimOutcome::Claimed(Claimed {
            taken_over,
            created_at: record.created_at,
            expires_at: record.expires_at,
        }))
    }

    /// Completes the claim with `response`, or releases it when `None` (`settle.lua`). Only a
    /// completion waits for replicas.
    async fn settle<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
        token: FencingToken,
        response: Option<&StoredResponse>,
    ) -> Result<(), StoreError> {
        let tail = response.map(blob::Response::new).transpose()?;
        let args = |cmd: &mut Cmd| {
            cmd.arg(&blob::token(token)[..]);
            if let Some(tail) = tail {
                cmd.arg(tail);
            }
        };
        let sizes = (
            1 + usize::from(tail.is_some()),
            8 + tail.map_or(0, |t| t.len()),
        );
        let completing = response.is_some();
        let (reply, durable) = self
            .eval(
                conn,
                &self.scripts.settle,
                self.key(key),
                sizes,
                args,
                completing,
            )
            .await?;
        applied_or_fenced(reply)?;
        confirmed(durable)?;
        self.waiters.notify(key);
        Ok(())
    }

    async fn renew<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let now = self.script_now();
        let args = |cmd: &mut Cmd| {
            cmd.arg(&blob::token(token)[..]).arg(millis(lease)).arg(now);
        };
        let (reply, _) = self
            .eval(
                conn,
                &self.scripts.renew,
                self.key(key),
                (3, 8 + 40),
                args,
                false,
            )
            .await?;
        applied_or_fenced(reply)
    }

    /// The record, unless past retention, with the store's time of the read (`get.lua`).
    async fn get<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
    ) -> Result<Option<Found>, StoreError> {
        let now = self.script_now();
        let ((now, found), _): ((i64, Option<Vec<u8>>), bool) = self
            .eval(
                conn,
                &self.scripts.get,
                self.key(key),
                (1, 20),
                |cmd| {
                    cmd.arg(now);
                },
                false,
            )
            .await?;
        let now = Timestamp::from_millis(now);
        match found {
            Some(found) => Ok(Some(blob::decode(found)?)
                .filter(|r| !r.is_forgotten(now))
                .map(|record| Found { record, now })),
            None => Ok(None),
        }
    }

    /// Deletes the record if it still carries `token` in a state of kind `state` (`forget.lua`),
    /// and wakes its waiters here (the script publishes to the other instances).
    async fn forget<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        let args = |cmd: &mut Cmd| {
            cmd.arg(&blob::token(token)[..]).arg(blob::state(state));
        };
        let (deleted, _): (i64, bool) = self
            .eval(
                conn,
                &self.scripts.forget,
                self.key(key),
                (2, 9),
                args,
                false,
            )
            .await?;
        if deleted == 1 {
            self.waiters.notify(key);
        }
        Ok(deleted == 1)
    }

    async fn announce<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        key: &RecordKey,
    ) -> Result<(), StoreError> {
        let announce = &self.scripts.announce;
        let _marked: (i64, bool) = self
            .eval(conn, announce, self.key(key), (0, 0), |_| {}, false)
            .await?;
        Ok(())
    }

    /// Continues the `SCAN` pass at `cursor` over the store's keys on the server `conn` talks to,
    /// deleting records past retention at the store's time: at most `budget` records, in at most
    /// `steps` `SCAN` steps. Returns how many it deleted, the cursor to resume at (`None`: the pass
    /// is over) and the steps left.
    async fn purge<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        mut cursor: u64,
        budget: u64,
        mut steps: usize,
    ) -> Result<(u64, Option<u64>, usize), StoreError> {
        let pattern = self.pattern(None);
        let mut deleted = 0u64;
        loop {
            steps = steps.saturating_sub(1);
            let (next, keys) = scan(conn, cursor, &pattern).await?;
            let mut done = 0;
            while done < keys.len() && deleted < budget {
                let take = usize::try_from(budget - deleted)
                    .unwrap_or(usize::MAX)
                    .min(keys.len() - done);
                let purged: Vec<i64> = self
                    .each(conn, &self.scripts.purge, &keys[done..done + take])
                    .await?;
                deleted += purged.iter().filter(|&&d| d == 1).count() as u64;
                done += take;
            }
            // SCAN cursors are stateless on the server: stopping inside a page means scanning that
            // page again next time (its deleted keys are gone), so nothing is skipped.
            if done == keys.len() && next == 0 {
                return Ok((deleted, None, steps));
            }
            cursor = if done < keys.len() { cursor } else { next };
            if deleted >= budget || steps == 0 {
                return Ok((deleted, Some(cursor), steps));
            }
        }
    }

    /// Runs `lua` once per key of `keys` (one pipelined round trip), with the store's time as its
    /// only argument for the scripts that take one; the replies in order.
    async fn each<T: FromRedisValue, C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        lua: &Lua,
        keys: &[Vec<u8>],
    ) -> Result<Vec<T>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let now = self.script_now();
        let mut pipe = ::redis::pipe();
        pipe.load_script(&lua.script).ignore();
        for key in keys {
            pipe.invoke_script(lua.script.key(key).arg(now));
        }
        pipe.query_async(conn).await.map_err(redis_error)
    }

    /// The `SCAN MATCH` pattern of every record, or of `scope`'s (as stored): the tag starts with
    /// the scope's length and the escaped scope, so the pattern matches that scope's keys and no
    /// other's.
    fn pattern(&self, scope: Option<&str>) -> String {
        let mut pattern = format!("{}:{{", glob_escape(&self.prefix));
        if let Some(scope) = scope {
            let mut head = format!("{}:", escaped_len(scope));
            // Writing to a String cannot fail.
            let _ = escape(scope, &mut head);
            head.push(':');
            pattern.push_str(&glob_escape(&head));
        }
        pattern.push('*');
        pattern
    }

    /// The record key a Redis key of this store names.
    fn record_key(&self, redis_key: &[u8]) -> Option<RecordKey> {
        let tag = redis_key
            .strip_prefix(self.prefix.as_bytes())?
            .strip_prefix(b":{")?
            .strip_suffix(b"}")?;
        decode_tag(tag)
    }

    /// Deletes at most `budget` records of the scope whose keys match `pattern`, in one whole
    /// `SCAN` pass over the server `conn` talks to (`erase.lua`), waking their waiters; returns how
    /// many. Less than `budget` means the pass found no more.
    async fn erase<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        pattern: &str,
        budget: u64,
    ) -> Result<u64, StoreError> {
        let (mut cursor, mut erased) = (0, 0u64);
        while erased < budget {
            let (next, mut keys) = scan(conn, cursor, pattern).await?;
            keys.truncate(usize::try_from(budget - erased).unwrap_or(usize::MAX));
            let deleted: Vec<i64> = self.each(conn, &self.scripts.erase, &keys).await?;
            for (key, _) in keys.iter().zip(&deleted).filter(|(_, &d)| d == 1) {
                erased += 1;
                if let Some(key) = self.record_key(key) {
                    self.waiters.notify(&key);
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        Ok(erased)
    }

    /// Reads the header of every record on the server `conn` talks to (`SCAN`, then `peek.lua` per
    /// key), handing each page's records, decoded without their responses, to `page` with the
    /// server's time read before the pass, which judges them; returns that time. Keys that hold no
    /// record are skipped.
    async fn scan_records<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        mut page: impl FnMut(Timestamp, Vec<(RecordKey, Record)>) + Send,
    ) -> Result<Timestamp, StoreError> {
        let now = match self.clock.as_ref() {
            Some(clock) => clock.now(),
            None => {
                let (secs, micros): (i64, i64) = ::redis::cmd("TIME")
                    .query_async(conn)
                    .await
                    .map_err(redis_error)?;
                Timestamp::from_millis(secs.saturating_mul(1000).saturating_add(micros / 1000))
            }
        };
        let pattern = self.pattern(None);
        let mut cursor = 0;
        loop {
            let (next, keys) = scan(conn, cursor, &pattern).await?;
            let headers: Vec<Option<Vec<u8>>> = self.each(conn, &self.scripts.peek, &keys).await?;
            let records = keys
                .iter()
                .zip(headers)
                .filter_map(|(key, header)| {
                    let record = blob::summary(header?).ok()?;
                    Some((self.record_key(key)?, record))
                })
                .collect();
            page(now, records);
            if next == 0 {
                return Ok(now);
            }
            cursor = next;
        }
    }
}

/// One `SCAN` step over the keys matching `pattern`: the next cursor (0: the pass is over) and the
/// keys.
async fn scan<C: ConnectionLike + Send>(
    conn: &mut C,
    cursor: u64,
    pattern: &str,
) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
    ::redis::cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_COUNT)
        .query_async(conn)
        .await
        .map_err(redis_error)
}

/// A duration as whole milliseconds for the scripts, at most [`MAX_TTL_MS`] (Redis refuses expiry
/// times that overflow its clock, and Lua's numbers are exact only below 2^53).
fn millis(duration: Duration) -> i64 {
    i64::try_from(duration.as_millis())
        .unwrap_or(i64::MAX)
        .min(MAX_TTL_MS)
}

/// `claim.lua`'s rules: what the claim did.
const KEPT: i64 = 0;
const INSERTED: i64 = 1;
const TAKEN_OVER: i64 = 2;
const RESUMED: i64 = 3;
const RESENT: i64 = 4;

/// The scripts' time argument: the clock the store was given, or empty for the server's `TIME`.
#[derive(Clone, Copy)]
struct ScriptNow(Option<Timestamp>);

impl ToRedisArgs for ScriptNow {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        match self.0 {
            Some(now) => now.as_millis().write_redis_args(out),
            None => "".write_redis_args(out),
        }
    }
}

/// A write `WAIT` did not confirm fails as unavailable: the caller must not count on it.
fn confirmed(durable: bool) -> Result<(), StoreError> {
    if durable {
        Ok(())
    } else {
        Err(StoreError::unavailable(
            "the write was not confirmed by the replicas asked for in time (WAIT)",
        ))
    }
}

/// Every operation is one script or command (see the [module documentation](self)), sent on the
/// connection `C` gives.
#[async_trait::async_trait]
impl<C: Connector> Store for Redis<C> {
    fn kind(&self) -> &'static str {
        C::KIND
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimOutcome, StoreError> {
        self.records
            .claim(&mut self.link.conn().await?, claim)
            .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let mut conn = self.link.conn().await?;
        self.records
            .settle(&mut conn, key, token, Some(response))
            .await
    }

    async fn release(&self, key: &RecordKey, token: FencingToken) -> Result<(), StoreError> {
        self.records
            .settle(&mut self.link.conn().await?, key, token, None)
            .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.link.conn().await?;
        self.records.renew(&mut conn, key, token, lease).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Found>, StoreError> {
        self.records.get(&mut self.link.conn().await?, key).await
    }

    fn subscribe(&self, key: &RecordKey) -> Subscription {
        self.records.waiters.subscribe(key)
    }

    /// Marks the record watched if it is in flight (`announce.lua`), so that its
    /// completion or release publishes its tag to every instance; does nothing otherwise.
    async fn announce_waiter(&self, key: &RecordKey) -> Result<(), StoreError> {
        self.records
            .announce(&mut self.link.conn().await?, key)
            .await
    }

    async fn forget(
        &self,
        key: &RecordKey,
        token: FencingToken,
        state: StateKind,
    ) -> Result<bool, StoreError> {
        let mut conn = self.link.conn().await?;
        self.records.forget(&mut conn, key, token, state).await
    }

    /// Walks the keys of `scope` with `SCAN MATCH` on each server (see "Operators" in the
    /// [module documentation](self)), from the start on every call.
    async fn erase_scope(&self, scope: &str, batch: usize) -> Result<u64, StoreError> {
        let pattern = self.records.pattern(Some(scope));
        let budget = batch as u64;
        let mut erased = 0;
        for mut node in self.link.nodes().await? {
            if erased >= budget {
                break;
            }
            erased += self
                .records
                .erase(&mut node, &pattern, budget - erased)
                .await?;
        }
        Ok(erased)
    }

    /// Reads every record's header on each server; each server's records are judged by
    /// its own time, and the time returned is the latest of them.
    async fn list_in_flight(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> Result<(Vec<Listed>, Timestamp), StoreError> {
        let mut listed = Vec::new();
        let mut latest = None;
        for mut node in self.link.nodes().await? {
            let now = self
                .records
                .scan_records(&mut node, |now, page| {
                    listed.extend(
                        page.into_iter()
                            .filter(|(_, r)| {
                                matches!(r.state, RecordState::InFlight { .. })
                                    && !r.is_forgotten(now)
                                    && r.created_at.until(now) >= older_than
                            })
                            .map(|(key, record)| Listed { key, record }),
                    )
                })
                .await?;
            latest = latest.max(Some(now));
        }
        listed.sort_by(|a, b| (a.record.created_at, &a.key).cmp(&(b.record.created_at, &b.key)));
        listed.truncate(limit);
        Ok((listed, latest.ok_or_else(no_server)?))
    }

    /// Counts every record's header on each server, by [`Stats::count`] at that server's
    /// time; `now` is the latest of them.
    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut total: Option<Stats> = None;
        for mut node in self.link.nodes().await? {
            let mut counted = None;
            let now = self
                .records
                .scan_records(&mut node, |now, page| {
                    let part = Stats::count(page.iter().map(|(_, r)| r), now);
                    counted = Some(add(counted.take(), part));
                })
                .await?;
            let counted = counted.unwrap_or(Stats {
                now,
                ..Stats::default()
            });
            total = Some(add(total.take(), counted));
        }
        total.ok_or_else(no_server)
    }
}

/// No server answered for the records (a cluster without a primary serving slots).
fn no_server() -> StoreError {
    StoreError::unavailable("no Redis server serves the store's records")
}

/// The counts `a` (if any: of the pages or servers counted so far) and `b` together.
fn add(a: Option<Stats>, b: Stats) -> Stats {
    let Some(a) = a else {
        return b;
    };
    let oldest_in_flight = match (a.oldest_in_flight, b.oldest_in_flight) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    Stats {
        in_flight: a.in_flight + b.in_flight,
        completed: a.completed + b.completed,
        released: a.released + b.released,
        expired: a.expired + b.expired,
        forgotten: a.forgotten + b.forgotten,
        oldest_in_flight,
        now: a.now.max(b.now),
    }
}

#[cfg(feature = "redis-cluster")]
mod cluster;
#[cfg(feature = "redis-cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-cluster")))]
pub use cluster::{Cluster, RedisClusterStore};

/// `settle.lua` and `renew.lua` answer 1 (applied), 0 (not this claim's record) or -1 (not a
/// record at all).
fn applied_or_fenced(reply: i64) -> Result<(), StoreError> {
    match reply {
        1 => Ok(()),
        0 => Err(StoreError::fenced()),
        _ => Err(StoreError::corrupt(
            "the key holds a value that is not an idempotency record",
        )),
    }
}

#[async_trait::async_trait]
impl Purge for Redis<Server> {
    /// Deletes at most `batch` records past retention at the store's time, continuing one `SCAN` pass over the
    /// store's keys across calls. A call stops at the end of the pass or after 64 `SCAN` steps, and
    /// may then return fewer than `batch`, which ends a [`Sweeper`](crate::sweeper::Sweeper) sweep; the
    /// next sweep continues the pass. See the [module documentation](self).
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let mut conn = self.link.conn().await?;
        let cursor = *self
            .link
            .scan_cursor
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (deleted, cursor, _) = self
            .records
            .purge(&mut conn, cursor, batch as u64, SCAN_STEPS_PER_CALL)
            .await?;
        *self
            .link
            .scan_cursor
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = cursor.unwrap_or(0);
        Ok(deleted)
    }
}

/// Warns when the server may evict records. Managed services often refuse `CONFIG`: then say nothing.
async fn warn_if_evicting<C: ConnectionLike + Send>(conn: &mut C) {
    let policy: RedisResult<Vec<String>> = ::redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(conn)
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

/// The record and tag codecs, for the fuzz targets in `fuzz/` only: compiled under `cargo fuzz`
/// (which sets `--cfg fuzzing`), never in a normal build.
#[cfg(fuzzing)]
#[doc(hidden)]
#[allow(missing_docs)]
pub mod fuzzing {
    use crate::{Record, RecordKey, StoreError};

    /// Decodes a stored record value (what `GET` returns).
    pub fn decode_record(value: &[u8]) -> Result<Record, StoreError> {
        super::blob::decode(value.to_vec())
    }

    /// Encodes a record as the store writes it.
    pub fn encode_record(record: &Record) -> Result<Vec<u8>, StoreError> {
        super::blob::encode(record)
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

/// Redis errors are outages, except a key holding another type than a string (someone else wrote it,
/// or an earlier layout's hash).
fn redis_error(e: RedisError) -> StoreError {
    if e.code() == Some("WRONGTYPE") {
        StoreError::corrupt(e)
    } else {
        StoreError::unavailable(e)
    }
}

fn escape(s: &str, out: &mut impl fmt::Write) -> fmt::Result {
    let mut rest = s;
    while let Some(at) = rest.find(['%', '{', '}']) {
        out.write_str(&rest[..at])?;
        out.write_str(match rest.as_bytes()[at] {
            b'%' => "%25",
            b'{' => "%7B",
            _ => "%7D",
        })?;
        rest = &rest[at + 1..];
    }
    out.write_str(rest)
}

/// The length of `s` escaped: each of `%`, `{`, `}` becomes three bytes.
fn escaped_len(s: &str) -> usize {
    s.len()
        + 2 * s
            .bytes()
            .filter(|b| matches!(b, b'%' | b'{' | b'}'))
            .count()
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
/// brace-free, and the message published on completion. The store writes it inside keys
/// ([`RedisKey`]); as a string of its own it serves the tests and the fuzz target.
#[cfg(any(test, fuzzing))]
fn encode_tag(key: &RecordKey) -> String {
    let mut out = String::with_capacity(tag_len(key));
    // Writing to a String cannot fail.
    let _ = write_tag(key, &mut out);
    out
}

/// An upper bound of the tag's length ([`write_tag`]), so that keys are built in one allocation.
fn tag_len(key: &RecordKey) -> usize {
    // At most 20 digits for the length and a colon, then the escaped scope, a colon, the escaped key.
    21 + escaped_len(key.scope()) + 1 + escaped_len(key.key())
}

fn write_tag(key: &RecordKey, out: &mut impl fmt::Write) -> fmt::Result {
    write!(out, "{}:", escaped_len(key.scope()))?;
    escape(key.scope(), out)?;
    out.write_char(':')?;
    escape(key.key(), out)
}

/// A record's Redis key, `<prefix>:{<tag>}`, written straight into the command that sends it.
#[derive(Clone, Copy)]
struct RedisKey<'a> {
    prefix: &'a str,
    key: &'a RecordKey,
}

impl RedisKey<'_> {
    /// An upper bound of the key's length.
    fn max_len(&self) -> usize {
        self.prefix.len() + 3 + tag_len(self.key)
    }
}

impl fmt::Display for RedisKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.prefix)?;
        f.write_str(":{")?;
        write_tag(self.key, f)?;
        f.write_str("}")
    }
}

impl ToRedisArgs for RedisKey<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        out.write_arg_fmt(self);
    }
}

fn decode_tag(tag: &[u8]) -> Option<RecordKey> {
    let tag = std::str::from_utf8(tag).ok()?;
    let (len, rest) = tag.split_once(':')?;
    let len: usize = len.parse().ok()?;
    let scope = rest.get(..len)?;
    let key = rest.get(len..)?.strip_prefix(':')?;
    Some(RecordKey::stored(unescape(scope)?, unescape(key)?))
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
    /// The servers to subscribe on, tried in turn (a cluster's every node receives every message).
    clients: Vec<Client>,
    channel: String,
    waiters: Arc<Waiters>,
    state: watch::Sender<bool>,
    connection_timeout: Duration,
    response_timeout: Duration,
}

/// The store's pub/sub task: wakes local waiters for every tag published on the channel, and
/// reconnects with backoff, to the next server, whenever the connection fails. Runs until the
/// store aborts it.
async fn listen(l: Listener, mut initial: Option<PubSub>) {
    let channel = &l.channel;
    let mut backoff = MIN_BACKOFF;
    for client in l.clients.iter().cycle() {
        let pubsub = match initial.take() {
            Some(pubsub) => pubsub,
            None => match subscribe(client, channel, l.connection_timeout).await {
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
        // Completions published while we were not subscribed are lost: every local waiter re-reads
        // its record (and waits again if it is still in flight), as PostgreSQL's listener does.
        l.waiters.notify_all();
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
            // Parts bounded to their head and hash come back as they were stored.
            RecordKey::new("s".repeat(3000), "k".repeat(300)),
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
    fn keys_are_the_prefix_and_the_tag_in_braces() {
        for key in [
            RecordKey::new("user-1", "order-42"),
            RecordKey::new("{x}", "}{%"),
            RecordKey::new("한글", ""),
        ] {
            let redis_key = RedisKey {
                prefix: "idem",
                key: &key,
            };
            let written = redis_key.to_string();
            assert_eq!(written, format!("idem:{{{}}}", encode_tag(&key)));
            assert!(written.len() <= redis_key.max_len(), "{written}");
        }
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
    fn braces_in_the_prefix_are_refused() {
        let err = RedisStore::builder("redis://127.0.0.1:1")
            .prefix("a{b}")
            .prepare()
            .expect_err("refused");
        assert_eq!(err.kind(), ErrorKind::InvalidClientConfig);
    }
}
