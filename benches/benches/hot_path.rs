//! Criterion micro-benchmarks of idem's hot path on the memory store: fingerprinting, a new request
//! and a replay through the engine, and a request through the router plain and annotated.
//! Run with: cargo bench -p idem-bench --bench hot_path

use criterion::{criterion_group, criterion_main, Criterion};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::{Begin, Engine, Fingerprint, Policy, RecordKey, StoredResponse};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

const BODY: &[u8] = br#"{"amount": 1000, "currency": "KRW", "description": "two apples"}"#;
const POLICY: Policy = Policy::new().ttl(Duration::from_secs(86_400)).checked();

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        )],
        body: bytes_body(),
    }
}

fn bytes_body() -> bytes::Bytes {
    bytes::Bytes::from_static(br#"{"amount":1000,"currency":"KRW","id":1,"status":"captured"}"#)
}

fn fingerprint(c: &mut Criterion) {
    c.bench_function("fingerprint/json 64 B", |b| {
        b.iter(|| {
            Fingerprint::of_request(
                black_box("POST"),
                black_box("/payments"),
                Some("application/json"),
                black_box(BODY),
            )
        })
    });
    c.bench_function("fingerprint/bytes 64 B", |b| {
        b.iter(|| Fingerprint::of_request("POST", "/payments", None, black_box(BODY)))
    });
}

fn engine(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let engine = Engine::new(MemoryStore::new());
    let fp = Fingerprint::of_request("POST", "/payments", Some("application/json"), BODY);
    let next = AtomicU64::new(0);
    c.bench_function("engine/memory new key (claim + complete)", |b| {
        b.to_async(&rt).iter(|| async {
            let key = RecordKey::new(
                "user-1",
                format!("k{}", next.fetch_add(1, Ordering::Relaxed)),
            );
            match engine.begin(key, fp, &POLICY).await {
                Ok(Begin::Execute(claim)) => claim.complete(&response()).await.expect("complete"),
                _ => panic!("a new key executes"),
            }
        })
    });
    rt.block_on(async {
        if let Ok(Begin::Execute(claim)) = engine
            .begin(RecordKey::new("user-1", "replayed"), fp, &POLICY)
            .await
        {
            claim.complete(&response()).await.expect("complete");
        }
    });
    c.bench_function("engine/memory replay", |b| {
        b.to_async(&rt).iter(|| async {
            match engine
                .begin(RecordKey::new("user-1", "replayed"), fp, &POLICY)
                .await
            {
                Ok(Begin::Replay(r)) => r,
                _ => panic!("a completed key replays"),
            }
        })
    });
}

criterion_group!(benches, fingerprint, engine);
criterion_main!(benches);
