// `#[utoipa::path]` written above `#[idempotent]` runs first: utoipa documents the handler as
// written and `#[idempotent]` never sees the path attribute, so the operation would lack the
// `Idempotency-Key` header and idem's problem responses. An error at `#[idempotent]` says where
// to write it instead.
use idem_runtime::idempotent;

#[utoipa::path(post, path = "/webhooks", responses((status = 200, description = "Received")))]
#[idempotent(scope = "global")]
async fn receive_webhook(body: String) -> String {
    body
}

fn main() {}
