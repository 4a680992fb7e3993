//! Run with: cargo run -p pay-client
//!
//! (with the payments example running in another terminal: `cargo run -p payments`).
//!
//! Pays 1000 KRW through the payments example's API with idem's retrying client, in both of its
//! forms, and shows what makes the retry safe:
//!
//! 1. The plain [`Client`]: the payment goes through a small proxy that loses the first answer on
//!    its way back (the server charged, the client heard nothing). The client retries with the
//!    same `Idempotency-Key`, and the server answers the retry with the stored result:
//!    `Idempotency-Replayed: true`, the same `Location`, no second charge.
//! 2. The same policy as a reqwest-middleware middleware ([`RetryMiddleware`]) in an ordinary
//!    `reqwest_middleware` stack: a second payment, whose first answer the proxy cuts halfway
//!    through its body. The body is read inside the retry loop, so the cut is a failed attempt:
//!    retried with the same key, replayed.
//! 3. The first key sent again later (say after a restart that kept the key with the order) is
//!    replayed too.
//! 4. The payment behind `Location` exists once (a GET: no key, retried all the same).
//!
//! Environment: `PAYMENTS_URL` (default `http://127.0.0.1:3000`), `PAY_USER` (default `alice`; the
//! demo server takes the bearer token as the user id).
//!
//! [`RetryMiddleware`]: idem_runtime::client::RetryMiddleware

use idem_runtime::client::{reqwest, reqwest_middleware, Client, Response};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
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
    let upstream = reqwest::Url::parse(&base)?
        .socket_addrs(|| Some(80))?
        .into_iter()
        .next()
        .ok_or("PAYMENTS_URL names no address")?;
    // Fail with a plain message if nothing listens, rather than through the proxy.
    TcpStream::connect(upstream)
        .await
        .map_err(|e| format!("cannot reach {base}: {e}"))?;
    let body = serde_json::json!({ "amount": 1000, "currency": "KRW" });

    println!("1. POST {base}/payments (plain client) through a proxy that loses the first answer");
    let client = Client::builder().build()?;
    let proxy = faulty_proxy(upstream, Fault::LoseAnswer).await?;
    let first = client
        .post(format!("http://{proxy}/payments"))
        .bearer_auth(&user)
        .json(&body)
        .send()
        .await?;
    show(&first);
    let key = first.key().cloned().ok_or("the client sent no key")?;
    let location = header(&first, "location");

    println!("2. POST {base}/payments (middleware) through a proxy that cuts the first body");
    let stack = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(Client::builder().build_middleware())
        .build();
    let proxy = faulty_proxy(upstream, Fault::CutBody).await?;
    let second = stack
        .post(format!("http://{proxy}/payments"))
        .bearer_auth(&user)
        .json(&body)
        .send()
        .await?;
    // The middleware's answer read as the client's: key, attempts, replayed.
    let second = Response::from(second);
    show(&second);

    println!("3. POST {base}/payments again with the first key");
    let again = client
        .post(format!("{base}/payments"))
        .bearer_auth(&user)
        .idempotency_key(key)
        .json(&body)
        .send()
        .await?;
    show(&again);

    println!("4. GET {base}{location}");
    let payment = client
        .get(format!("{base}{location}"))
        .bearer_auth(&user)
        .send()
        .await?;
    println!("   {} {}", payment.status(), payment.text().await?);

    let same_place = header(&again, "location") == location;
    let replayed = first.replayed() && second.replayed() && again.replayed();
    if first.status().is_success() && second.status().is_success() && replayed && same_place {
        println!("Two payments, each charged once: every retry was replayed.");
        Ok(())
    } else {
        Err("expected every retry to be replayed, the first key's with the same Location".into())
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

/// What the proxy does to the first answer.
#[derive(Clone, Copy)]
enum Fault {
    /// Nothing of it reaches the client.
    LoseAnswer,
    /// Its head and half its body reach the client, then the connection closes.
    CutBody,
}

/// A TCP proxy to `upstream` on an ephemeral local port. On its first connection it forwards the
/// request and spoils the answer (the server has done the work either way); later connections
/// pass through untouched.
async fn faulty_proxy(upstream: SocketAddr, fault: Fault) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let spoiled_one = Arc::new(AtomicBool::new(false));
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let spoil = !spoiled_one.swap(true, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    return; // dropping the client's socket: it sees a failed attempt
                };
                if spoil {
                    spoil_answer(client, server, fault).await;
                } else {
                    let (mut client, mut server) = (client, server);
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    Ok(addr)
}

async fn spoil_answer(client: TcpStream, server: TcpStream, fault: Fault) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let forward = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
    });
    // Read until the head and some of the body are in.
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    let head_end = loop {
        match from_server.read(&mut buf).await {
            Ok(0) | Err(_) => break None,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
        let end = answer.windows(4).position(|w| w == b"\r\n\r\n");
        if let Some(end) = end.filter(|end| answer.len() > end + 4) {
            break Some(end + 4);
        }
    };
    match (fault, head_end) {
        (Fault::CutBody, Some(head)) => {
            let _ = to_client
                .write_all(&answer[..head + (answer.len() - head) / 2])
                .await;
            println!("   (proxy: passed the head and half the body, then closed the connection)");
        }
        _ => println!("   (proxy: the server answered; dropping the answer)"),
    }
    forward.abort();
    // Dropping the halves closes both connections.
}
