//! Criterion micro-benchmarks of idem's hot path on the memory store: fingerprinting, extracting a
//! `Json<T>` body with its fingerprint (two parses against one), a new request and a replay through
//! the engine, and the wake-up registry's notify, which every completion calls.
//! Run with: cargo bench --manifest-path benches/Cargo.toml --bench hot_path

use criterion::{criterion_group, criterion_main, Criterion};
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::Waiters;
use idem_runtime::{Begin, Engine, Fingerprint, Policy, RecordKey, StoredResponse};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
    // Bodies built to be costly, each beside the same bytes hashed as bytes. Objects 100 deep, each
    // out of key order around the next, and a 64 KiB string inside them all: each byte should be
    // hashed once however deep it sits. One object of 4,000 members in a scrambled key order (1237
    // is prime to 4,000, so i * 1237 mod 4,000 visits every key once), every key written with an
    // escape, so that sorting takes some 40,000 comparisons of keys whose written bytes are not
    // their strings.
    let mut deep = format!("{:?}", "x".repeat(64 * 1024));
    for _ in 0..100 {
        deep = format!(r#"{{"z":{deep},"a":1}}"#);
    }
    let members: Vec<String> = (0..4000)
        .map(|i| (i * 1237) % 4000)
        .map(|k| format!(r#""\u0061{k:05}":{k}"#))
        .collect();
    let escaped = format!("{{{}}}", members.join(","));
    for (case, same_bytes, body) in [
        (
            "fingerprint/json 64 KiB, 100 objects deep out of order",
            "fingerprint/bytes 64 KiB, the same body",
            deep,
        ),
        (
            "fingerprint/json 4,000 escaped keys, scrambled",
            "fingerprint/bytes 4,000 escaped keys, the same body",
            escaped,
        ),
    ] {
        let json = Some("application/json");
        c.bench_function(case, |b| {
            b.iter(|| {
                Fingerprint::of_request("POST", "/payments", json, black_box(body.as_bytes()))
            })
        });
        c.bench_function(same_bytes, |b| {
            b.iter(|| {
                Fingerprint::of_request("POST", "/payments", None, black_box(body.as_bytes()))
            })
        });
    }
}

/// The body as the handler's `Json<T>` and the fingerprint take it, for a handler that takes
/// `Json<Payment>`: through `WithBody` (the fingerprint's parse), then `Json`'s own once the key is
/// claimed, as for a new key (a replay stops before it).
fn extract(c: &mut Criterion) {
    use axum::extract::FromRequest;
    use idem_runtime::__private::WithBody;

    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Payment {
        amount: i64,
        currency: String,
        description: String,
    }
    const LIMIT: usize = 1 << 20;
    let request = || {
        axum::http::Request::post("/payments")
            .header("content-type", "application/json")
            .header("idempotency-key", "order-42")
            .body(axum::body::Body::from(BODY))
            .expect("a request")
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("extract/Json<T> and fingerprint");
    group.bench_function("two parses (WithBody, then the deferred Json)", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let extracted =
                    WithBody::<axum::Json<Payment>, LIMIT, ()>::from_request(request(), &()).await;
                let ok = match extracted {
                    Ok(WithBody(last, _, ())) => last.now().await.is_ok(),
                    Err(_) => false,
                };
                black_box(ok)
            })
        })
    });
    group.finish();
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

/// `Waiters::notify`, which every completion and release calls, nearly always with nobody waiting
/// on its key. With no key waited on at all it fences, reads a count and takes no lock; with another
/// key waited on it also takes the registry's lock, hashes the key and looks it up (as every notify
/// did before the count; docs/benchmarks-history.md compares the two).
///
/// The two-thread cases notify from both cores at once, each between two stretches of other work
/// (`WORK`, standing in for the rest of a request), so that each notify finds the registry's lines
/// where the other core last left them, as in a server; "work alone" is the same loop without the
/// notify, the baseline to subtract. Each iteration is one round on each thread.
fn waiters(c: &mut Criterion) {
    let idle = Waiters::new();
    let busy = Waiters::new();
    let _held = busy.subscribe(&RecordKey::new("user-2", "waited-on"));
    let key = RecordKey::new("user-1", "completed");
    let mut group = c.benchmark_group("waiters/notify");
    let cases = [("nobody waits", &idle), ("another key waited on", &busy)];
    for (name, waiters) in cases {
        group.bench_function(name, |b| b.iter(|| waiters.notify(black_box(&key))));
    }
    let on_two_threads = |round: &(dyn Fn() + Sync), iters: u64| {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for _ in 0..2 {
                scope.spawn(|| (0..iters).for_each(|_| round()));
            }
        });
        start.elapsed()
    };
    group.bench_function("2 threads, work alone", |b| {
        b.iter_custom(|iters| on_two_threads(&|| work(), iters))
    });
    for (name, waiters) in cases {
        group.bench_function(format!("2 threads, work + notify, {name}"), |b| {
            b.iter_custom(|iters| {
                on_two_threads(
                    &|| {
                        work();
                        waiters.notify(black_box(&key));
                    },
                    iters,
                )
            })
        });
    }
    group.finish();
}

/// A short stretch of arithmetic that touches no shared memory.
fn work() {
    let mut x = black_box(1u64);
    for i in 0..WORK {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
    }
    black_box(x);
}

const WORK: u64 = 200;

criterion_group!(benches, fingerprint, extract, engine, waiters);
criterion_main!(benches);
