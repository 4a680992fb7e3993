//! A test kit that checks idem's contract on one of your own handlers, through your own `Router`.
//!
//! Give it the router (built on an [`Engine`] whose store runs on a [`ManualClock`]), the engine,
//! the clock, and a closure that builds one request of the handler for a [`Caller`]; it sends
//! requests the way clients and networks do and checks each [`Rule`]:
//!
//! | rule | what is sent | what must happen |
//! |---|---|---|
//! | [`Rule::RetryReplays`] | the request twice, one key | the retry gets the same status and body, with `Idempotency-Replayed: true`; the handler ran once |
//! | [`Rule::ConcurrentRunOnce`] | N identical requests at once | the handler ran once |
//! | [`Rule::OtherBodyRefused`] | another body under a used key | 422, the handler not run |
//! | [`Rule::MissingKeyPolicy`] | the request without a key | what the declared [`MissingKey`] policy says |
//! | [`Rule::CallersSeparate`] | a second caller reusing the first caller's key | it runs for the second caller, no replay of the first's response |
//! | [`Rule::HangUpRunsOnce`] | a request dropped while its handler runs, then the retry | the handler ran once; the retry replays |
//! | [`Rule::ExpiredKeyGone`] | the request again after the key's expiry (the clock moved) | 410, the handler not run |
//!
//! The handler's runs are counted through idem's own outcomes (the engine's [`metrics`](Engine::metrics))
//! or, better, through the effect itself: pass [`Contract::executions`] a closure that counts it
//! (rows written, charges made). The [`Report`] names every rule that failed in plain words;
//! [`Report::assert`] panics with that list.
//!
//! ```
//! use axum::{extract::FromRef, http::Request, body::Body, routing::post, Router};
//! use idem_runtime::clock::{ManualClock, Timestamp};
//! use idem_runtime::store::memory::MemoryStore;
//! use idem_runtime::testkit::{Caller, Contract};
//! use idem_runtime::{idempotent, Engine};
//!
//! #[derive(Clone, FromRef)]
//! struct App { engine: Engine }
//!
//! #[idempotent(scope = "global")]
//! async fn create(body: String) -> String { body }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let clock = ManualClock::new(Timestamp::from_millis(1_800_000_000_000));
//! let engine = Engine::new(MemoryStore::new().with_clock(clock.clone()));
//! let router = Router::new().route("/things", post(create)).with_state(App { engine: engine.clone() });
//!
//! Contract::new(router, engine)
//!     .clock(clock)
//!     // One caller only: the scope is global on purpose.
//!     .shared_scope()
//!     .check(|_caller: Caller| Request::post("/things").body(Body::from("one thing")).unwrap())
//!     .await
//!     .assert();
//! # }
//! ```

use crate::axum::{EXPIRES_HEADER, KEY_HEADER, REPLAYED_HEADER};
use crate::clock::{Clock, ManualClock, Timestamp};
use crate::metrics::Outcome;
use crate::policy::MissingKey;
use crate::Engine;
use ::axum::body::{Body, Bytes};
use ::axum::http::{HeaderValue, Request, StatusCode};
use ::axum::Router;
use http_body_util::BodyExt;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tower_service::Service;

/// How long the kit waits for any one request or event before it calls the rule failed.
const PATIENCE: Duration = Duration::from_secs(30);

/// Which of two distinct callers a request is sent as (for the scope rule): build the request with
/// that caller's credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Caller {
    /// The caller every rule uses.
    First,
    /// Another caller, used by [`Rule::CallersSeparate`] only.
    Second,
}

impl Caller {
    /// A name for the caller, usable as a user id: `idem-testkit-first` or `idem-testkit-second`.
    pub fn name(self) -> &'static str {
        match self {
            Caller::First => "idem-testkit-first",
            Caller::Second => "idem-testkit-second",
        }
    }
}

/// One part of idem's contract, checked on a handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Rule {
    /// An identical retry gets the stored response, marked as a replay, and the handler runs once.
    RetryReplays,
    /// Identical requests sent at once run the handler once.
    ConcurrentRunOnce,
    /// The key reused with another body is refused with 422.
    OtherBodyRefused,
    /// A request without a key is treated as the handler's declared policy says.
    MissingKeyPolicy,
    /// Two callers using the same key do not meet: each runs, neither gets the other's response.
    CallersSeparate,
    /// A client that hangs up while the handler runs does not stop it; the retry replays.
    HangUpRunsOnce,
    /// A key past its ttl answers 410 Gone instead of running again.
    ExpiredKeyGone,
}

impl Rule {
    /// Every rule, in the order [`Contract::check`] runs them.
    pub const ALL: &'static [Rule] = &[
        Rule::RetryReplays,
        Rule::ConcurrentRunOnce,
        Rule::OtherBodyRefused,
        Rule::MissingKeyPolicy,
        Rule::CallersSeparate,
        Rule::HangUpRunsOnce,
        Rule::ExpiredKeyGone,
    ];

    /// The rule in a sentence.
    pub fn describe(self) -> &'static str {
        match self {
            Rule::RetryReplays => "a retry with the same key replays the first response",
            Rule::ConcurrentRunOnce => "identical requests sent at once run the handler once",
            Rule::OtherBodyRefused => "the same key with another body is refused (422)",
            Rule::MissingKeyPolicy => "a request without a key follows the declared policy",
            Rule::CallersSeparate => "two callers' keys never meet",
            Rule::HangUpRunsOnce => {
                "a client hanging up mid-handler still runs it once, and the retry replays"
            }
            Rule::ExpiredKeyGone => "a key past its ttl answers 410 Gone",
        }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// What checking one rule found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The handler keeps the rule.
    Passed,
    /// The handler breaks the rule: what was seen, in words.
    Failed(String),
    /// The rule was not checked: why (a test clock not given, say).
    Skipped(String),
}

/// Every rule's verdict for one handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The verdicts, in [`Rule::ALL`]'s order.
    pub verdicts: Vec<(Rule, Verdict)>,
}

impl Report {
    /// The rules the handler breaks.
    pub fn failed(&self) -> Vec<Rule> {
        self.verdicts
            .iter()
            .filter(|(_, v)| matches!(v, Verdict::Failed(_)))
            .map(|(rule, _)| *rule)
            .collect()
    }

    /// Whether every checked rule passed.
    pub fn passed(&self) -> bool {
        self.failed().is_empty()
    }

    /// The verdict on `rule`.
    pub fn verdict(&self, rule: Rule) -> Option<&Verdict> {
        self.verdicts
            .iter()
            .find(|(r, _)| *r == rule)
            .map(|(_, verdict)| verdict)
    }

    /// Panics, listing each broken rule and what was seen, unless every checked rule passed.
    #[track_caller]
    pub fn assert(&self) {
        if !self.passed() {
            panic!("{self}");
        }
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let failed = self.failed().len();
        if failed == 0 {
            writeln!(f, "the handler keeps idem's contract:")?;
        } else {
            writeln!(f, "the handler breaks {failed} of idem's rules:")?;
        }
        for (rule, verdict) in &self.verdicts {
            match verdict {
                Verdict::Passed => writeln!(f, "  ok      {rule}")?,
                Verdict::Failed(why) => writeln!(f, "  FAILED  {rule}: {why}")?,
                Verdict::Skipped(why) => writeln!(f, "  skipped {rule}: {why}")?,
            }
        }
        Ok(())
    }
}

type Count = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = u64> + Send>> + Send + Sync>;

/// The contract to check on one handler: the router, what the handler declares, and how to count
/// its runs. Build it, then [`check`](Contract::check) it with the handler's request.
pub struct Contract {
    router: Router,
    engine: Engine,
    clock: Option<ManualClock>,
    executions: Option<Count>,
    missing_key: MissingKey,
    per_caller: bool,
    concurrency: usize,
}

impl fmt::Debug for Contract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Contract")
            .field("missing_key", &self.missing_key)
            .field("per_caller", &self.per_caller)
            .field("concurrency", &self.concurrency)
            .finish_non_exhaustive()
    }
}

impl Contract {
    /// The contract for a handler of `router`, whose idempotency runs on `engine` (the one in the
    /// router's state). By default the handler must require a key ([`MissingKey::Reject`]) and
    /// scope keys per caller.
    pub fn new(router: Router, engine: Engine) -> Self {
        Self {
            router,
            engine,
            clock: None,
            executions: None,
            missing_key: MissingKey::Reject,
            per_caller: true,
            concurrency: 8,
        }
    }

    /// The clock the engine's store judges time by ([`MemoryStore::with_clock`] and the other
    /// stores' `with_clock`): the kit moves it past a key's expiry for [`Rule::ExpiredKeyGone`],
    /// which is skipped without it. The kit only moves it forward.
    ///
    /// [`MemoryStore::with_clock`]: crate::store::memory::MemoryStore::with_clock
    pub fn clock(mut self, clock: ManualClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Counts the handler's runs by their effect (rows, charges, calls) instead of idem's outcomes:
    /// `count` returns the total so far. This also catches a handler whose effect escapes its claim.
    pub fn executions<F, Fut>(mut self, count: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = u64> + Send + 'static,
    {
        self.executions = Some(Arc::new(move || Box::pin(count())));
        self
    }

    /// The handler's declared policy for requests without a key (default: [`MissingKey::Reject`]).
    pub fn missing_key(mut self, policy: MissingKey) -> Self {
        self.missing_key = policy;
        self
    }

    /// The handler serves one caller (`scope = "global"` on purpose): [`Rule::CallersSeparate`]
    /// is skipped.
    pub fn shared_scope(mut self) -> Self {
        self.per_caller = false;
        self
    }

    /// How many identical requests [`Rule::ConcurrentRunOnce`] sends at once (default 8, at
    /// least 2).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(2);
        self
    }

    /// Checks every rule with requests built by `request` (without an `Idempotency-Key`: the kit
    /// sets it, a fresh one per rule), and reports. Rules run one after the other; the expiry rule
    /// runs last, as it moves the clock.
    pub async fn check<F>(self, request: F) -> Report
    where
        F: Fn(Caller) -> Request<Body>,
    {
        let mut verdicts = Vec::new();
        for &rule in Rule::ALL {
            let verdict = match tokio::time::timeout(PATIENCE, self.rule(rule, &request)).await {
                Ok(Ok(())) => Verdict::Passed,
                Ok(Err(Broken::Failed(why))) => Verdict::Failed(why),
                Ok(Err(Broken::Skipped(why))) => Verdict::Skipped(why),
                Err(_) => Verdict::Failed(format!(
                    "no answer within {}s (a request or the handler hangs)",
                    PATIENCE.as_secs()
                )),
            };
            verdicts.push((rule, verdict));
        }
        Report { verdicts }
    }

    async fn rule<F>(&self, rule: Rule, request: &F) -> Result<(), Broken>
    where
        F: Fn(Caller) -> Request<Body>,
    {
        match rule {
            Rule::RetryReplays => self.retry_replays(request).await,
            Rule::ConcurrentRunOnce => self.concurrent_run_once(request).await,
            Rule::OtherBodyRefused => self.other_body_refused(request).await,
            Rule::MissingKeyPolicy => self.missing_key_policy(request).await,
            Rule::CallersSeparate => self.callers_separate(request).await,
            Rule::HangUpRunsOnce => self.hang_up_runs_once(request).await,
            Rule::ExpiredKeyGone => self.expired_key_gone(request).await,
        }
    }

    async fn retry_replays<F: Fn(Caller) -> Request<Body>>(
        &self,
        request: &F,
    ) -> Result<(), Broken> {
        let key = fresh_key();
        let before = self.runs().await;
        let first = self.send(keyed(request(Caller::First), Some(&key))).await?;
        let retry = self.send(keyed(request(Caller::First), Some(&key))).await?;
        let ran = self.runs().await - before;
        first.must_succeed()?;
        if !retry.replayed() {
            return fail(format!(
                "the retry was answered {} without `Idempotency-Replayed: true`: it was not replayed \
                 (is the handler missing `#[idempotent]`, or its route the `IdempotencyLayer`?)",
                retry.status
            ));
        }
        if retry.status != first.status || retry.body != first.body {
            return fail(format!(
                "the replay differs from the first response: {} {:?} first, {} {:?} replayed",
                first.status,
                preview(&first.body),
                retry.status,
                preview(&retry.body)
            ));
        }
        expect_runs(ran, 1, "for a request and its retry")
    }

    async fn concurrent_run_once<F: Fn(Caller) -> Request<Body>>(
        &self,
        request: &F,
    ) -> Result<(), Broken> {
        let key = fresh_key();
        let before = self.runs().await;
        let sends: Vec<_> = (0..self.concurrency)
            .map(|_| {
                let req = keyed(request(Caller::First), Some(&key));
                let router = self.router.clone();
                tokio::spawn(send(router, req))
            })
            .collect();
        for sent in sends {
            match sent.await {
                Ok(reply) => drop(reply?),
                Err(e) => return fail(format!("a request task failed: {e}")),
            }
        }
        let ran = self.runs().await - before;
        expect_runs(
            ran,
            1,
            &format!("for {} identical requests sent at once", self.concurrency),
        )
    }

    async fn other_body_refused<F: Fn(Caller) -> Request<Body>>(
        &self,
        request: &F,
    ) -> Result<(), Broken> {
        let key = fresh_key();
        self.send(keyed(request(Caller::First), Some(&key)))
            .await?
            .must_succeed()?;
        let before = self.runs().await;
        let other = other_body(keyed(request(Caller::First), Some(&key))).await?;
        let reply = self.send(other).await?;
        let ran = self.runs().await - before;
        if reply.status != StatusCode::UNPROCESSABLE_ENTITY {
            return fail(format!(
                "another body under a used key was answered {} instead of 422: the key does not \
                 bind its request",
                reply.status
            ));
        }
        expect_runs(ran, 0, "for another body under a used key")
    }

    async fn missing_key_policy<F: Fn(Caller) -> Request<Body>>(
        &self,
        request: &F,
    ) -> Result<(), Broken> {
        let before = self.runs().await;
        let first = self.send(keyed(request(Caller::First), None)).await?;
        let second = self.send(keyed(request(Caller::First), None)).await?;
        let ran = self.runs().await - before;
        match self.missing_key {
            MissingKey::Reject => {
                if first.status != StatusCode::BAD_REQUEST {
                    return fail(format!(
                        "the handler is declared to require a key, but a request without one was \
                         answered {} instead of 400 (is it `missing_key = \"pass\"`, or unprotected?)",
                        first.status
                    ));
                }
                expect_runs(ran, 0, "for requests without a key, which must be refused")
            }
            MissingKey::Pass => {
                first.must_succeed()?;
                if second.replayed() {
                    return fail(
                        "a request without a key was replayed; declared `pass`, it must run unprotected"
                            .to_owned(),
                    );
                }
                expect_runs(ran, 2, "for two requests without a key, declared `pass`")
            }
            MissingKey::Derive => {
                first.must_succeed()?;
                if !second.replayed() {
                    return fail(format!(
                        "an identical request without a key was answered {} without a replay; \
                         declared `derive`, a double tap must run once",
                        second.status
                    ));
                }
                expect_runs(ran, 1, "for a double tap without a key, declared `derive`")
            }
        }
    }

    async fn callers_separate<F: Fn(Caller) -> Request<Body>>(
        &self,
        request: &F,
    ) -> Result<(), Broken> {
        if !self.per_caller {
            return Err(Broken::Skipped(
                "declared as serving one caller (`shared_scope`)".to_owned(),
            ));
        }
        let key = fresh_key();
        self.send(keyed(request(Caller::First), Some(&key)))
            .await?
            .must_succeed()?;
        let before = self.runs().await;
        let second = self
            .send(keyed(request(Caller::Second), Some(&key)))
            .await?;
        let ran = self.runs().await - before;
        if second.replayed() || second.status == StatusCode::UNPROCESSABLE_ENTITY {
            return fail(format!(
                "a second caller using the first caller's key got {}{}: both callers share one key \
                 space (`scope = \"global\"` on a per-caller endpoint?), so one caller can be answered \
                 with another's response",
                second.status,
                if second.replayed() {
                    ", a replay of the first caller's response"
                } else {
                    ""
                }
            ));
        }
        second.must_succeed()?;
        expect_runs(ran, 1, "for the second caller's request")
    }

    async fn hang_up_runs_once<F: Fn(Caller) -> Request<Body>>(
        &self,
        request: &F,
    ) -> Result<(), Broken> {
        let key = fresh_key();
        let before = self.runs().await;
        let claimed_before = self.claimed();
        let mut first = tokio::spawn(send(
            self.router.clone(),
            keyed(request(Caller::First), Some(&key)),
        ));
        // Hang up as soon as idem has claimed the key for the handler (or the answer is in).
        loop {
            if self.claimed() > claimed_before || first.is_finished() {
                break;
            }
            tokio::select! {
                _ = &mut first => break,
                () = tokio::task::yield_now() => {}
            }
        }
        first.abort();
        let retry = self.send(keyed(request(Caller::First), Some(&key))).await?;
        let ran = self.runs().await - before;
        if !retry.replayed() {
            return fail(format!(
                "after the client hung up, its retry was answered {} without a replay",
                retry.status
            ));
        }
        expect_runs(ran, 1, "for a request whose client hung up, and its retry")
    }

    async fn expired_key_gone<F: Fn(Caller) -> Request<Body>>(
        &self,
        request: &F,
    ) -> Result<(), Broken> {
        let Some(clock) = &self.clock else {
            return Err(Broken::Skipped(
                "no test clock given (`Contract::clock`): the kit cannot move time past the ttl"
                    .to_owned(),
            ));
        };
        let key = fresh_key();
        let first = self.send(keyed(request(Caller::First), Some(&key))).await?;
        first.must_succeed()?;
        let Some(expires) = first.expires() else {
            return fail(
                "the response carries no `Idempotency-Expires`: it was not stored under its key"
                    .to_owned(),
            );
        };
        // The header has whole seconds: one more is past the expiry, and well within retention.
        let now = clock.now();
        clock.advance(now.until(expires) + Duration::from_secs(1));
        let before = self.runs().await;
        let late = self.send(keyed(request(Caller::First), Some(&key))).await?;
        let ran = self.runs().await - before;
        if late.status != StatusCode::GONE {
            let hint = if late.replayed() {
                " (it was replayed: is the clock given to `Contract::clock` the one the store \
                 judges time by, `with_clock`?)"
            } else {
                ""
            };
            return fail(format!(
                "a retry after the key's ttl was answered {} instead of 410 Gone{hint}",
                late.status
            ));
        }
        expect_runs(ran, 0, "for a retry after the ttl")
    }

    /// The handler's runs so far: the caller's count, or idem's claims for it.
    async fn runs(&self) -> u64 {
        match &self.executions {
            Some(count) => count().await,
            None => self.claimed(),
        }
    }

    /// How many times idem gave the key to the handler (fresh claims, takeovers, keyless passes).
    fn claimed(&self) -> u64 {
        let metrics = self.engine.metrics();
        metrics.get(Outcome::Executed)
            + metrics.get(Outcome::TakenOver)
            + metrics.get(Outcome::MissingKeyPassed)
    }

    async fn send(&self, request: Request<Body>) -> Result<Reply, Broken> {
        send(self.router.clone(), request).await
    }
}

/// Why a rule did not pass.
#[derive(Debug)]
enum Broken {
    Failed(String),
    Skipped(String),
}

fn fail(why: String) -> Result<(), Broken> {
    Err(Broken::Failed(why))
}

fn expect_runs(ran: u64, expected: u64, when: &str) -> Result<(), Broken> {
    if ran == expected {
        return Ok(());
    }
    let times = |n: u64| {
        if n == 1 {
            "once".to_owned()
        } else {
            format!("{n} times")
        }
    };
    fail(format!(
        "the handler ran {} {when}, expected {}",
        times(ran),
        times(expected)
    ))
}

/// A response, read whole.
#[derive(Debug)]
struct Reply {
    status: StatusCode,
    replayed: bool,
    expires: Option<String>,
    body: Bytes,
}

impl Reply {
    fn replayed(&self) -> bool {
        self.replayed
    }

    fn expires(&self) -> Option<Timestamp> {
        let at = httpdate::parse_http_date(self.expires.as_deref()?).ok()?;
        let ms = at.duration_since(UNIX_EPOCH).ok()?.as_millis();
        Some(Timestamp::from_millis(i64::try_from(ms).ok()?))
    }

    /// The first request must succeed, or nothing else about the handler can be judged.
    fn must_succeed(&self) -> Result<(), Broken> {
        if self.status.is_success() || self.status.is_redirection() {
            return Ok(());
        }
        fail(format!(
            "the request the test builds was answered {} {:?}; build one the handler accepts",
            self.status,
            preview(&self.body)
        ))
    }
}

async fn send(mut router: Router, request: Request<Body>) -> Result<Reply, Broken> {
    let ready = std::future::poll_fn(|cx| Service::<Request<Body>>::poll_ready(&mut router, cx));
    let response = match ready.await {
        Ok(()) => router.call(request).await,
        Err(e) => match e {},
    };
    let response = match response {
        Ok(response) => response,
        Err(e) => match e {},
    };
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| Broken::Failed(format!("the response body failed: {e}")))?
        .to_bytes();
    let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    Ok(Reply {
        status: parts.status,
        replayed: header(REPLAYED_HEADER) == Some("true"),
        expires: header(EXPIRES_HEADER).map(str::to_owned),
        body,
    })
}

/// `request` with `key` as its only `Idempotency-Key` (or none).
fn keyed(mut request: Request<Body>, key: Option<&str>) -> Request<Body> {
    let headers = request.headers_mut();
    headers.remove(KEY_HEADER);
    if let Some(value) = key.and_then(|key| HeaderValue::from_str(key).ok()) {
        headers.insert(KEY_HEADER, value);
    }
    request
}

/// `request` with another body: a JSON object gets one more member, anything else one more line.
async fn other_body(request: Request<Body>) -> Result<Request<Body>, Broken> {
    let (mut parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| Broken::Failed(format!("the request body failed: {e}")))?
        .to_bytes();
    let other = match serde_json::from_slice::<serde_json::Value>(&body) {
        Ok(serde_json::Value::Object(mut object)) => {
            object.insert("idem_testkit_other".to_owned(), true.into());
            serde_json::to_vec(&object).unwrap_or_default()
        }
        _ => [&body[..], b"\nidem-testkit: another body"].concat(),
    };
    parts.headers.remove(::axum::http::header::CONTENT_LENGTH);
    Ok(Request::from_parts(parts, Body::from(other)))
}

/// A key no earlier run of the kit used, even against a store that outlives the test.
fn fresh_key() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "idem-testkit-{nanos:x}-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The start of a body, for messages.
fn preview(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    match text.char_indices().nth(120) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.into_owned(),
    }
}
