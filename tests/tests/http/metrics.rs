//! The `metrics` facade (feature `metrics`): every decision moves `idem_requests_total{handler,
//! outcome}`, every store call is timed in `idem_store_duration_seconds{store, op}`, every wait in
//! `idem_wait_duration_seconds{handler}`; under the attribute and under the layer alike.

use crate::http_support::*;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::{CompositeKey, MetricKind};
use std::future::Future;

/// What a case recorded.
struct Recorded(Vec<(CompositeKey, DebugValue)>);

impl Recorded {
    fn labels(key: &CompositeKey) -> Vec<(&str, &str)> {
        key.key().labels().map(|l| (l.key(), l.value())).collect()
    }

    /// The counter `name` with exactly these labels (0 if it never moved).
    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        self.0
            .iter()
            .find_map(|(key, value)| match value {
                DebugValue::Counter(n)
                    if key.kind() == MetricKind::Counter
                        && key.key().name() == name
                        && Self::labels(key) == labels =>
                {
                    Some(*n)
                }
                _ => None,
            })
            .unwrap_or(0)
    }

    /// `idem_requests_total` of `handler` and `outcome`.
    fn decisions(&self, handler: &str, outcome: &str) -> u64 {
        let labels = [("handler", handler), ("outcome", outcome)];
        self.counter("idem_requests_total", &labels)
    }

    /// `idem_requests_total` of `outcome`, summed over the handlers.
    fn total(&self, outcome: &str) -> u64 {
        self.0
            .iter()
            .filter(|(key, _)| key.key().name() == "idem_requests_total")
            .filter(|(key, _)| Self::labels(key).contains(&("outcome", outcome)))
            .map(|(_, value)| match value {
                DebugValue::Counter(n) => *n,
                other => panic!("a counter, not {other:?}"),
            })
            .sum()
    }

    /// The values of the histogram `name` with exactly these labels.
    fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        self.0
            .iter()
            .filter(|(key, _)| key.key().name() == name && Self::labels(key) == labels)
            .flat_map(|(_, value)| match value {
                DebugValue::Histogram(values) => {
                    values.iter().map(|v| v.into_inner()).collect::<Vec<_>>()
                }
                other => panic!("a histogram, not {other:?}"),
            })
            .collect()
    }
}

/// Runs `case` on a runtime of its own (current-thread, on tokio's paused clock) under a recorder
/// of its own, and returns what it recorded. The runtime's one thread runs the handlers idem
/// detaches too, so they record into the same recorder.
fn recorded<F: Future<Output = ()>>(case: F) -> Recorded {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a runtime")
            .block_on(case)
    });
    let snapshot = snapshotter.snapshot().into_vec();
    Recorded(snapshot.into_iter().map(|(k, _, _, v)| (k, v)).collect())
}

/// One of each decision, on `h`; returns the engine's own counts when it is done.
async fn one_of_each(h: Harness) -> Vec<(&'static str, u64)> {
    // A 502 (`/flaky` fails the service's first call): released.
    let failed = h
        .send(json_post("/flaky", "alice", &["k2"], PAY_1000))
        .await;
    assert_eq!(failed.status, 502);
    // Executed, replayed, mismatch.
    h.send(json_post("/payments", "alice", &["k1"], PAY_1000))
        .await;
    assert!(h
        .send(json_post("/payments", "alice", &["k1"], PAY_1000))
        .await
        .replayed());
    h.send(json_post("/payments", "alice", &["k1"], PAY_2000))
        .await
        .assert_problem(422, "urn:idem:problem:key-mismatch");
    // No key, passed.
    assert_eq!(
        h.send(json_post("/pass", "alice", &[], PAY_1000))
            .await
            .status,
        201
    );
    // A duplicate that waits its whole bound (10 s) for a request held at the gate: a conflict,
    // while the original's lease is renewed. Then one that waits until the gate opens: a replay.
    let router = h.router.clone();
    let original =
        tokio::spawn(
            async move { send(router, json_post("/gated", "alice", &["k3"], PAY_1000)).await },
        );
    h.probe.wait_started(1).await;
    h.send(json_post("/gated", "alice", &["k3"], PAY_1000))
        .await
        .assert_problem(409, "urn:idem:problem:in-flight");
    let router = h.router.clone();
    let waiting =
        tokio::spawn(
            async move { send(router, json_post("/gated", "alice", &["k3"], PAY_1000)).await },
        );
    let mut subscriptions = h.store.subscriptions.subscribe();
    subscriptions.wait_for(|n| *n >= 2).await.expect("store");
    h.probe.open_gate();
    assert_eq!(original.await.expect("original").status, 201);
    assert!(waiting.await.expect("duplicate").replayed());
    h.engine.metrics().snapshot()
}

fn every_decision_moves_its_counter(h: fn() -> Harness) {
    let mut counts = Vec::new();
    let recorded = recorded(async {
        counts = one_of_each(h()).await;
    });
    for (handler, outcome, n) in [
        ("create_payment", "executed", 1),
        ("create_payment", "replayed", 1),
        ("create_payment", "mismatch", 1),
        ("flaky", "executed", 1),
        ("flaky", "released", 1),
        ("pass_missing", "missing_key_passed", 1),
        ("gated", "executed", 1),
        ("gated", "conflict", 1),
        ("gated", "waited", 1),
        ("gated", "replayed", 1),
    ] {
        assert_eq!(
            recorded.decisions(handler, outcome),
            n,
            "{handler} {outcome}"
        );
    }
    assert!(recorded.decisions("gated", "renewed") >= 1);
    // Every count the engine keeps went to the facade too.
    for (outcome, n) in counts {
        assert_eq!(recorded.total(outcome), n, "{outcome}");
    }
    // The conflict waited its whole bound; the replay, until the gate opened.
    let waits = recorded.histogram("idem_wait_duration_seconds", &[("handler", "gated")]);
    assert_eq!(waits.len(), 2, "{waits:?}");
    assert!(waits.iter().any(|w| *w >= 10.0), "{waits:?}");
}

#[test]
fn every_decision_moves_its_counter_under_the_attribute() {
    every_decision_moves_its_counter(Harness::new);
}

#[test]
fn every_decision_moves_its_counter_under_the_layer() {
    every_decision_moves_its_counter(Harness::layered);
}

#[test]
fn store_calls_are_timed_by_store_and_operation() {
    let recorded = recorded(async {
        one_of_each(Harness::layered()).await;
    });
    for op in ["claim", "complete", "release", "renew", "announce"] {
        let took = recorded.histogram(
            "idem_store_duration_seconds",
            &[("store", "memory"), ("op", op)],
        );
        assert!(!took.is_empty(), "no {op} timed");
    }
    let claims = recorded.histogram(
        "idem_store_duration_seconds",
        &[("store", "memory"), ("op", "claim")],
    );
    // k1 three times, k2, the gated original, the conflict's and the replay's claims (each
    // duplicate claims again after arming its wait and after each wake-up).
    assert!(claims.len() >= 7, "{}", claims.len());
}
