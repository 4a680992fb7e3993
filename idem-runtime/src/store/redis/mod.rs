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
mod keys;
mod listen;
mod records;

use keys::*;
use listen::*;
use records::*;

/// The longest TTL set on a record (100 years): Redis refuses expiry times that overflow its clock.
const MAX_TTL_MS: i64 = 100 * 365 * 24 * 3600 * 1000;

/// How many keys one `SCAN` step asks for while purging.
const SCAN_COUNT: usize = 256;

/// How many `SCAN` steps one purge call takes at most, so that every call is short; the next call
/// continues where it stopped.
const SCAN_STEPS_PER_CALL: usize = 64;

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
        super::keys::encode_tag(key)
    }

    pub fn decode_tag(tag: &[u8]) -> Option<RecordKey> {
        super::keys::decode_tag(tag)
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
