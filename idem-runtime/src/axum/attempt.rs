//! What an idempotent handler may need to know about its own run.

use ::axum::extract::FromRequestParts;
use ::axum::http::request::Parts;
use std::sync::{Arc, OnceLock};

/// An extractor for the run an `#[idempotent]` handler is in: whether it takes over an earlier
/// attempt that stopped half-way, and the key to pass on to the services it calls.
///
/// A run normally happens once per key. It happens again only after its worker stopped for longer
/// than the lease (a crash, a kill, a network partition from the store): the new run then
/// [takes over](Self::taken_over), and whatever the first run did outside idem's store may already
/// have happened. Payment providers and most APIs with effects deduplicate by an idempotency key
/// of their own: pass them [`downstream_key`](Self::downstream_key), the same on every attempt, and
/// a takeover repeats nothing there.
///
/// ```
/// use idem_runtime::axum::Attempt;
/// use idem_runtime::idempotent;
///
/// #[idempotent(scope = "global")]
/// async fn charge(attempt: Attempt, body: String) -> String {
///     let key = attempt.downstream_key().unwrap_or("no key: the request ran unprotected");
///     // card_network.charge(amount, Idempotency-Key: key) ...
///     format!("charged under {key}; takeover: {}", attempt.taken_over())
/// }
/// ```
///
/// Its values are set when the request claims its key, before the handler's body runs. Outside an
/// `#[idempotent]` handler, or in one that ran unprotected (`missing_key = "pass"`), it has no
/// downstream key and is never a takeover.
#[derive(Debug, Clone, Default)]
pub struct Attempt(Arc<OnceLock<Run>>);

#[derive(Debug)]
struct Run {
    taken_over: bool,
    downstream_key: String,
}

impl Attempt {
    /// Whether this run took the key over from an earlier attempt that stopped before it finished.
    pub fn taken_over(&self) -> bool {
        self.0.get().is_some_and(|run| run.taken_over)
    }

    /// The key for the services this run calls: see [`RecordKey::downstream_key`](crate::RecordKey::downstream_key).
    pub fn downstream_key(&self) -> Option<&str> {
        self.0.get().map(|run| run.downstream_key.as_str())
    }

    pub(crate) fn set(&self, guard: &crate::ClaimGuard) {
        let _ = self.0.set(Run {
            taken_over: guard.taken_over(),
            downstream_key: guard.downstream_key(),
        });
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Attempt {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        // The same cell for every extraction, and for the layer that fills it in.
        Ok(parts.extensions.get_or_insert_default::<Attempt>().clone())
    }
}
