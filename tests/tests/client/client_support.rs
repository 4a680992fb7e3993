//! A fault-injecting HTTP server for the client tests: an in-process axum app on an ephemeral
//! 127.0.0.1 port that answers from a script (statuses, `Retry-After`, problem documents, chunked
//! or cut mid-body), drops the connection after doing the work, or never answers. [`Caller`] sends
//! through either form of idem's client (the plain [`Client`] or the reqwest-middleware stack), so
//! every scenario runs against both; [`Spans`] records the client's tracing spans.
//!
//! It runs in the test's own runtime. The client tests use tokio's paused clock, which jumps to the
//! next timer whenever the runtime has nothing to do; tokio checks for ready I/O first, and a server
//! in the same runtime on loopback always has its bytes ready, so time moves only while both sides
//! wait on a timer (a backoff or `Retry-After` sleep, a hung request's timeout). A server on another
//! thread would make every in-flight request look idle and fire the client's timers at once.
#![allow(dead_code, unreachable_pub)]

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, post};
use axum::Router;
use idem_runtime::client::{reqwest, reqwest_middleware, Client, ClientBuilder, Error, KeyChoice};
use idem_runtime::IdempotencyKey;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

/// How an answer's body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// With `Content-Length`.
    Length,
    /// `Transfer-Encoding: chunked`, as a proxy that re-chunks (or compresses) sends it.
    Chunked,
    /// `Content-Length` announced, half the body sent, then the connection dropped.
    CutMidBody,
}

/// What the server does with one request.
#[derive(Debug, Clone)]
pub enum Step {
    /// Answer with this status, headers and body.
    Reply {
        status: u16,
        headers: Vec<(String, String)>,
        body: String,
        framing: Framing,
    },
    /// Do the work (on `/payments`: record the payment), then drop the connection without answering.
    DropAfterEffect,
    /// Never answer.
    Hang,
}

impl Step {
    pub fn status(status: u16) -> Self {
        Self::Reply {
            status,
            headers: Vec::new(),
            body: String::new(),
            framing: Framing::Length,
        }
    }

    /// This body.
    pub fn body(mut self, text: impl Into<String>) -> Self {
        if let Self::Reply { body, .. } = &mut self {
            *body = text.into();
        }
        self
    }

    /// The body goes out chunked.
    pub fn chunked(self) -> Self {
        self.framed(Framing::Chunked)
    }

    /// Half the body goes out, then the connection drops (on `/payments`: after the effect).
    pub fn cut_mid_body(self) -> Self {
        self.framed(Framing::CutMidBody)
    }

    fn framed(mut self, to: Framing) -> Self {
        if let Self::Reply { framing, .. } = &mut self {
            *framing = to;
        }
        self
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        if let Self::Reply { headers, .. } = &mut self {
            headers.push((name.to_owned(), value.into()));
        }
        self
    }

    /// A problem+json answer with this `type`.
    pub fn problem(status: u16, problem_type: &str) -> Self {
        let body = serde_json::json!({
            "type": problem_type,
            "title": "scripted problem",
            "status": status,
        })
        .to_string();
        Self::Reply {
            status,
            headers: vec![("content-type".into(), "application/problem+json".into())],
            body,
            framing: Framing::Length,
        }
    }
}

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    /// The raw `Idempotency-Key` header, if sent.
    pub key: Option<String>,
    /// When it arrived, on tokio's (paused) clock.
    pub at: Instant,
}

struct Payment {
    id: u64,
    effects: u32,
}

struct ServerState {
    script: Mutex<VecDeque<Step>>,
    default: Step,
    seen: Mutex<Vec<Seen>>,
    /// Set by a handler: the next write on any connection fails, so hyper drops the connection
    /// before a byte of the answer leaves.
    kill_next_write: Arc<AtomicBool>,
    payments: Mutex<HashMap<String, Payment>>,
}

/// A running fault server.
pub struct FaultServer {
    addr: SocketAddr,
    state: Arc<ServerState>,
}

impl FaultServer {
    /// Starts a server that follows `script`, then repeats `default` forever.
    pub async fn start(script: impl IntoIterator<Item = Step>, default: Step) -> Self {
        let kill = Arc::new(AtomicBool::new(false));
        let state = Arc::new(ServerState {
            script: Mutex::new(script.into_iter().collect()),
            default,
            seen: Mutex::new(Vec::new()),
            kill_next_write: kill.clone(),
            payments: Mutex::new(HashMap::new()),
        });
        let app = Router::new()
            .route("/scripted", any(scripted))
            .route("/payments", post(create_payment))
            .with_state(state.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let listener = KillableListener {
            inner: listener,
            kill,
        };
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { addr, state }
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Every request seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    /// How many times the payment for `key` was executed (0 if never).
    pub fn effects(&self, key: &str) -> u32 {
        self.state
            .payments
            .lock()
            .unwrap()
            .get(key)
            .map_or(0, |p| p.effects)
    }

    /// How many payments exist.
    pub fn payments(&self) -> usize {
        self.state.payments.lock().unwrap().len()
    }
}

fn record(state: &ServerState, method: Method, uri: &Uri, headers: &HeaderMap) -> Option<String> {
    let key = headers
        .get("idempotency-key")
        .map(|v| v.to_str().unwrap().to_owned());
    state.seen.lock().unwrap().push(Seen {
        method,
        path: uri.path().to_owned(),
        key: key.clone(),
        at: Instant::now(),
    });
    key
}

fn next_step(state: &ServerState) -> Step {
    let next = state.script.lock().unwrap().pop_front();
    next.unwrap_or_else(|| state.default.clone())
}

fn reply(status: u16, headers: Vec<(String, String)>, body: String, framing: Framing) -> Response {
    let length = body.len();
    let body = match framing {
        Framing::Length => Body::from(body),
        Framing::Chunked => {
            Body::from_stream(futures_util::stream::iter([Ok::<_, io::Error>(body)]))
        }
        Framing::CutMidBody => {
            use futures_util::StreamExt as _;
            let half = body[..length / 2].to_owned();
            // Pending once after the first half, so hyper flushes the head and that half before
            // the error makes it drop the connection.
            let cut = futures_util::stream::once(async {
                tokio::task::yield_now().await;
                Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "fault injected: body cut",
                ))
            });
            Body::from_stream(futures_util::stream::iter([Ok(half)]).chain(cut))
        }
    };
    let mut response = (StatusCode::from_u16(status).unwrap(), body).into_response();
    if framing == Framing::CutMidBody {
        response
            .headers_mut()
            .insert("content-length", length.to_string().parse().unwrap());
    }
    for (name, value) in headers {
        response.headers_mut().insert(
            axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            value.parse().unwrap(),
        );
    }
    response
}

async fn scripted(
    State(state): State<Arc<ServerState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    record(&state, method, &uri, &headers);
    match next_step(&state) {
        Step::Reply {
            status,
            headers,
            body,
            framing,
        } => reply(status, headers, body, framing),
        Step::DropAfterEffect => {
            state.kill_next_write.store(true, Ordering::SeqCst);
            StatusCode::OK.into_response()
        }
        Step::Hang => std::future::pending().await,
    }
}

/// A hand-written idempotent create: the first request with a key records a payment (the effect)
/// and stores its answer; later ones with the key replay it with `Idempotency-Replayed: true`. A
/// scripted 5xx is answered before the effect (as idem releases the key on 5xx).
async fn create_payment(
    State(state): State<Arc<ServerState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let Some(key) = record(&state, method, &uri, &headers) else {
        return reply(
            400,
            Vec::new(),
            "Idempotency-Key required".into(),
            Framing::Length,
        );
    };
    let replay = state.payments.lock().unwrap().get(&key).map(|p| p.id);
    if let Some(id) = replay {
        return created(id, true, Framing::Length);
    }
    let step = next_step(&state);
    let drop_after = matches!(step, Step::DropAfterEffect);
    let framing = match step {
        Step::Reply {
            status,
            headers,
            body,
            framing,
        } if status >= 500 => return reply(status, headers, body, framing),
        Step::Hang => return std::future::pending().await,
        Step::Reply { framing, .. } => framing,
        Step::DropAfterEffect => Framing::Length,
    };
    let id = {
        let mut payments = state.payments.lock().unwrap();
        let id = payments.len() as u64 + 1;
        let payment = payments.entry(key).or_insert(Payment { id, effects: 0 });
        payment.effects += 1;
        payment.id
    };
    if drop_after {
        state.kill_next_write.store(true, Ordering::SeqCst);
    }
    created(id, false, framing)
}

fn created(id: u64, replayed: bool, framing: Framing) -> Response {
    let mut headers = vec![
        ("location".to_owned(), format!("/payments/{id}")),
        ("content-type".to_owned(), "application/json".to_owned()),
    ];
    if replayed {
        headers.push(("idempotency-replayed".to_owned(), "true".to_owned()));
    }
    let body =
        serde_json::json!({ "id": id, "amount": 1000, "currency": "KRW", "status": "captured" });
    reply(201, headers, body.to_string(), framing)
}

struct KillableListener {
    inner: TcpListener,
    kill: Arc<AtomicBool>,
}

impl axum::serve::Listener for KillableListener {
    type Io = KillableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (stream, addr) = self.inner.accept().await.unwrap();
        let io = KillableStream {
            inner: stream,
            kill: self.kill.clone(),
        };
        (io, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A TCP stream whose next write fails once the kill flag is set: hyper then closes the connection
/// without sending the answer, which is what a crash after the commit looks like to the client.
struct KillableStream {
    inner: TcpStream,
    kill: Arc<AtomicBool>,
}

impl AsyncRead for KillableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for KillableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.kill.swap(false, Ordering::SeqCst) {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "fault injected: connection dropped before the answer",
            )));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Which form of idem's client a scenario runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// `idem_runtime::client::Client`.
    Plain,
    /// `RetryMiddleware` in a `reqwest_middleware::ClientWithMiddleware`.
    Middleware,
}

impl Form {
    pub const BOTH: [Form; 2] = [Form::Plain, Form::Middleware];
}

/// A client of either form, built from one `ClientBuilder`.
#[derive(Clone)]
pub enum Caller {
    Plain(Client),
    Middleware(reqwest_middleware::ClientWithMiddleware),
}

impl Caller {
    pub fn new(form: Form, builder: ClientBuilder) -> Self {
        match form {
            Form::Plain => Self::Plain(builder.build().unwrap()),
            Form::Middleware => Self::Middleware(
                reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
                    .with(builder.build_middleware())
                    .build(),
            ),
        }
    }

    pub fn request(&self, method: Method, url: impl AsRef<str>) -> Call {
        let url = url.as_ref();
        match self {
            Self::Plain(c) => Call::Plain(c.request(method, url)),
            Self::Middleware(c) => Call::Middleware(c.request(method, url)),
        }
    }

    pub fn get(&self, url: impl AsRef<str>) -> Call {
        self.request(Method::GET, url)
    }

    pub fn post(&self, url: impl AsRef<str>) -> Call {
        self.request(Method::POST, url)
    }

    pub fn patch(&self, url: impl AsRef<str>) -> Call {
        self.request(Method::PATCH, url)
    }
}

/// A request of either form, with the plain client's key methods.
pub enum Call {
    Plain(idem_runtime::client::RequestBuilder),
    Middleware(reqwest_middleware::RequestBuilder),
}

impl Call {
    pub fn json(self, body: &serde_json::Value) -> Self {
        match self {
            Self::Plain(b) => Self::Plain(b.json(body)),
            Self::Middleware(b) => Self::Middleware(b.json(body)),
        }
    }

    pub fn body(self, body: &'static str) -> Self {
        match self {
            Self::Plain(b) => Self::Plain(b.body(body)),
            Self::Middleware(b) => Self::Middleware(b.body(body)),
        }
    }

    pub fn header(self, name: &'static str, value: &'static str) -> Self {
        match self {
            Self::Plain(b) => Self::Plain(b.header(name, value)),
            Self::Middleware(b) => Self::Middleware(b.header(name, value)),
        }
    }

    pub fn key(self, choice: KeyChoice) -> Self {
        match (self, choice) {
            (Self::Plain(b), KeyChoice::Given(key)) => Self::Plain(b.idempotency_key(key)),
            (Self::Plain(b), KeyChoice::Generate) => Self::Plain(b.with_idempotency_key()),
            (Self::Plain(b), _) => Self::Plain(b.without_idempotency_key()),
            (Self::Middleware(b), choice) => Self::Middleware(b.with_extension(choice)),
        }
    }

    pub fn idempotency_key(self, key: IdempotencyKey) -> Self {
        self.key(KeyChoice::Given(key))
    }

    pub fn without_idempotency_key(self) -> Self {
        self.key(KeyChoice::Omit)
    }

    pub async fn send(self) -> Result<idem_runtime::client::Response, Error> {
        match self {
            Self::Plain(b) => b.send().await,
            Self::Middleware(b) => match b.send().await {
                Ok(response) => Ok(response.into()),
                Err(e) => Err(Error::from_middleware(e).expect("the middleware's own error")),
            },
        }
    }
}

/// The fields the client's spans recorded, by span name, in the order the spans were created.
#[derive(Clone, Default)]
pub struct Spans(Arc<Mutex<Vec<(&'static str, FieldValues)>>>);

type FieldValues = HashMap<&'static str, String>;

struct Index(usize);

impl Spans {
    /// Records the spans of everything run on this thread until the guard drops.
    pub fn capture() -> (Self, tracing::subscriber::DefaultGuard) {
        use tracing_subscriber::layer::SubscriberExt as _;
        let spans = Self::default();
        let subscriber = tracing_subscriber::registry().with(spans.clone());
        (spans, tracing::subscriber::set_default(subscriber))
    }

    /// `field` of every span named `name`, in order (`None` where it was not recorded).
    pub fn field(&self, name: &str, field: &str) -> Vec<Option<String>> {
        let spans = self.0.lock().unwrap();
        let named = spans.iter().filter(|(n, _)| *n == name);
        named
            .map(|(_, fields)| fields.get(field).cloned())
            .collect()
    }
}

struct Fields<'a>(&'a mut FieldValues);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
}

impl<S> tracing_subscriber::Layer<S> for Spans
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let mut spans = self.0.lock().unwrap();
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        spans.push((attrs.metadata().name(), fields));
        let span = ctx.span(id).unwrap();
        span.extensions_mut().insert(Index(spans.len() - 1));
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let span = ctx.span(id).unwrap();
        let Some(Index(i)) = span.extensions().get::<Index>().map(|i| Index(i.0)) else {
            return;
        };
        values.record(&mut Fields(&mut self.0.lock().unwrap()[i].1));
    }
}
