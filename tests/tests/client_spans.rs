//! The client's tracing: a span per attempt with OpenTelemetry's `http.request.resend_count`, for
//! both forms. Alone in its test binary, not with the other client tests: tracing caches whether a
//! span's call site is wanted, and tests on other threads without a subscriber would race this
//! one's thread-local capture.

#[path = "client/client_support.rs"]
mod client_support;

use client_support::{Caller, FaultServer, Form, Spans, Step};
use idem_runtime::client::{Client, RetryBudget};

#[tokio::test(start_paused = true)]
async fn each_attempt_is_a_span_with_the_resend_count_recorded_on_the_requests_span_too() {
    for form in Form::BOTH {
        let server =
            FaultServer::start([Step::status(503), Step::status(503)], Step::status(201)).await;
        let client = Caller::new(form, Client::builder().budget(RetryBudget::unlimited()));
        let (spans, _guard) = Spans::capture();

        // The caller's own span for the logical request, declaring OpenTelemetry's field.
        let request =
            tracing::info_span!("request", http.request.resend_count = tracing::field::Empty);
        let response =
            tracing::Instrument::instrument(client.post(server.url("/scripted")).send(), request)
                .await
                .unwrap();

        assert_eq!(response.attempts(), 3, "{form:?}");
        let resends = spans.field("attempt", "http.request.resend_count");
        assert_eq!(
            resends,
            [None, Some("1".into()), Some("2".into())],
            "{form:?}: set on resends only"
        );
        let statuses = spans.field("attempt", "http.response.status_code");
        assert_eq!(
            statuses,
            [Some("503".into()), Some("503".into()), Some("201".into())]
        );
        assert_eq!(
            spans.field("request", "http.request.resend_count"),
            [Some("2".into())],
            "{form:?}"
        );
    }
}
