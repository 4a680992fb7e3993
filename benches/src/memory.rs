//! Memory: heap bytes per record in the memory store, and allocations per request on the in-process
//! request path (no network), measured with the bench binary's counting allocator.

use crate::alloc;
use crate::floors::{engine_new, response};
use crate::load::BODY;
use crate::setup;
use axum::body::Body;
use axum::Router;
use http_body_util::BodyExt;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::Engine;
use std::time::{Duration, Instant};
use tower::ServiceExt;

const RECORDS: u64 = 100_000;

pub(crate) async fn bytes_per_record() {
    println!("\n## Memory store: bytes per record\n");
    let live = || {
        [
            alloc::live_bytes(),
            alloc::live_chunk_bytes(),
            alloc::live_blocks(),
        ]
    };
    let before = live();
    let engine = Engine::new(MemoryStore::new());
    for i in 0..RECORDS {
        assert!(engine_new(&engine, "user-1", format!("order-{i:08}")).await);
    }
    let after = live();
    let [per, chunks, blocks] = [0, 1, 2].map(|i| (after[i] - before[i]) as f64 / RECORDS as f64);
    let r = response();
    let payload = "user-1".len()
        + "order-00000000".len()
        + r.body.len()
        + r.headers
            .iter()
            .map(|(n, v)| n.as_str().len() + v.len())
            .sum::<usize>();
    println!("{RECORDS} completed records (scope `user-1`, 14-byte keys, a 201 with 2 stored headers and a {}-byte body, {payload} bytes of payload per record): **{per:.0} heap bytes per record** (live heap after minus before, requested sizes); **{chunks:.0} bytes** as glibc's malloc lays them out (each allocation plus its 8-byte header, rounded up to 16, at least 32), in **{blocks:.1} allocations** per record (the table and retention index included, averaged).", r.body.len());
    drop(engine);
}

/// Which request the in-process loop sends.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Kind {
    Plain,
    New,
    Replay,
}

fn request(path: &str, key: &str) -> axum::http::Request<Body> {
    axum::http::Request::post(path)
        .header("content-type", "application/json")
        .header("authorization", "Bearer user-1")
        .header("idempotency-key", key)
        .body(Body::from(BODY))
        .expect("a valid request")
}

/// `n` requests through the router in this task (memory store); allocation calls and time per request.
pub(crate) async fn in_process(kind: Kind, n: u64) -> (f64, Duration) {
    let router: Router = setup::router(Engine::new(MemoryStore::new()), Default::default());
    if let Kind::Replay = kind {
        let r = router
            .clone()
            .oneshot(request("/idem", "replay"))
            .await
            .expect("seed");
        assert!(r.status().is_success());
    }
    let (path, prefix) = match kind {
        Kind::Plain => ("/plain", "p"),
        Kind::New => ("/idem", "n"),
        Kind::Replay => ("/idem", "replay"),
    };
    let keys: Vec<String> = (0..n)
        .map(|i| match kind {
            Kind::Replay => prefix.to_owned(),
            _ => format!("{prefix}-{i}"),
        })
        .collect();
    let calls = alloc::calls();
    let t = Instant::now();
    for key in &keys {
        let response = router
            .clone()
            .oneshot(request(path, key))
            .await
            .expect("infallible");
        assert!(response.status().is_success());
        let _ = response.into_body().collect().await;
    }
    let elapsed = t.elapsed();
    let allocs = (alloc::calls() - calls) as f64 / n as f64;
    (allocs, elapsed / n as u32)
}

pub(crate) async fn request_path() {
    println!("\n## In-process request path (memory store, no network)\n");
    println!("20,000 requests through the router on one task (`tower::ServiceExt::oneshot`), the request built beforehand. Allocation calls counted by the bench's allocator.\n");
    println!("| request | allocations per request | time per request |");
    println!("|---|---|---|");
    for (label, kind) in [
        ("plain handler", Kind::Plain),
        ("`#[idempotent]`, new key", Kind::New),
        ("`#[idempotent]`, replay", Kind::Replay),
    ] {
        let (allocs, per) = in_process(kind, 20_000).await;
        println!("| {label} | {allocs:.1} | {} |", crate::report::dur(per));
    }
}
