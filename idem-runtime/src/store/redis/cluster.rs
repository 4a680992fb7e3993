//! The Redis store on a Redis (or Valkey) Cluster: the single-server store's records, commands and
//! scripts (`Records`), sent through the redis crate's cluster client.

use super::{
    channel_name, redis_error, runtime_present, subscribe, warn_if_evicting, Connector, Purge,
    Redis, RedisStoreBuilder, StoreError, SCAN_STEPS_PER_CALL,
};
use ::redis::aio::ConnectionLike;
use ::redis::cluster::ClusterClient;
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use ::redis::{
    Client, Cmd, ErrorKind, FromRedisValue, Pipeline, RedisError, RedisFuture, RedisResult, Value,
};
use std::fmt;
use std::sync::{Mutex, PoisonError};
use tokio::sync::OnceCell;

/// How many times the cluster client resends a command after a redirection (`MOVED`, `ASK`), a
/// lost connection or `CLUSTERDOWN`, and how long it waits before each resend (ms, doubling): short,
/// so that while a failover settles a call fails within the response timeout and the engine answers
/// 503, rather than holding the request.
const RETRIES: u32 = 3;
const RETRY_WAIT_MS: (u64, u64) = (50, 400);

/// A [`Store`](crate::Store) on a Redis (or Valkey) Cluster, shared by every instance of a service
/// that uses the same cluster and prefix.
///
/// Records, commands and scripts are [`RedisStore`](super::RedisStore)'s (see the [module
/// documentation](super) for the layout and what each operation costs): every key of a record is
/// one hash-tagged key, so each claim, completion, release and renewal is one command or one
/// script on the primary that owns the record's slot, and the cluster never answers `CROSSSLOT`.
/// The redis crate's cluster client finds the primaries from the seed nodes, routes each command
/// by its key and follows `MOVED` and `ASK` when slots move. Scripts are sent as `EVALSHA`; a node
/// that does not know one yet (a fresh node, a promoted replica) gets it as `EVAL`, which loads it
/// there.
///
/// # Waking waiters across instances
/// Completions of watched records `PUBLISH` on `<prefix>:done`, as on one server. A cluster delivers
/// such a message to the subscribers of every node, so each store subscribes on one node, the first
/// seed that answers, and moves to the next seed when that connection fails (a ping every 15 s
/// notices a silent one); on each new subscription its waiters re-read their records. Sharded
/// pub/sub does not fit: a script may `SPUBLISH` only on a channel in its key's slot, so each waited
/// key would need a channel, and each instance a subscription round trip per waited key, renewed
/// whenever the slot moves. Since only records a duplicate waits for publish, the broadcast carries
/// one message per contended completion, not one per request. Give several seed nodes.
///
/// # Failover
/// Replication is asynchronous: a claim acknowledged by a primary that dies before its replica
/// has it is lost with it, and a retry on the promoted replica runs the handler again; so can a
/// completed response. [`wait_for_replicas`](RedisStoreBuilder::wait_for_replicas) makes each claim
/// and completion wait for a replica's confirmation, and says what that guarantees. While a
/// primary's slots have no reachable owner (between its death and its replica's promotion, a
/// few node timeouts), calls on those slots fail as unavailable.
///
/// # Purging
/// [`Purge`] runs the single-server pass (`SCAN MATCH <prefix>:{*`, `purge.lua` per record) on each
/// primary in turn, in address order, continuing across calls.
///
/// ```no_run
/// use idem_runtime::{Engine, store::redis::RedisClusterStore};
/// # async fn run() -> Result<(), idem_runtime::redis::RedisError> {
/// let store = RedisClusterStore::builder(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])
///     .prefix("payments-idem")
///     .connect()
///     .await?;
/// let engine = Engine::new(store);
/// # let _ = engine;
/// # Ok(())
/// # }
/// ```
pub type RedisClusterStore = Redis<Cluster>;

/// How a [`Redis`] store reaches a cluster: the redis crate's cluster client, connected on first
/// use, which routes each command by its key.
pub struct Cluster {
    seeds: Vec<String>,
    client: ClusterClient,
    conn: OnceCell<ClusterConnection>,
    /// The primary the purge pass is on (`host:port`; empty: start a new pass) and its cursor there.
    purge_at: Mutex<(String, u64)>,
}

impl Connector for Cluster {
    type Conn = ClusterConnection;
    type Node = OnNode;
    const KIND: &'static str = "redis-cluster";

    async fn conn(&self) -> Result<ClusterConnection, StoreError> {
        if let Some(conn) = self.conn.get() {
            return Ok(conn.clone());
        }
        Box::pin(
            self.conn
                .get_or_try_init(|| self.client.get_async_connection()),
        )
        .await
        .cloned()
        .map_err(StoreError::unavailable)
    }

    /// A connection to each primary that serves slots.
    async fn nodes(&self) -> Result<Vec<OnNode>, StoreError> {
        let mut conn = self.conn().await?;
        let primaries = primaries(&mut conn).await?;
        Ok(primaries
            .into_iter()
            .map(|(_, (host, port))| OnNode {
                conn: conn.clone(),
                host,
                port,
            })
            .collect())
    }
}

impl fmt::Debug for RedisClusterStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisClusterStore")
            .field("seeds", &self.link.seeds.len())
            .field("prefix", &self.records.prefix)
            .field("connected", &self.link.conn.initialized())
            .field("subscribed", &self.is_subscribed())
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder<RedisClusterStore> {
    /// Connects now: fails if no seed node answers, and returns once this store is subscribed to
    /// completions from other instances.
    pub async fn connect(self) -> RedisResult<RedisClusterStore> {
        let (client, seeds) = self.prepare()?;
        let mut conn = client.get_async_connection().await?;
        let channel = channel_name(&self.prefix);
        let mut pubsub = Err(RedisError::from((
            ErrorKind::InvalidClientConfig,
            "no seed node",
        )));
        for seed in &seeds {
            pubsub = subscribe(seed, &channel, self.connection_timeout).await;
            if pubsub.is_ok() {
                break;
            }
        }
        let pubsub = pubsub?;
        warn_if_evicting(&mut conn).await;
        self.assemble(client, seeds, Some(conn), Some(pubsub))
    }

    /// Builds the store without connecting, as [`RedisStoreBuilder::connect_lazy`] does for one
    /// server: the first operation connects, and until a node answers every operation fails as
    /// unavailable. Fails only on an invalid URL or prefix, or outside a Tokio runtime.
    pub fn connect_lazy(self) -> RedisResult<RedisClusterStore> {
        let (client, seeds) = self.prepare()?;
        runtime_present()?;
        self.assemble(client, seeds, None, None)
    }

    fn prepare(&self) -> RedisResult<(ClusterClient, Vec<Client>)> {
        self.records()?;
        let seeds = self
            .nodes
            .iter()
            .map(|node| Client::open(node.as_str()))
            .collect::<RedisResult<Vec<_>>>()?;
        let client = ClusterClient::builder(self.nodes.clone())
            .connection_timeout(self.connection_timeout)
            .response_timeout(self.response_timeout)
            .retries(RETRIES)
            .min_retry_wait(RETRY_WAIT_MS.0)
            .max_retry_wait(RETRY_WAIT_MS.1)
            .build()?;
        Ok((client, seeds))
    }

    fn assemble(
        self,
        client: ClusterClient,
        seeds: Vec<Client>,
        conn: Option<ClusterConnection>,
        pubsub: Option<::redis::aio::PubSub>,
    ) -> RedisResult<RedisClusterStore> {
        let records = self.records()?;
        Ok(Redis {
            subscriber: self.subscriber(&records, seeds, pubsub),
            link: Cluster {
                seeds: self.nodes,
                client,
                conn: OnceCell::new_with(conn),
                purge_at: Mutex::new((String::new(), 0)),
            },
            records,
        })
    }
}

impl Redis<Cluster> {
    /// Connects to the cluster that `seeds` belong to (`redis://[user:password@]host:port` each; the
    /// other nodes are discovered) with the default settings and the prefix `"idem"`. Same as
    /// `RedisClusterStore::builder(seeds).connect()`.
    pub async fn connect<S: Into<String>>(seeds: impl IntoIterator<Item = S>) -> RedisResult<Self> {
        Self::builder(seeds).connect().await
    }

    /// A builder for a store on the cluster that `seeds` belong to, to set the prefix, timeouts and
    /// durability.
    pub fn builder<S: Into<String>>(
        seeds: impl IntoIterator<Item = S>,
    ) -> RedisStoreBuilder<RedisClusterStore> {
        RedisStoreBuilder::new(seeds.into_iter().map(Into::into).collect())
    }
}

#[async_trait::async_trait]
impl Purge for Redis<Cluster> {
    /// Deletes at most `batch` records past retention at each primary's time, continuing one pass over every
    /// primary's keys across calls (as [`RedisStore`](super::RedisStore) does over one server's);
    /// a call stops at the end of the pass or after 64 `SCAN` steps in all.
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let mut conn = self.link.conn().await?;
        let primaries = primaries(&mut conn).await?;
        let (node, mut cursor) = self
            .link
            .purge_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        // The pass continues on the primary it stopped on, or, if that one is gone, on the next.
        let mut at = primaries.partition_point(|(address, _)| *address < node);
        if primaries
            .get(at)
            .is_none_or(|(address, _)| *address != node)
        {
            cursor = 0;
        }
        let (budget, mut deleted, mut steps) = (batch as u64, 0, SCAN_STEPS_PER_CALL);
        while let Some((_, (host, port))) = primaries.get(at) {
            let mut on_node = OnNode {
                conn: conn.clone(),
                host: host.clone(),
                port: *port,
            };
            let (purged, next, left) = self
                .records
                .purge(&mut on_node, cursor, budget - deleted, steps)
                .await?;
            (deleted, cursor, steps) = (deleted + purged, next.unwrap_or(0), left);
            if next.is_none() {
                at += 1;
            }
            if deleted >= budget || steps == 0 {
                break;
            }
        }
        let node = primaries.get(at).map(|(address, _)| address.clone());
        *self
            .link
            .purge_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = (node.unwrap_or_default(), cursor);
        Ok(deleted)
    }
}

/// The primaries that serve slots, as (`host:port`, (host, port)), in address order.
async fn primaries(
    conn: &mut ClusterConnection,
) -> Result<Vec<(String, (String, u16))>, StoreError> {
    let random = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
    let nodes = conn
        .route_command(::redis::cmd("CLUSTER").arg("NODES"), random)
        .await
        .and_then(|nodes| String::from_redis_value(&nodes))
        .map_err(redis_error)?;
    // `<id> <host:port@bus-port> <flags> <primary> <ping> <pong> <epoch> <link> <slot>…`
    let mut primaries: Vec<_> = nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let flags = fields.get(2)?;
            if fields.len() < 9
                || !flags.split(',').any(|f| f == "master")
                || flags.contains("fail")
            {
                return None;
            }
            let address = fields[1].split(['@', ',']).next()?;
            let (host, port) = address.rsplit_once(':')?;
            Some((address.to_owned(), (host.to_owned(), port.parse().ok()?)))
        })
        .collect();
    primaries.sort();
    Ok(primaries)
}

/// A cluster connection that sends every command to one node, so that the single-server passes
/// (purge, erase, listing, counts) run on each primary.
pub struct OnNode {
    conn: ClusterConnection,
    host: String,
    port: u16,
}

impl OnNode {
    fn route(&self) -> SingleNodeRoutingInfo {
        SingleNodeRoutingInfo::ByAddress {
            host: self.host.clone(),
            port: self.port,
        }
    }
}

impl ConnectionLike for OnNode {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let route = RoutingInfo::SingleNode(self.route());
        Box::pin(self.conn.route_command(cmd, route))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipe: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let route = self.route();
        Box::pin(self.conn.route_pipeline(pipe, offset, count, route))
    }

    fn get_db(&self) -> i64 {
        0
    }
}
