//! Runs the real `payments` binary as child processes and talks to them over HTTP.
//!
//! Each [`Instance`] starts with `PORT=0` and is ready once it prints its
//! `payments listening on http://...` line; it is killed when dropped, also when the test panics
//! (then its log, kept in a temporary file, is printed to help read the failure).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Seek};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Bounds start-up, only to fail instead of hanging: an instance is ready as soon as it says so.
const START_BOUND: Duration = Duration::from_secs(120);

/// `{"amount": 1000, "currency": "KRW"}`.
pub(crate) const KRW_1000: &str = r#"{"amount": 1000, "currency": "KRW"}"#;

/// A running `payments` process.
pub(crate) struct Instance {
    child: Child,
    base: String,
    log: std::fs::File,
}

impl Drop for Instance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("--- log of the instance at {} ---", self.base);
            eprintln!("{}", read_log(&mut self.log));
        }
    }
}

fn read_log(log: &mut std::fs::File) -> String {
    let mut text = String::new();
    let _ = log.rewind();
    let _ = log.read_to_string(&mut text);
    text
}

impl Instance {
    /// Starts one instance with `env` (on top of `PORT=0`; `DATABASE_URL`, `IDEM_STORE_URL` and
    /// `PAYMENT_LATENCY_MS` are unset unless given) and waits until it accepts connections.
    pub(crate) fn start(env: &[(&str, &str)]) -> Self {
        Self::start_all(&[env]).pop().expect("one instance")
    }

    /// Starts one instance per entry of `envs`, all at once (so they migrate concurrently), and
    /// waits until each accepts connections.
    pub(crate) fn start_all(envs: &[&[(&str, &str)]]) -> Vec<Self> {
        let spawned: Vec<_> = envs.iter().map(|env| spawn(env)).collect();
        spawned
            .into_iter()
            .map(|(child, log, ready)| {
                let mut instance = Self {
                    child,
                    base: String::new(),
                    log,
                };
                match ready.recv_timeout(START_BOUND) {
                    Ok(Ok(base)) => instance.base = base,
                    Ok(Err(line)) => panic!(
                        "payments did not start: {line:?}\n{}",
                        read_log(&mut instance.log)
                    ),
                    Err(_) => panic!(
                        "payments did not start within {START_BOUND:?}\n{}",
                        read_log(&mut instance.log)
                    ),
                }
                instance
            })
            .collect()
    }

    /// `http://127.0.0.1:<port>`.
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// The log so far.
    pub(crate) fn log(&mut self) -> String {
        read_log(&mut self.log)
    }
}

type Ready = mpsc::Receiver<Result<String, String>>;

fn spawn(env: &[(&str, &str)]) -> (Child, std::fs::File, Ready) {
    let log = tempfile::tempfile().expect("log file");
    let mut command = Command::new(env!("CARGO_BIN_EXE_payments"));
    command
        .env_remove("DATABASE_URL")
        .env_remove("IDEM_STORE_URL")
        .env_remove("PAYMENT_LATENCY_MS")
        .env("PORT", "0")
        .env("RUST_LOG", "info,idem=debug")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log.try_clone().expect("log file"));
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command.spawn().expect("spawn the payments binary");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, ready) = mpsc::channel();
    // The first stdout line is the address; the thread then keeps the pipe open (and drained)
    // until the process exits.
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let _ = tx.send(
            first
                .strip_prefix("payments listening on ")
                .map(str::to_owned)
                .ok_or(first),
        );
        for _ in lines {}
    });
    (child, log, ready)
}

/// An HTTP reply, read to the end.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) headers: reqwest::header::HeaderMap,
    pub(crate) body: String,
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }

    pub(crate) fn replayed(&self) -> bool {
        self.header("idempotency-replayed") == Some("true")
    }
}

/// One client for a test; no retries of its own.
pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client")
}

/// `POST /payments` to `instance` as `user` with `key` and `body`.
pub(crate) async fn create(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    key: &str,
    body: &str,
) -> Reply {
    let response = client
        .post(format!("{}/payments", instance.base()))
        .bearer_auth(user)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .expect("POST /payments");
    read(response).await
}

/// `GET path` on `instance` as `user`.
pub(crate) async fn get(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
    path: &str,
) -> Reply {
    let response = client
        .get(format!("{}{path}", instance.base()))
        .bearer_auth(user)
        .send()
        .await
        .expect("GET");
    read(response).await
}

/// `user`'s payments according to `instance` (`GET /payments`).
pub(crate) async fn payments(
    client: &reqwest::Client,
    instance: &Instance,
    user: &str,
) -> Vec<serde_json::Value> {
    let reply = get(client, instance, user, "/payments").await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    reply.json().as_array().expect("an array").clone()
}

async fn read(response: reqwest::Response) -> Reply {
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.text().await.expect("body");
    Reply {
        status,
        headers,
        body,
    }
}

/// A fresh user id, so that tests sharing a store never see each other's payments.
pub(crate) fn fresh_user() -> String {
    format!("user-{}", uuid::Uuid::new_v4().simple())
}
