//! Load loops: N concurrent workers, bounded by a request count and a time limit, recording each
//! request's latency.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::header::{HeaderValue, COOKIE};
use hyper_util::rt::TokioIo;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The JSON body every benchmark request sends.
pub(crate) const BODY: &str = r#"{"amount": 1000, "currency": "KRW", "description": "two apples"}"#;

/// Latencies and counts of one load run.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sample {
    pub(crate) ok: u64,
    pub(crate) errors: u64,
    pub(crate) elapsed: Duration,
    /// Latencies in nanoseconds, sorted.
    pub(crate) latencies: Vec<u64>,
}

impl Sample {
    pub(crate) fn throughput(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub(crate) fn quantile(&self, q: f64) -> Duration {
        if self.latencies.is_empty() {
            return Duration::ZERO;
        }
        let i = ((self.latencies.len() - 1) as f64 * q).round() as usize;
        Duration::from_nanos(self.latencies[i])
    }

    pub(crate) fn p50(&self) -> Duration {
        self.quantile(0.5)
    }

    /// Every sample's operations together (their time added up), latencies sorted: the rounds of
    /// one cell as one sample, for tails over all of them.
    pub(crate) fn pooled(samples: &[Sample]) -> Sample {
        let mut all = Sample::default();
        for s in samples {
            all.add(s.ok, s.errors, s.latencies.clone());
            all.elapsed += s.elapsed;
        }
        all.sorted()
    }

    /// Adds one worker's counts; the latencies stay unsorted until [`Sample::sorted`].
    fn add(&mut self, ok: u64, errors: u64, latencies: Vec<u64>) {
        self.ok += ok;
        self.errors += errors;
        self.latencies.extend(latencies);
    }

    fn sorted(mut self) -> Self {
        self.latencies.sort_unstable();
        self
    }
}

/// The run's bounds: whichever comes first.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) time: Duration,
    pub(crate) requests: u64,
}

/// Store operations from `workers` concurrent tasks, in one or more runs that add to one sample
/// (the sections interleave several loads: see [`Sliced`] and [`interleaved`]);
/// `n` counts on from one run to the next, so an operation on a fresh key never sees a key twice.
pub(crate) struct Ops<F> {
    workers: usize,
    op: Arc<F>,
    issued: Arc<AtomicU64>,
    /// What the runs so far measured, their time added up.
    tally: Sample,
}

impl<F, Fut> Ops<F>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send,
{
    pub(crate) fn new(workers: usize, op: F) -> Self {
        Ops {
            workers,
            op: Arc::new(op),
            issued: Arc::new(AtomicU64::new(0)),
            tally: Sample::default(),
        }
    }

    /// Runs the operations until `bounds.time` has passed or `bounds.requests` have been issued
    /// since the first run.
    pub(crate) async fn run(&mut self, bounds: Bounds) {
        let start = Instant::now();
        let deadline = start + bounds.time;
        let mut tasks = Vec::with_capacity(self.workers);
        for w in 0..self.workers {
            let op = self.op.clone();
            let issued = self.issued.clone();
            tasks.push(tokio::spawn(async move {
                let (mut ok, mut errors, mut lat) = (0u64, 0u64, Vec::with_capacity(4096));
                loop {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= bounds.requests || Instant::now() >= deadline {
                        break;
                    }
                    let t = Instant::now();
                    if op(w, n).await {
                        ok += 1;
                        lat.push(t.elapsed().as_nanos() as u64);
                    } else {
                        errors += 1;
                    }
                }
                (ok, errors, lat)
            }));
        }
        for task in tasks {
            let (ok, errors, lat) = task.await.expect("load worker panicked");
            self.tally.add(ok, errors, lat);
        }
        self.tally.elapsed += start.elapsed();
    }

    /// Everything the runs so far measured, as one sample (their time added up).
    pub(crate) fn sample(self) -> Sample {
        self.tally.sorted()
    }
}

/// A load that runs in slices, each adding to one sample: HTTP [`Connections`] or store [`Ops`],
/// behind one type so a section can interleave the paths it compares. Boxed per slice,
/// never per request: each request still runs its own path's code, unboxed.
pub(crate) trait Sliced: Send {
    /// Runs the load once more, within `bounds`.
    fn run_slice(&mut self, bounds: Bounds) -> Pin<Box<dyn Future<Output = ()> + Send + '_>>;
    /// Everything the slices measured.
    fn into_sample(self: Box<Self>) -> Sample;
}

impl<F, Fut> Sliced for Ops<F>
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = bool> + Send + 'static,
{
    fn run_slice(&mut self, bounds: Bounds) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.run(bounds))
    }

    fn into_sample(self: Box<Self>) -> Sample {
        self.sample()
    }
}

impl Sliced for Connections {
    fn run_slice(&mut self, bounds: Bounds) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.run(bounds))
    }

    fn into_sample(self: Box<Self>) -> Sample {
        self.sample()
    }
}

/// Which `Idempotency-Key` each HTTP request carries.
#[derive(Debug, Clone)]
pub(crate) enum Keys {
    /// A new key per request: `<prefix>-<n>`.
    Fresh(Arc<str>),
    /// One of these keys, round robin (all completed beforehand: every request replays).
    Replay(Arc<Vec<String>>),
}

impl Keys {
    fn key(&self, n: u64) -> String {
        match self {
            Keys::Fresh(prefix) => format!("{prefix}-{n}"),
            Keys::Replay(keys) => keys[n as usize % keys.len()].clone(),
        }
    }
}

/// HTTP load whose connections stay open from one run to the next, each run adding to one sample:
/// what lets a section interleave the paths it compares in short slices (see
/// [`interleaved`]), so that the machine's slow moments fall on every path alike. Keys
/// continue from one run to the next: a fresh key is never sent twice.
pub(crate) struct Connections {
    addr: SocketAddr,
    path: &'static str,
    keys: Keys,
    /// One per connection; `None` for one that could not be opened, or reopened after it failed.
    senders: Vec<Option<Sender>>,
    issued: Arc<AtomicU64>,
    /// What the runs so far measured, their time added up; a connection that failed to open counts
    /// as one error.
    tally: Sample,
    /// A `Cookie` header per connection (round robin), for servers that keep state per session.
    cookies: Arc<Vec<HeaderValue>>,
}

impl Connections {
    /// Opens `connections` connections to `addr` (a connection that fails to open counts as one
    /// error, and sends nothing).
    pub(crate) async fn open(
        addr: SocketAddr,
        path: &'static str,
        keys: Keys,
        connections: usize,
    ) -> Self {
        let mut senders = Vec::with_capacity(connections);
        let mut errors = 0;
        for _ in 0..connections {
            let sender = connect(addr).await.ok();
            errors += u64::from(sender.is_none());
            senders.push(sender);
        }
        Connections {
            addr,
            path,
            keys,
            senders,
            issued: Arc::new(AtomicU64::new(0)),
            tally: Sample {
                errors,
                ..Sample::default()
            },
            cookies: Arc::default(),
        }
    }

    /// Sends connection `i`'s requests with `cookies[i % len]` as their `Cookie` header.
    pub(crate) fn with_cookies(mut self, cookies: Arc<Vec<HeaderValue>>) -> Self {
        self.cookies = cookies;
        self
    }

    /// Sends requests on every connection, back to back, until `bounds.time` has passed or
    /// `bounds.requests` requests have been issued since the connections opened.
    pub(crate) async fn run(&mut self, bounds: Bounds) {
        let start = Instant::now();
        let deadline = start + bounds.time;
        let mut tasks = Vec::with_capacity(self.senders.len());
        for (i, sender) in self.senders.drain(..).enumerate() {
            let (addr, path, keys) = (self.addr, self.path, self.keys.clone());
            let cookie =
                (!self.cookies.is_empty()).then(|| self.cookies[i % self.cookies.len()].clone());
            let issued = self.issued.clone();
            tasks.push(tokio::spawn(async move {
                let (mut ok, mut errors, mut lat) = (0u64, 0u64, Vec::with_capacity(4096));
                let Some(mut sender) = sender else {
                    return (None, ok, errors, lat);
                };
                loop {
                    let n = issued.fetch_add(1, Ordering::Relaxed);
                    if n >= bounds.requests || Instant::now() >= deadline {
                        break;
                    }
                    let mut request = post(path, &keys.key(n));
                    if let Some(cookie) = &cookie {
                        request.headers_mut().insert(COOKIE, cookie.clone());
                    }
                    let t = Instant::now();
                    match send(&mut sender, request).await {
                        Some(status) if status.is_success() => {
                            ok += 1;
                            lat.push(t.elapsed().as_nanos() as u64);
                        }
                        Some(_) => errors += 1,
                        None => {
                            errors += 1;
                            match connect(addr).await {
                                Ok(s) => sender = s,
                                Err(_) => return (None, ok, errors, lat),
                            }
                        }
                    }
                }
                (Some(sender), ok, errors, lat)
            }));
        }
        for task in tasks {
            let (sender, ok, errors, lat) = task.await.expect("load worker panicked");
            self.senders.push(sender);
            self.tally.add(ok, errors, lat);
        }
        self.tally.elapsed += start.elapsed();
    }

    /// Everything the runs so far measured, as one sample (their time added up).
    pub(crate) fn sample(self) -> Sample {
        self.tally.sorted()
    }
}

/// How many slices [`interleaved`] cuts each path's cell into: at the default 1 s per cell, 100 ms
/// each, long enough for thousands of requests at one connection.
const SLICES: u32 = 10;

/// Runs every load for `bounds.time` in all, in [`SLICES`] turns: each turn runs each load for a
/// slice of that time, one after the other, starting one load further on at each turn. A cell is
/// then the sum of its slices, spread over the whole round, instead of one stretch of it: a slow
/// second of the shared machine (another tenant, a stolen core) lands on every path in the
/// comparison, not on the one cell that happened to run then. The connections stay open between
/// slices (opened before the first), so no slice pays for a handshake.
pub(crate) async fn interleaved<K>(loads: &mut [(K, Box<dyn Sliced>)], bounds: Bounds) {
    let slice = Bounds {
        time: bounds.time / SLICES,
        requests: bounds.requests,
    };
    for turn in 0..SLICES as usize {
        for i in 0..loads.len() {
            let (_, load) = &mut loads[(i + turn) % loads.len()];
            load.run_slice(slice).await;
        }
    }
}

pub(crate) type Sender = http1::SendRequest<Full<Bytes>>;

pub(crate) async fn connect(addr: SocketAddr) -> std::io::Result<Sender> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(std::io::Error::other)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(sender)
}

pub(crate) fn post(path: &str, key: &str) -> hyper::Request<Full<Bytes>> {
    hyper::Request::post(path)
        .header("host", "127.0.0.1")
        .header("content-type", "application/json")
        .header("authorization", "Bearer user-1")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .expect("a valid request")
}

/// Sends one request and reads the whole response; `None` if the connection failed.
pub(crate) async fn send(
    sender: &mut Sender,
    request: hyper::Request<Full<Bytes>>,
) -> Option<hyper::StatusCode> {
    sender.ready().await.ok()?;
    let response = sender.send_request(request).await.ok()?;
    let status = response.status();
    response.into_body().collect().await.ok()?;
    Some(status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    use std::sync::Mutex;

    /// Slices of one [`Ops`] add up to one sample, and `n` counts on from one slice to the next: a
    /// path that makes a fresh key of `n` never sends a key twice, however it is sliced.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slices_add_up_and_never_repeat_an_operation() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let mut ops: Box<dyn Sliced> = Box::new(Ops::new(4, move |_, n| {
            let log = log.clone();
            async move {
                log.lock().expect("not poisoned").push(n);
                n % 10 != 0
            }
        }));
        let hour = Duration::from_secs(3600);
        for requests in [100, 250, 250, 400] {
            ops.run_slice(Bounds {
                time: hour,
                requests,
            })
            .await;
        }
        let sample = ops.into_sample();
        let seen = seen.lock().expect("not poisoned").clone();
        let distinct: BTreeSet<u64> = seen.iter().copied().collect();
        assert_eq!(distinct.len(), seen.len(), "no operation issued twice");
        assert!(
            seen.iter().all(|&n| n < 400),
            "the request bound counts from the first slice"
        );
        // Each worker that stops at a slice's bound has drawn one `n` it does not issue.
        assert!(seen.len() >= 400 - 3 * 4, "{} issued", seen.len());
        let failed = seen.iter().filter(|&&n| n % 10 == 0).count() as u64;
        assert_eq!(sample.errors, failed);
        assert_eq!(sample.ok, seen.len() as u64 - failed);
        assert_eq!(sample.latencies.len() as u64, sample.ok);
        assert!(sample.latencies.windows(2).all(|w| w[0] <= w[1]), "sorted");
    }

    /// A load that only logs which slices it was given.
    struct Logged {
        id: usize,
        log: Arc<std::sync::Mutex<Vec<(usize, Duration)>>>,
    }

    impl Sliced for Logged {
        fn run_slice(
            &mut self,
            bounds: Bounds,
        ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
            let log = self.log.clone();
            let id = self.id;
            Box::pin(async move { log.lock().expect("not poisoned").push((id, bounds.time)) })
        }

        fn into_sample(self: Box<Self>) -> Sample {
            Sample::default()
        }
    }

    /// What makes the sliced ratios fair: every load gets [`SLICES`] slices of an equal share of
    /// the cell's time, and the order rotates, so no load always runs first or last in a turn.
    #[tokio::test]
    async fn interleaving_gives_every_load_equal_slices_in_rotating_order() {
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut loads: Vec<(usize, Box<dyn Sliced>)> = (0..3)
            .map(|id| {
                let load: Box<dyn Sliced> = Box::new(Logged {
                    id,
                    log: log.clone(),
                });
                (id, load)
            })
            .collect();
        let bounds = Bounds {
            time: Duration::from_secs(1),
            requests: 10,
        };
        interleaved(&mut loads, bounds).await;
        let log = log.lock().expect("not poisoned").clone();
        assert_eq!(log.len(), 3 * SLICES as usize);
        assert!(log.iter().all(|&(_, t)| t == bounds.time / SLICES));
        for (turn, slices) in log.chunks(3).enumerate() {
            let order: Vec<usize> = slices.iter().map(|&(id, _)| id).collect();
            let expected: Vec<usize> = (0..3).map(|i| (i + turn) % 3).collect();
            assert_eq!(order, expected, "turn {turn}");
        }
    }
}
