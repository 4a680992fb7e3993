//! Run with: cargo run -p pay-client
//!
//! (with the payments example running in another terminal: `cargo run -p payments`).
//!
//! Pays 1000 KRW through the payments example's API with idem's retrying client, and shows what
//! makes the retry safe:
//!
//! 1. The payment goes through a small proxy that loses the first answer on its way back (the
//!    server charged, the client heard nothing). The client retries with the same
//!    `Idempotency-Key`, and the server answers the retry with the stored result:
//!    `Idempotency-Replayed: true`, the same `Location`, no second charge.
//! 2. The same key sent again later (say after a restart that kept the key with the order) is
//!    replayed too.
//! 3. The payment behind `Location` exists once.
//!
//! Environment: `PAYMENTS_URL` (default `http://127.0.0.1:3000`), `PAY_USER` (default `alice`; the
//! demo server takes the bearer token as the user id).

use idem_runtime::client::{Client, Response};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pay-client: {e}");
            eprintln!("(is the payments example running? start it with: cargo run -p payments)");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let base = std::env::var("PAYMENTS_URL").unwrap_or_else(|_| "http://127.0.0.1:3000".into());
    let base = base.trim_end_matches('/').to_owned();
    let user = std::env::var("PAY_USER").unwrap_or_else(|_| "alice".into());
    let upstream = idem_runtime::client::reqwest::Url::parse(&base)?;
    let upstream = upstream
        .socket_addrs(|| Some(80))?
        .into_iter()
        .next()
        .ok_or("PAYMENTS_URL names no address")?;
    // Fail with a plain message if nothing listens, rather than through the proxy.
    TcpStream::connect(upstream)
        .await
        .map_err(|e| format!("cannot reach {base}: {e}"))?;
    let client = Client::builder().build()?;
    let body = serde_json::json!({ "amount": 1000, "currency": "KRW" });

    println!("1. POST {base}/payments through a proxy that loses the first answer");
    let proxy = lossy_proxy(upstream).await?;
    let first = client
        .post(format!("http://{proxy}/payments"))
        .bearer_auth(&user)
        .json(&body)
        .send()
        .await?;
    show(&first);
    let key = first.key().cloned().ok_or("the client sent no key")?;
    let location = header(&first, "location");

    println!("2. POST {base}/payments again with the same key");
    let again = client
        .post(format!("{base}/payments"))
        .bearer_auth(&user)
        .idempotency_key(key)
        .json(&body)
        .send()
        .await?;
    show(&again);

    println!("3. GET {base}{location}");
    let payment = client
        .get(format!("{base}{location}"))
        .bearer_auth(&user)
        .send()
        .await?;
    println!("   {} {}", payment.status(), payment.text().await?);

    let same_place = header(&again, "location") == location;
    if first.status().is_success() && first.replayed() && again.replayed() && same_place {
        println!("One payment, three answers: the retries were replayed, not charged again.");
        Ok(())
    } else {
        Err("expected both retries to be replayed with the same Location".into())
    }
}

fn header(response: &Response, name: &str) -> String {
    response
        .headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned()
}

fn show(response: &Response) {
    println!(
        "   {}  attempts: {}  Idempotency-Key: {}  Idempotency-Replayed: {}  Location: {}",
        response.status(),
        response.attempts(),
        response.key().map_or("none", |k| k.as_str()),
        response.replayed(),
        header(response, "location"),
    );
}

/// A TCP proxy to `upstream` on an ephemeral local port. On its first connection it forwards the
/// request, waits for the first bytes of the answer, and then closes both sides, so the server has
/// done the work and the client never hears about it. Later connections pass through untouched.
async fn lossy_proxy(upstream: std::net::SocketAddr) -> std::io::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let lost_one = Arc::new(AtomicBool::new(false));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let lose = !lost_one.swap(true, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return; // dropping the client's socket: it sees a failed attempt
                };
                if lose {
                    lose_answer(client, server).await;
                } else {
                    let (mut client, mut server) = (client, server);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok(addr)
}

async fn lose_answer(client: TcpStream, server: TcpStream) {
    let (mut from_client, _to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let forward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    });
    let mut first_bytes = [0u8; 1];
    let _ = from_server.read(&mut first_bytes).await;
    println!("   (proxy: the server answered; dropping the answer)");
    forward.abort();
    // Dropping the halves closes both connections.
}
