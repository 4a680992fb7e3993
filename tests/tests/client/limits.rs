//! The client's limits against a fault-injecting server: maximum attempts, the deadline, the
//! attempt timeout, the shared retry budget, and the one collapsed error with the last answer.
//! Every scenario runs against both forms (the plain client and the reqwest-middleware stack).
//! Paused tokio clock, server in the same runtime (see `client_support`).

use crate::client_support::{Caller, FaultServer, Form, Step};
use idem_runtime::client::{
    CauseKind, Client, ExponentialBackoff, RetryBudget, StopReason, TransportFailure,
};
use idem_runtime::http::StatusCode;
use std::time::Duration;
use tokio::time::Instant;

#[tokio::test(start_paused = true)]
async fn max_attempts_zero_still_makes_one_attempt() {
    for form in Form::BOTH {
        let server = FaultServer::start([], Step::status(503)).await;
        let client = Caller::new(form, Client::builder().max_attempts(0));

        let error = client
            .get(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();

        assert_eq!(error.attempts(), 1, "{form:?}");
        assert_eq!(
            error.stop_reason(),
            &StopReason::AttemptsExhausted { max_attempts: 1 }
        );
        assert!(
            error.to_string().contains("the maximum of 1 attempt;"),
            "{error}"
        );
        assert_eq!(server.seen().len(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn the_deadline_stops_the_attempts() {
    for form in Form::BOTH {
        let server = FaultServer::start([], Step::status(503)).await;
        let deadline = Duration::from_secs(10);
        let client = Caller::new(
            form,
            Client::builder()
                .max_attempts(1000)
                .budget(RetryBudget::unlimited())
                .backoff(ExponentialBackoff::new(
                    Duration::from_millis(500),
                    Duration::from_secs(4),
                ))
                .deadline(Some(deadline)),
        );

        let started = Instant::now();
        let error = client
            .get(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();
        let ended = Instant::now();

        assert!(error.is_deadline(), "{error}");
        assert_eq!(
            error.stop_reason(),
            &StopReason::Deadline {
                deadline,
                retry_after: None
            }
        );
        assert!(
            error
                .to_string()
                .contains("no time left before the deadline of 10s"),
            "{error}"
        );
        assert!(
            ended - started <= deadline,
            "returned after {:?}",
            ended - started
        );
        let seen = server.seen();
        assert_eq!(error.attempts() as usize, seen.len(), "{form:?}");
        assert!(seen.len() >= 2, "it did retry before the deadline");
        assert!(seen.iter().all(|s| s.at - started < deadline));
        assert_eq!(error.causes().len(), 1);
        assert_eq!(error.causes()[0].count(), error.attempts());
    }
}

#[tokio::test(start_paused = true)]
async fn a_retry_after_past_the_deadline_is_said_as_such() {
    for form in Form::BOTH {
        let server = FaultServer::start([], Step::status(503).header("retry-after", "10")).await;
        let client = Caller::new(
            form,
            Client::builder().deadline(Some(Duration::from_secs(3))),
        );

        let started = Instant::now();
        let error = client
            .get(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();

        assert_eq!(
            error.stop_reason(),
            &StopReason::Deadline {
                deadline: Duration::from_secs(3),
                retry_after: Some(Duration::from_secs(10)),
            },
            "{form:?}"
        );
        assert!(
            error
                .to_string()
                .contains("the server asked to wait 10s (Retry-After), past the deadline of 3s"),
            "{error}"
        );
        assert_eq!(error.attempts(), 1);
        assert!(
            Instant::now() - started < Duration::from_secs(3),
            "it stopped at once instead of waiting out the deadline"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_deadline_cuts_off_an_attempt_that_never_ends() {
    for form in Form::BOTH {
        let server = FaultServer::start([], Step::Hang).await;
        let client = Caller::new(
            form,
            Client::builder()
                .deadline(Some(Duration::from_secs(5)))
                .attempt_timeout(None),
        );

        let started = Instant::now();
        let error = client
            .post(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();

        assert!(error.is_deadline(), "{error}");
        assert_eq!(Instant::now() - started, Duration::from_secs(5));
        assert_eq!(error.attempts(), 1, "{form:?}");
        assert_eq!(
            error.causes()[0].kind(),
            CauseKind::Transport(TransportFailure::Timeout)
        );
        assert_eq!(server.seen().len(), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn an_attempt_timeout_retries_a_hung_attempt_with_the_same_key() {
    for form in Form::BOTH {
        let server = FaultServer::start([Step::Hang], Step::status(201)).await;
        let client = Caller::new(
            form,
            Client::builder()
                .attempt_timeout(Some(Duration::from_secs(2)))
                .deadline(Some(Duration::from_secs(30))),
        );

        let response = client.post(server.url("/scripted")).send().await.unwrap();

        assert_eq!(response.status(), 201, "{form:?}");
        assert_eq!(response.attempts(), 2);
        let seen = server.seen();
        assert!(seen[1].at - seen[0].at >= Duration::from_secs(2));
        assert_eq!(seen[0].key, seen[1].key);
    }
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_budget_fails_fast() {
    for form in Form::BOTH {
        // Retry-After: 5 on every answer, so any further attempt would come at least 5 s later.
        let server = FaultServer::start([], Step::status(503).header("retry-after", "5")).await;
        // Two retries' worth: 10 tokens at 5 a retry.
        let budget = RetryBudget::new(10);
        let client = Caller::new(
            form,
            Client::builder()
                .max_attempts(10)
                .deadline(None)
                .budget(budget.clone()),
        );

        let error = client
            .get(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();

        assert!(error.is_budget_exhausted(), "{error}");
        assert_eq!(
            error.attempts(),
            3,
            "{form:?}: the first attempt and the 2 retries the budget held"
        );
        assert_eq!(budget.available(), Some(0));
        let last = server.seen().last().unwrap().at;
        assert!(
            Instant::now() - last < Duration::from_secs(5),
            "it did not wait"
        );

        // The next request (of this client or a clone) gets no retry at all.
        let error = client
            .clone()
            .get(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();
        assert!(error.is_budget_exhausted());
        assert_eq!(error.attempts(), 1);
        assert_eq!(server.seen().len(), 4);
    }
}

#[tokio::test(start_paused = true)]
async fn a_storm_from_a_full_budget_gets_capacity_over_cost_retries_and_successes_earn_them_back() {
    for form in Form::BOTH {
        let server = FaultServer::start([], Step::status(503)).await;
        let budget = RetryBudget::default();
        let client = Caller::new(
            form,
            Client::builder()
                .max_attempts(5)
                .deadline(None)
                .budget(budget.clone()),
        );

        // 50 concurrent calls to a dependency that fails them all: 200 retries wanted.
        let calls = (0..50).map(|_| {
            let (client, url) = (client.clone(), server.url("/scripted"));
            tokio::spawn(async move { client.get(url).send().await })
        });
        let mut failed = 0;
        for call in calls.collect::<Vec<_>>() {
            failed += usize::from(call.await.unwrap().is_err());
        }

        assert_eq!(failed, 50, "{form:?}");
        assert_eq!(
            server.seen().len(),
            50 + 100,
            "{form:?}: 500 tokens at 5 a retry: 100 retries in all"
        );
        assert_eq!(budget.available(), Some(0));

        // The dependency recovers: five first-attempt successes earn one retry's cost back.
        let ok = FaultServer::start([], Step::status(200)).await;
        for _ in 0..5 {
            client.get(ok.url("/scripted")).send().await.unwrap();
        }
        assert_eq!(budget.available(), Some(5), "{form:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_error_keeps_the_last_answers_status_headers_and_body() {
    for form in Form::BOTH {
        let unavailable = Step::problem(503, "urn:idem:problem:store-unavailable")
            .header("x-request-id", "req-3")
            .header("retry-after", "1");
        let server = FaultServer::start([], unavailable).await;
        let client = Caller::new(
            form,
            Client::builder()
                .max_attempts(3)
                .budget(RetryBudget::unlimited()),
        );

        let error = client
            .post(server.url("/scripted"))
            .send()
            .await
            .unwrap_err();

        assert_eq!(error.attempts(), 3, "{form:?}");
        let answer = error.last_answer().expect("the last answer is kept");
        assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(answer.headers()["x-request-id"], "req-3");
        assert_eq!(
            answer.problem_type(),
            Some("urn:idem:problem:store-unavailable")
        );
        let body: serde_json::Value = serde_json::from_slice(answer.body()).unwrap();
        assert_eq!(body["title"], "scripted problem");
        assert!(
            error
                .to_string()
                .contains("503 Service Unavailable (urn:idem:problem:store-unavailable) (x3)"),
            "{error}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn one_error_collapses_the_causes_with_counts_attempts_and_key() {
    for form in Form::BOTH {
        let server = FaultServer::start(
            [
                Step::DropAfterEffect,
                Step::status(503),
                Step::status(503),
                Step::status(502),
            ],
            Step::status(200),
        )
        .await;
        let client = Caller::new(
            form,
            Client::builder()
                .max_attempts(4)
                .budget(RetryBudget::unlimited()),
        );

        let error = client
            .post(server.url("/scripted?token=secret"))
            .send()
            .await
            .unwrap_err();

        let key = error.key().unwrap().as_str().to_owned();
        assert!(server.seen().iter().all(|s| s.key.as_deref() == Some(&key)));
        assert_eq!(error.attempts(), 4, "{form:?}");
        assert_eq!(error.last_status(), Some(StatusCode::BAD_GATEWAY));
        let causes: Vec<_> = error
            .causes()
            .iter()
            .map(|c| (c.kind(), c.count()))
            .collect();
        assert_eq!(
            causes,
            [
                (CauseKind::Transport(TransportFailure::Interrupted), 1),
                (CauseKind::Status(StatusCode::SERVICE_UNAVAILABLE), 2),
                (CauseKind::Status(StatusCode::BAD_GATEWAY), 1),
            ]
        );
        let lost = error.causes()[0].message().to_owned();
        assert_eq!(
            error.to_string(),
            format!(
                "POST {} failed after 4 attempts (Idempotency-Key {key}): gave up after the \
                 maximum of 4 attempts; causes: {lost} (x1), 503 Service Unavailable (x2), \
                 502 Bad Gateway (x1)",
                server.url("/scripted")
            )
        );
    }
}

#[tokio::test(start_paused = true)]
async fn limits_of_duration_max_mean_never_not_a_panic() {
    for form in Form::BOTH {
        let server = FaultServer::start(
            [Step::status(429).header("retry-after", "99999999999999999999999")],
            Step::status(200),
        )
        .await;
        let client = Caller::new(
            form,
            Client::builder()
                .deadline(Some(Duration::MAX))
                .attempt_timeout(Some(Duration::MAX))
                .max_retry_after(Duration::MAX)
                .backoff(ExponentialBackoff::new(Duration::MAX, Duration::MAX)),
        );

        let response = client.get(server.url("/scripted")).send().await.unwrap();

        assert_eq!(response.status(), 200, "{form:?}");
        assert_eq!(response.attempts(), 2);
    }
}
