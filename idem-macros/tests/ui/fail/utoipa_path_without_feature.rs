// `#[utoipa::path]` below `#[idempotent]` documents the handler's idempotency, which needs
// idem-runtime's `utoipa` feature (not on in these cases): an error at the path attribute, rather
// than a document that silently lacks the `Idempotency-Key` header.
use idem_runtime::idempotent;

#[idempotent(scope = "global")]
#[utoipa::path(post, path = "/webhooks", responses((status = 200, description = "Received")))]
async fn receive_webhook(body: String) -> String {
    body
}

fn main() {}
