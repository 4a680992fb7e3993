//! The HTTP section: one do-nothing handler served plain, under idem (`#[idempotent]`, per store),
//! and under the peer axum-idempotent (its in-memory session store and its Redis one), loaded at
//! [`CONNECTIONS`] connections with new keys and with replays, in interleaved rounds; then the
//! concurrent-duplicates count of each server.

use crate::load::{self, interleaved, Bounds, Connections, Keys, Sample};
use crate::report::{median, pct, rate, tails, Config};
use crate::stores::{self, Backend, Handle};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::{HeaderValue, CONTENT_TYPE, COOKIE, LOCATION, SET_COOKIE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use http_body_util::BodyExt;
use idem_runtime::{idempotent, Engine, Fingerprint};
use ruts::store::SessionStore;
use ruts::{CookieOptions, Session, SessionLayer};
use serde::Deserialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Connections of every throughput cell.
pub(crate) const CONNECTIONS: usize = 16;
/// Completed keys each replay cell cycles through.
pub(crate) const REPLAY_KEYS: usize = 256;
/// The concurrent-duplicates count: this many keys, each sent by this many requests at once.
const DUP_KEYS: u64 = 50;
const DUP_COPIES: usize = 16;

/// The request every handler takes.
#[derive(Debug, Deserialize)]
pub(crate) struct NewPayment {
    amount: i64,
    currency: String,
}

/// Handler executions, over every server in this process (the sections count one server at a time).
static EXECUTIONS: AtomicU64 = AtomicU64::new(0);
/// How long each execution takes, in ms: 0 for the throughput cells (a do-nothing handler), some
/// for the duplicates count, so that identical requests overlap as they would on a real handler.
static WORK_MS: AtomicU64 = AtomicU64::new(0);
/// The handler's time in the duplicates count.
const DUP_WORK_MS: u64 = 20;

/// The handler's work: nothing, unless [`WORK_MS`] says otherwise.
async fn work() {
    let ms = WORK_MS.load(Ordering::Relaxed);
    if ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
}

/// What every handler does: a 201 with a JSON body and a `Location`, like the payments example
/// minus its ledger, so that the difference between the servers is the idempotency layer alone.
fn created(req: NewPayment) -> Response {
    let id = EXECUTIONS.fetch_add(1, Ordering::Relaxed) + 1;
    (
        StatusCode::CREATED,
        [(LOCATION, format!("/payments/{id}"))],
        Json(serde_json::json!({
            "id": id, "amount": req.amount, "currency": req.currency, "status": "captured"
        })),
    )
        .into_response()
}

async fn plain(Json(req): Json<NewPayment>) -> Response {
    work().await;
    created(req)
}

#[idempotent(scope = "global", ttl = "24h")]
async fn annotated(Json(req): Json<NewPayment>) -> Response {
    work().await;
    created(req)
}

/// Each key's request fingerprint (if taken) and response (`None` while its handler runs), kept by
/// hand: the memory store's floor.
type ByHand = Arc<Mutex<HashMap<String, (Option<Fingerprint>, Option<Stored>)>>>;
type Stored = (StatusCode, HeaderMap, Bytes);

/// The least that keeping a record per key costs in one process: a key seen before gets its stored
/// response (or a 409 while it runs), a new one runs the handler and stores its response. No
/// fingerprint, lease, expiry or waiting for a duplicate, as the memory store has.
async fn by_hand(State(records): State<ByHand>, headers: HeaderMap, body: Bytes) -> Response {
    kept_by_hand(records, headers, body, None).await
}

/// [`by_hand`], with the request's fingerprint taken, kept and compared (a 422 for another
/// request under the key): how much of the way from the floor to idem the fingerprint is.
async fn by_hand_fingerprinted(
    State(records): State<ByHand>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers.get(CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let fingerprint = Fingerprint::of_request("POST", "/floor-fingerprinted", content_type, &body);
    kept_by_hand(records, headers, body, Some(fingerprint)).await
}

async fn kept_by_hand(
    records: ByHand,
    headers: HeaderMap,
    body: Bytes,
    fingerprint: Option<Fingerprint>,
) -> Response {
    let Some(key) = headers.get("idempotency-key").and_then(|v| v.to_str().ok()) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let seen = match records.lock() {
        Ok(mut records) => {
            let seen = records.get(key).cloned();
            if seen.is_none() {
                records.insert(key.to_owned(), (fingerprint, None));
            }
            seen
        }
        Err(_) => return StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    };
    match seen {
        Some((taken, _)) if taken != fingerprint => {
            return StatusCode::UNPROCESSABLE_ENTITY.into_response()
        }
        Some((_, Some((status, headers, body)))) => return (status, headers, body).into_response(),
        Some((_, None)) => return StatusCode::CONFLICT.into_response(),
        None => {}
    }
    let Ok(Json(req)) = Json::<NewPayment>::from_bytes(&body) else {
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    };
    work().await;
    let (parts, body) = created(req).into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    let stored = (parts.status, parts.headers.clone(), body.clone());
    if let Ok(mut records) = records.lock() {
        records.insert(key.to_owned(), (fingerprint, Some(stored)));
    }
    Response::from_parts(parts, Body::from(body))
}

/// Establishes a session: axum-idempotent caches responses only for requests that carry one.
/// A store's error is the 500's body, for the report to say why the peer was not run.
async fn login<S: SessionStore>(session: Session<S>) -> Response {
    let set = match ruts::store::Ttl::new(86_400) {
        Ok(ttl) => session
            .set("user", &1u32, ttl, None)
            .await
            .map_err(|e| e.to_string()),
        Err(e) => Err(e.to_string()),
    };
    match set {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
    }
}

/// `/plain` and `/idem`: the handler without and with `#[idempotent]` on `engine`; `/floor` and
/// `/floor-fingerprinted`: with a record kept by hand ([`by_hand`], [`by_hand_fingerprinted`]).
pub(crate) fn idem_router(engine: Engine) -> Router {
    Router::new()
        .route("/plain", post(plain))
        .route("/idem", post(annotated))
        .with_state(engine)
        .merge(
            Router::new()
                .route("/floor", post(by_hand))
                .with_state(ByHand::default()),
        )
        .merge(
            Router::new()
                .route("/floor-fingerprinted", post(by_hand_fingerprinted))
                .with_state(ByHand::default()),
        )
}

/// `/peer`: the handler under axum-idempotent keyed by the `Idempotency-Key` header (required),
/// responses cached for 24 h in the session kept in `store`; `/login` opens a session. Layers in the
/// order its documentation gives: cookies, sessions, then idempotency.
fn peer_router<S: SessionStore + 'static>(store: Arc<S>) -> Router {
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("idempotency-key"), true)
        .expire_after(86_400);
    Router::new()
        .route("/peer", post(plain))
        .layer(IdempotentLayer::<S>::new(options))
        .merge(Router::new().route("/login", post(login::<S>)))
        .layer(
            SessionLayer::new(store)
                .with_cookie_options(CookieOptions::build().name("session").max_age(86_400)),
        )
        .layer(tower_cookies::CookieManagerLayer::new())
}

/// Serves `router` on an ephemeral 127.0.0.1 port for as long as the process runs.
pub(crate) async fn serve(router: Router) -> Result<SocketAddr, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("bind: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    Ok(addr)
}

/// One server under test.
struct Server {
    name: String,
    addr: SocketAddr,
    route: &'static str,
    /// The peer's sessions: one per connection, all with the replay keys completed.
    cookies: Arc<Vec<HeaderValue>>,
}

/// A row that could not be measured, and why.
struct Skipped {
    name: String,
    why: String,
}

/// The server at `addr`'s `route`, once its replay keys are completed; else why not.
async fn seeded(name: String, addr: SocketAddr, route: &'static str) -> Result<Server, Skipped> {
    match seed(addr, route, None).await {
        Ok(()) => Ok(Server {
            name,
            addr,
            route,
            cookies: Arc::default(),
        }),
        Err(why) => Err(Skipped { name, why }),
    }
}

pub(crate) async fn run(handles: &[(Backend, Handle)], cfg: &Config) {
    let mut servers = Vec::new();
    let mut skipped = Vec::new();
    let plain_engine = Engine::new(idem_runtime::store::memory::MemoryStore::new());
    match serve(idem_router(plain_engine)).await {
        Ok(addr) => servers.push(Server {
            name: "plain axum".into(),
            addr,
            route: "/plain",
            cookies: Arc::default(),
        }),
        Err(e) => {
            println!("## HTTP\n\nskipped: {e}\n");
            return;
        }
    }
    let name = "floor: a record per key by hand (`Mutex<HashMap>`)".to_owned();
    match seeded(name, servers[0].addr, "/floor").await {
        Ok(server) => servers.push(server),
        Err(why) => skipped.push(why),
    }
    let name = "the floor, with idem's request fingerprint".to_owned();
    match seeded(name, servers[0].addr, "/floor-fingerprinted").await {
        Ok(server) => servers.push(server),
        Err(why) => skipped.push(why),
    }
    for (backend, handle) in handles {
        let name = format!("idem, {}", backend.name());
        let addr = match serve(idem_router(Engine::from_arc(handle.store()))).await {
            Ok(addr) => addr,
            Err(why) => {
                skipped.push(Skipped { name, why });
                continue;
            }
        };
        match seeded(name, addr, "/idem").await {
            Ok(server) => servers.push(server),
            Err(why) => skipped.push(why),
        }
    }
    let moka = Arc::new(ruts::store::moka::MokaStore::builder().build());
    let peers = [
        (
            "axum-idempotent, in-memory (moka)",
            serve(peer_router(moka)).await,
        ),
        ("axum-idempotent, Redis", peer_on_redis().await),
    ];
    for (name, addr) in peers {
        let name = name.to_owned();
        let ready = match addr {
            Ok(addr) => peer_sessions(addr).await.map(|cookies| (addr, cookies)),
            Err(e) => Err(e),
        };
        match ready {
            Ok((addr, cookies)) => servers.push(Server {
                name,
                addr,
                route: "/peer",
                cookies,
            }),
            Err(why) => skipped.push(Skipped { name, why }),
        }
    }

    // Interleaved rounds: every server's new-key and replay cells in slices of each round.
    let bounds = Bounds {
        time: cfg.cell(),
        requests: u64::MAX,
    };
    let replay_keys = Arc::new(replay_keys());
    let mut new: Vec<Vec<Sample>> = (0..servers.len()).map(|_| Vec::new()).collect();
    let mut replay = new.clone();
    for round in 0..cfg.rounds {
        eprintln!("http: round {} of {}", round + 1, cfg.rounds);
        let mut loads: Vec<((usize, bool), Box<dyn load::Sliced>)> = Vec::new();
        for (i, s) in servers.iter().enumerate() {
            let fresh = Keys::Fresh(format!("new-{round}").into());
            let open = |keys| async {
                Connections::open(s.addr, s.route, keys, CONNECTIONS)
                    .await
                    .with_cookies(s.cookies.clone())
            };
            loads.push(((i, false), Box::new(open(fresh).await)));
            if s.route != "/plain" {
                let keys = Keys::Replay(replay_keys.clone());
                loads.push(((i, true), Box::new(open(keys).await)));
            }
        }
        interleaved(&mut loads, bounds).await;
        for ((i, is_replay), l) in loads {
            let cells = if is_replay { &mut replay } else { &mut new };
            cells[i].push(l.into_sample());
        }
    }

    eprintln!("http: concurrent duplicates");
    let mut executions = Vec::new();
    for s in &servers {
        executions.push(duplicates(s).await);
    }

    println!("## HTTP: the same handler plain, under idem, and under axum-idempotent\n");
    println!(
        "Requests per second (median of {} interleaved rounds of {} s per cell), with p50 / p99 / \
         p99.9 latency over every round's requests, at {CONNECTIONS} keep-alive connections, each \
         request a JSON `POST` with an `Idempotency-Key`: new keys run the handler, replays send one \
         of {REPLAY_KEYS} completed keys. \"Duplicates\" counts handler executions when each of \
         {DUP_KEYS} new keys is sent by {DUP_COPIES} identical requests at once, the handler taking \
         {DUP_WORK_MS} ms there (at most once per key is {DUP_KEYS}; the peer's requests share one \
         session, as one client's retries would).\n",
        cfg.rounds, cfg.secs
    );
    println!(
        "| server | new keys, req/s | p50 / p99 / p99.9 | vs plain | replays, req/s | p50 / p99 / p99.9 | vs plain | duplicates: executions | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let cell = |samples: &[Sample]| {
        (
            median(samples.iter().map(Sample::throughput).collect()),
            Sample::pooled(samples),
        )
    };
    let plain_rps = cell(&new[0]).0;
    let show = |(rps, all): &(f64, Sample)| {
        format!(
            "{} | {} | {}",
            rate(*rps),
            tails(all),
            pct(rps / plain_rps.max(1e-9))
        )
    };
    for (i, s) in servers.iter().enumerate() {
        let n = cell(&new[i]);
        let (replays, r_errors) = if replay[i].is_empty() {
            ("— | — | —".to_owned(), 0)
        } else {
            let r = cell(&replay[i]);
            (show(&r), r.1.errors)
        };
        let dup = match &executions[i] {
            Ok(n) => n.to_string(),
            Err(e) => format!("not measured: {e}"),
        };
        println!(
            "| {} | {} | {replays} | {dup} | {} |",
            s.name,
            show(&n),
            n.1.errors + r_errors
        );
    }
    for s in skipped {
        println!("| {} | not run: {} | | | | | | | |", s.name, s.why);
    }
    // The memory store against the floor by hand, the line it is judged by, and the part of the
    // way that the fingerprint alone takes.
    let floor = servers.iter().position(|s| s.route == "/floor");
    let fingerprinted = servers
        .iter()
        .position(|s| s.route == "/floor-fingerprinted");
    let memory = servers
        .iter()
        .position(|s| s.route == "/idem" && s.name.contains("memory"));
    let ratio = |of: usize, to: usize, cells: &[Vec<Sample>]| {
        let rps = |i: usize| cell(&cells[i]).0;
        pct(rps(of) / rps(to).max(1e-9))
    };
    if let (Some(floor), Some(memory)) = (floor, memory) {
        println!(
            "\nidem's memory store against the floor by hand: new keys {}, replays {}.",
            ratio(memory, floor, &new),
            ratio(memory, floor, &replay)
        );
    }
    if let (Some(floor), Some(fingerprinted)) = (floor, fingerprinted) {
        println!(
            "The floor with idem's fingerprint against the floor: new keys {}, replays {}.",
            ratio(fingerprinted, floor, &new),
            ratio(fingerprinted, floor, &replay)
        );
    }
    println!();
}

pub(crate) fn replay_keys() -> Vec<String> {
    (0..REPLAY_KEYS).map(|i| format!("replay-{i}")).collect()
}

/// Completes the replay keys at `addr`'s `route`, in the session of `cookie` if given.
pub(crate) async fn seed(
    addr: SocketAddr,
    route: &str,
    cookie: Option<&HeaderValue>,
) -> Result<(), String> {
    complete(addr, route, cookie, &replay_keys()).await
}

/// Sends each of `keys` once to `addr`'s `route` on one connection, in the session of `cookie` if
/// given; an answer other than a success fails it.
pub(crate) async fn complete(
    addr: SocketAddr,
    route: &str,
    cookie: Option<&HeaderValue>,
    keys: &[String],
) -> Result<(), String> {
    let mut sender = load::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    for key in keys {
        let mut request = load::post(route, key);
        if let Some(cookie) = cookie {
            request.headers_mut().insert(COOKIE, cookie.clone());
        }
        match load::send(&mut sender, request).await {
            Some(status) if status.is_success() => {}
            other => return Err(format!("seeding {route} answered {other:?}")),
        }
    }
    Ok(())
}

/// A session per connection on the peer at `addr`, each with the replay keys completed (the peer
/// caches per session). Fails if the peer cannot open a session or does not replay.
async fn peer_sessions(addr: SocketAddr) -> Result<Arc<Vec<HeaderValue>>, String> {
    let mut cookies = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        let cookie = open_session(addr).await?;
        seed(addr, "/peer", Some(&cookie)).await?;
        cookies.push(cookie);
    }
    // Check that it replays: a repeated key must not run the handler again.
    let before = EXECUTIONS.load(Ordering::Relaxed);
    seed(addr, "/peer", Some(&cookies[0])).await?;
    if EXECUTIONS.load(Ordering::Relaxed) != before {
        return Err("it ran the handler again for completed keys (nothing cached)".into());
    }
    Ok(Arc::new(cookies))
}

/// `POST /login`, returning the session cookie as a `Cookie` header's value.
async fn open_session(addr: SocketAddr) -> Result<HeaderValue, String> {
    let mut sender = load::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let request = load::post("/login", "login");
    sender.ready().await.map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        return Err(session_error(status, &body));
    }
    let cookie = response
        .headers()
        .get(SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .ok_or("no session cookie")?;
    HeaderValue::from_str(cookie).map_err(|e| e.to_string())
}

/// Why the peer could not open a session, in a line.
fn session_error(status: StatusCode, body: &str) -> String {
    if body.contains("Unknown Redis command") {
        // ruts' Redis store sets each cached response's expiry with `HEXPIRE`, added in Redis 7.4.
        return "its session store (ruts' Redis store) needs Redis 7.4 or newer (`HEXPIRE`); \
                this Redis refused the command"
            .into();
    }
    format!("opening a session answered {status}: {}", body.trim())
}

/// axum-idempotent with ruts' Redis session store, on the bench's Redis database.
async fn peer_on_redis() -> Result<SocketAddr, String> {
    use fred::prelude::{Builder, ClientLike, Config as FredConfig};
    let url = stores::redis_url();
    let config = FredConfig::from_url(&url).map_err(|e| e.to_string())?;
    let pool = Builder::from_config(config)
        .build_pool(4)
        .map_err(|e| e.to_string())?;
    pool.init()
        .await
        .map_err(|e| format!("Redis unreachable at {url}: {e}"))?;
    let store = ruts::store::redis::RedisStore::new(Arc::new(pool))
        .await
        .map_err(|e| e.to_string())?;
    serve(peer_router(Arc::new(store))).await
}

/// Handler executions at `s` when each of [`DUP_KEYS`] new keys is sent by [`DUP_COPIES`]
/// identical requests at once, each on its own connection (the same session for the peer: one
/// client retrying).
async fn duplicates(s: &Server) -> Result<u64, String> {
    let mut senders = Vec::with_capacity(DUP_COPIES);
    for _ in 0..DUP_COPIES {
        senders.push(
            load::connect(s.addr)
                .await
                .map_err(|e| format!("connect: {e}"))?,
        );
    }
    let cookie = s.cookies.first().cloned();
    WORK_MS.store(DUP_WORK_MS, Ordering::Relaxed);
    let before = EXECUTIONS.load(Ordering::Relaxed);
    for k in 0..DUP_KEYS {
        let key = format!("dup-{k}");
        let barrier = Arc::new(tokio::sync::Barrier::new(DUP_COPIES));
        let tasks: Vec<_> = senders
            .drain(..)
            .map(|mut sender| {
                let (barrier, key, cookie, route, addr) = (
                    barrier.clone(),
                    key.clone(),
                    cookie.clone(),
                    s.route,
                    s.addr,
                );
                tokio::spawn(async move {
                    let mut request = load::post(route, &key);
                    if let Some(cookie) = cookie {
                        request.headers_mut().insert(COOKIE, cookie);
                    }
                    barrier.wait().await;
                    if load::send(&mut sender, request).await.is_none() {
                        // The connection failed: the next key gets a new one.
                        if let Ok(new) = load::connect(addr).await {
                            sender = new;
                        }
                    }
                    sender
                })
            })
            .collect();
        for task in tasks {
            match task.await {
                Ok(sender) => senders.push(sender),
                Err(e) => {
                    WORK_MS.store(0, Ordering::Relaxed);
                    return Err(e.to_string());
                }
            }
        }
    }
    let executions = EXECUTIONS.load(Ordering::Relaxed) - before;
    WORK_MS.store(0, Ordering::Relaxed);
    Ok(executions)
}
