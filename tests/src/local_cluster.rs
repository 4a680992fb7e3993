//! A Redis Cluster the tests start themselves: 3 primaries and 3 replicas of the machine's
//! `redis-server`, on free ports, created with `redis-cli --cluster create`.
//!
//! The nodes run under one supervisor, a small `sh` script whose standard input is a pipe this
//! process holds: each line it reads starts a node, and when the pipe closes (the cluster is
//! dropped, or the test process exits, panics or is killed) it kills its nodes and removes their
//! directory. So no node outlives the tests, whatever ends them.
//!
//! [`shared`] is the cluster of a test binary, started once by the first test that needs one;
//! a test that kills nodes starts one of its own with [`LocalCluster::start`].

use idem_runtime::redis;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Reads ports, one a line, starts a node on each (printing its pid), and on end of input kills
/// them all and removes the cluster's directory (`$1`).
const SUPERVISOR: &str = r#"
dir=$1
pids=
while read -r port bus; do
  mkdir -p "$dir/$port"
  redis-server --bind 127.0.0.1 --port "$port" --cluster-port "$bus" --dir "$dir/$port" \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 1000 \
    --cluster-replica-validity-factor 0 --save "" --appendonly no --logfile redis.log \
    </dev/null >/dev/null 2>&1 &
  pids="$pids $!"
  echo "$!"
done
kill -9 $pids 2>/dev/null
wait
rm -rf "$dir"
"#;

/// How long the cluster may take to start, or a node to come up.
const PATIENCE: Duration = Duration::from_secs(30);

/// A running cluster of the tests' own (see the [module](self)).
#[derive(Debug)]
pub struct LocalCluster {
    /// The nodes' client ports, and their cluster bus ports.
    ports: Vec<(u16, u16)>,
    supervisor: Mutex<Supervisor>,
}

#[derive(Debug)]
struct Supervisor {
    child: Child,
    /// `None` once the cluster is dropped: closing it stops the nodes.
    commands: Option<ChildStdin>,
    pids: BufReader<ChildStdout>,
    /// The running process of each node, by client port.
    running: HashMap<u16, u32>,
}

impl LocalCluster {
    /// Starts six nodes on free ports and makes them a cluster of 3 primaries with a replica each.
    /// Errs, saying what failed, if `redis-server` or `redis-cli` is missing or the cluster does
    /// not come up.
    pub fn start() -> Result<Self, String> {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, Ordering::Relaxed);
        let dir =
            std::env::temp_dir().join(format!("idem-test-cluster-{}-{n}", std::process::id()));
        let ports = free_ports(6)?;
        let mut child = Command::new("sh")
            .args(["-c", SUPERVISOR, "supervisor"])
            .arg(&dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("could not run sh: {e}"))?;
        let (Some(commands), Some(pids)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the supervisor's pipes are missing".into());
        };
        let cluster = Self {
            ports,
            supervisor: Mutex::new(Supervisor {
                child,
                commands: Some(commands),
                pids: BufReader::new(pids),
                running: HashMap::new(),
            }),
        };
        for port in cluster.ports() {
            cluster.run_node(port)?;
        }
        for port in cluster.ports() {
            wait_until(
                || ping(port),
                &format!(
                    "redis-server on 127.0.0.1:{port} did not answer (see {})",
                    dir.display()
                ),
            )?;
        }
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(cluster.ports().map(|port| format!("127.0.0.1:{port}")))
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("could not run redis-cli: {e}"))?;
        if !created.status.success() {
            return Err(format!(
                "redis-cli --cluster create failed: {}{}",
                String::from_utf8_lossy(&created.stdout),
                String::from_utf8_lossy(&created.stderr)
            ));
        }
        // Serving every slot, and replicating: a test that waits for a replica's acknowledgement
        // must not find the link still syncing.
        for port in cluster.ports() {
            wait_until(
                || cluster_state(port).as_deref() == Some("ok") && replicating(port),
                &format!(
                    "127.0.0.1:{port} did not reach cluster_state:ok with its replication link up"
                ),
            )?;
        }
        Ok(cluster)
    }

    /// The nodes' client ports.
    pub fn ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.ports.iter().map(|(port, _)| *port)
    }

    /// Every node, as `redis://127.0.0.1:<port>`.
    pub fn seeds(&self) -> Vec<String> {
        self.ports()
            .map(|port| format!("redis://127.0.0.1:{port}"))
            .collect()
    }

    /// The cluster as a `redis-cluster://` URL of its first three nodes.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports()
            .take(3)
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis-cluster://{}", nodes.join(","))
    }

    /// Kills the node on `port` with SIGKILL, as a crash would.
    pub fn kill(&self, port: u16) -> Result<(), String> {
        let pid = self
            .lock()
            .running
            .remove(&port)
            .ok_or_else(|| format!("no node runs on {port}"))?;
        let killed = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .map_err(|e| format!("could not run kill: {e}"))?;
        killed
            .success()
            .then_some(())
            .ok_or_else(|| format!("kill -9 {pid} failed"))
    }

    /// Restarts the node on `port` after [`kill`](Self::kill), with its cluster configuration: it
    /// rejoins the cluster (as a replica, if its replica was promoted meanwhile).
    pub fn revive(&self, port: u16) -> Result<(), String> {
        self.run_node(port)?;
        wait_until(
            || ping(port),
            &format!("127.0.0.1:{port} did not come back"),
        )
    }

    fn run_node(&self, port: u16) -> Result<(), String> {
        let bus = self
            .ports
            .iter()
            .find_map(|&(p, bus)| (p == port).then_some(bus))
            .ok_or_else(|| format!("{port} is not a node of this cluster"))?;
        let mut supervisor = self.lock();
        let supervisor = &mut *supervisor;
        let commands = supervisor
            .commands
            .as_mut()
            .ok_or("the cluster is stopped")?;
        writeln!(commands, "{port} {bus}")
            .and_then(|()| commands.flush())
            .map_err(|e| format!("the supervisor is gone: {e}"))?;
        let mut line = String::new();
        supervisor
            .pids
            .read_line(&mut line)
            .map_err(|e| format!("the supervisor is gone: {e}"))?;
        let pid = line
            .trim()
            .parse()
            .map_err(|_| format!("the supervisor answered {line:?}"))?;
        supervisor.running.insert(port, pid);
        Ok(())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Supervisor> {
        self.supervisor
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for LocalCluster {
    /// Closes the supervisor's input: it kills the nodes and removes their files.
    fn drop(&mut self) {
        let mut supervisor = self.lock();
        drop(supervisor.commands.take());
        let _ = supervisor.child.wait();
    }
}

/// The test binary's cluster, started by the first call; every later call gets the same one, or
/// the same error.
pub fn shared() -> &'static Result<LocalCluster, String> {
    static SHARED: OnceLock<Result<LocalCluster, String>> = OnceLock::new();
    SHARED.get_or_init(LocalCluster::start)
}

/// `count` pairs of ports nothing listens on now: a client port and a cluster bus port per node.
fn free_ports(count: usize) -> Result<Vec<(u16, u16)>, String> {
    let listeners = (0..2 * count)
        .map(|_| TcpListener::bind("127.0.0.1:0"))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("no free port: {e}"))?;
    let ports = listeners
        .iter()
        .map(|l| l.local_addr().map(|a| a.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("no free port: {e}"))?;
    Ok(ports.chunks(2).map(|pair| (pair[0], pair[1])).collect())
}

fn connection(port: u16) -> redis::RedisResult<redis::Connection> {
    redis::Client::open(format!("redis://127.0.0.1:{port}"))?
        .get_connection_with_timeout(Duration::from_millis(500))
}

fn ping(port: u16) -> bool {
    connection(port).is_ok_and(|mut conn| redis::cmd("PING").query::<String>(&mut conn).is_ok())
}

fn cluster_state(port: u16) -> Option<String> {
    let info: String = redis::cmd("CLUSTER")
        .arg("INFO")
        .query(&mut connection(port).ok()?)
        .ok()?;
    info.lines()
        .find_map(|line| line.strip_prefix("cluster_state:"))
        .map(|state| state.trim().to_owned())
}

/// Whether the node on `port` is a primary with an online replica, or a replica whose link to its
/// primary is up.
fn replicating(port: u16) -> bool {
    let Some(info) = connection(port).ok().and_then(|mut conn| {
        redis::cmd("INFO")
            .arg("replication")
            .query::<String>(&mut conn)
            .ok()
    }) else {
        return false;
    };
    let field = |name: &str| {
        info.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .unwrap_or_default()
            .trim()
            .to_owned()
    };
    match field("role").as_str() {
        "master" => field("slave0").contains("state=online"),
        "slave" => field("master_link_status") == "up",
        _ => false,
    }
}

/// Polls `ready` until it holds, or fails with `what` after [`PATIENCE`].
fn wait_until(mut ready: impl FnMut() -> bool, what: &str) -> Result<(), String> {
    let deadline = Instant::now() + PATIENCE;
    while !ready() {
        if Instant::now() > deadline {
            return Err(format!("{what} within {PATIENCE:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}
