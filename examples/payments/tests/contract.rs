//! idem's test kit over each idempotent endpoint of the example, in process: `POST /payments` in
//! both of its modes (transactional, with the records in the ledger's SQLite file, and the default
//! way, with the records elsewhere), `POST /legacy/payments` (keys derived when missing) and
//! `POST /payments/{id}/refund` (under `IdempotencyLayer`). Creates are counted by the card
//! network's charge attempts; refunds by idem's own outcomes.

use axum::body::Body;
use axum::http::Request;
use idem_runtime::clock::{ManualClock, Timestamp};
use idem_runtime::policy::MissingKey;
use idem_runtime::store::memory::MemoryStore;
use idem_runtime::store::sqlite::SqliteStore;
use idem_runtime::testkit::{Caller, Contract};
use idem_runtime::{Engine, Transactional};
use payments::card::CardNetwork;
use payments::ledger::Database;
use payments::{AppState, Config, Txn};
use std::sync::Arc;

const PAYMENT: &str = r#"{"amount": 1000, "currency": "KRW"}"#;

/// The example's state on a fresh SQLite ledger, the idempotency store on a test clock: in the
/// ledger's file (`transactional`), or in memory.
async fn state(dir: &tempfile::TempDir, transactional: bool) -> (AppState, ManualClock) {
    let config = Config {
        database_url: format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("ledger.db").display()
        ),
        idem_store_url: (!transactional).then(|| "memory".to_owned()),
        ..Config::default()
    };
    let mut state = payments::state(&config).await.expect("the example starts");
    let clock = ManualClock::new(Timestamp::from_millis(1_795_996_800_000));
    if transactional {
        let Database::Sqlite(pool) = state.ledger.database() else {
            unreachable!("a SQLite ledger")
        };
        let store = SqliteStore::from_pool(pool.clone())
            .await
            .expect("the records' tables")
            .with_clock(clock.clone());
        let txn = Transactional::new(Arc::new(store));
        state.engine = txn.engine().clone();
        state.transactional = Some(Txn::Sqlite(txn));
    } else {
        state.engine = Engine::new(MemoryStore::new().with_clock(clock.clone()));
    }
    (state, clock)
}

/// Every charge attempt the card network saw for the kit's two callers.
fn charge_attempts(
    card: CardNetwork,
) -> impl Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = u64> + Send>> + Send + Sync + 'static
{
    move || {
        let card = card.clone();
        Box::pin(async move {
            let mut attempts = 0;
            for caller in [Caller::First, Caller::Second] {
                let charges = card
                    .charges(caller.name())
                    .await
                    .expect("the card network's table");
                attempts += charges.iter().map(|c| c.attempts as u64).sum::<u64>();
            }
            attempts
        })
    }
}

fn post(path: &str, caller: Caller, body: &str) -> Request<Body> {
    Request::post(path)
        .header("authorization", format!("Bearer {}", caller.name()))
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .expect("a valid request")
}

async fn create_payments(transactional: bool) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (state, clock) = state(&dir, transactional).await;
    let (engine, card) = (state.engine.clone(), state.card.clone());
    Contract::new(payments::router(state), engine)
        .clock(clock)
        .executions(charge_attempts(card))
        .check(|caller| post("/payments", caller, PAYMENT))
        .await
        .assert();
}

#[tokio::test]
async fn create_payment_keeps_the_contract_in_transactional_mode() {
    create_payments(true).await;
}

#[tokio::test]
async fn create_payment_keeps_the_contract_with_the_records_elsewhere() {
    create_payments(false).await;
}

#[tokio::test]
async fn the_legacy_create_keeps_the_contract_deriving_missing_keys() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (state, clock) = state(&dir, false).await;
    let (engine, card) = (state.engine.clone(), state.card.clone());
    Contract::new(payments::router(state), engine)
        .clock(clock)
        .executions(charge_attempts(card))
        .missing_key(MissingKey::Derive)
        .check(|caller| post("/legacy/payments", caller, PAYMENT))
        .await
        .assert();
}

#[tokio::test]
async fn the_refund_keeps_the_contract() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (state, clock) = state(&dir, false).await;
    let engine = state.engine.clone();
    let router = payments::router(state);
    // One payment per caller to refund (refunding twice changes nothing, so every rule may refund it).
    let mut ids = Vec::new();
    for caller in [Caller::First, Caller::Second] {
        let mut request = post("/payments", caller, PAYMENT);
        let key = format!("setup-{}", caller.name());
        request
            .headers_mut()
            .insert("idempotency-key", key.parse().expect("a header value"));
        let response = tower::ServiceExt::oneshot(router.clone(), request)
            .await
            .expect("infallible");
        assert_eq!(response.status(), 201);
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .expect("the body")
            .to_bytes();
        let payment: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        ids.push(payment["id"].as_str().expect("an id").to_owned());
    }
    Contract::new(router, engine)
        .clock(clock)
        .check(|caller| {
            let id = &ids[usize::from(caller == Caller::Second)];
            post(&format!("/payments/{id}/refund"), caller, "")
        })
        .await
        .assert();
}
