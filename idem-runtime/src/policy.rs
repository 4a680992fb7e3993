//! A handler's idempotency policy: how long keys live, how long a claim is held, what is stored.
//!
//! A [`Policy`] is built with `const fn`s so that a service can state its payment policy once, checked
//! at compile time, and share it between handlers:
//!
//! ```
//! use idem_runtime::policy::{MissingKey, Policy, ReplayMode};
//! use std::time::Duration;
//!
//! pub const PAYMENTS: Policy = Policy::new()
//!     .ttl(Duration::from_secs(24 * 3600))
//!     .retain(Duration::from_secs(7 * 24 * 3600))
//!     .missing_key(MissingKey::Reject)
//!     .replay(ReplayMode::Full);
//! assert_eq!(PAYMENTS.ttl.as_secs(), 86_400);
//! ```
//!
//! The `#[idempotent]` attribute checks the same rules at compile time and points at the offending
//! option; [`Policy::validate`] checks them for policies built by hand.

pub use crate::coverage::Coverage;
pub use crate::source::KeySource;
use std::time::Duration;

/// The longest `ttl` and `retain` accepted: one year. Longer almost certainly means a unit mistake.
pub const MAX_TTL: Duration = Duration::from_secs(366 * 24 * 3600);

/// What to do with a request that carries no `Idempotency-Key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingKey {
    /// Answer 400: the endpoint requires a key.
    Reject,
    /// Run the handler unprotected and count it, so operators see when they can tighten to `Reject`.
    Pass,
    /// Derive a key from the scope, method, path and canonical body, valid for `derive_window`:
    /// a stop-gap against double taps from clients that cannot be updated yet.
    Derive,
}

/// What a replay returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayMode {
    /// The stored status, replayable headers and body (up to the body cap).
    Full,
    /// Only the status, `Location` and the resource id (`{"id": …}` taken from a JSON body): keeps the
    /// store small and points clients at the current state behind `Location`.
    Minimal,
}

/// What a 5xx response from the handler does to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ServerErrors {
    /// Release the key without storing the response: a retry runs the handler again. Right when
    /// a 5xx means the effect did not happen (a dependency was down, the handler gave up before
    /// writing).
    #[default]
    Release,
    /// Store the response and replay it like any other status: a retry gets the same 5xx. Right
    /// when a 5xx may come after the effect happened (a timeout after the charge went through),
    /// where running again could repeat the effect.
    Store,
}

/// What a 4xx response from the handler does to its key. 2xx and 3xx responses are always stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClientErrors {
    /// Store the response and replay it to every retry with the key: the client must correct its
    /// request under a new key. Right when a 4xx is the answer to that request for good (a
    /// payment refused, an unknown account), and the default.
    #[default]
    Store,
    /// Release the key without storing the response, so that the corrected retry with the same
    /// key runs the handler. Right when a 4xx means nothing happened and the client is expected
    /// to fix and resend (a validation error); in transactional mode, the handler's writes are
    /// rolled back as for a 5xx.
    Release,
}

/// The idempotency policy of one handler (or one family of handlers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// How long a key is remembered and replayed; after it, the key answers "expired".
    pub ttl: Duration,
    /// How long an expired key is still remembered as a tombstone (measured from the claim, ≥ `ttl`).
    pub retain: Duration,
    /// How long a claim is held without completion before another request may take it over (the
    /// original worker is presumed dead).
    pub lease: Duration,
    /// How long a duplicate waits for the in-flight original before answering 409, counted from
    /// when it first finds the original in flight.
    pub wait: Duration,
    /// What to do without a key.
    pub missing_key: MissingKey,
    /// With [`MissingKey::Derive`]: how long a derived key lives.
    pub derive_window: Duration,
    /// With [`MissingKey::Pass`]: from this instant (ms since the Unix epoch) on, reject instead.
    pub reject_after_ms: Option<i64>,
    /// What a replay returns.
    pub replay: ReplayMode,
    /// What a 5xx response does to the key: released for a retry to run again, or stored.
    pub server_errors: ServerErrors,
    /// What a 4xx response does to the key: stored and replayed, or released for the corrected
    /// retry to run.
    pub client_errors: ClientErrors,
    /// Where the key comes from: the `Idempotency-Key` header, another header, or a JSON body field.
    pub key_source: KeySource,
    /// What the fingerprint covers: the whole request, or the JSON body without (or with only)
    /// some members.
    pub fingerprint: Coverage,
    /// The largest response body stored; larger bodies are stored as in [`ReplayMode::Minimal`].
    pub max_stored_body: usize,
    /// The largest request body accepted (413 beyond).
    pub max_request_body: usize,
    /// Response headers replayed besides `Content-Type`, `Content-Language` and `Location`
    /// (lower-case names). `Set-Cookie` and hop-by-hop headers are never replayed.
    pub replay_headers: &'static [&'static str],
    /// The handler's name, for logs and metrics.
    pub handler: &'static str,
}

/// A contradiction or out-of-range value in a [`Policy`]. Its message is the one
/// [`Policy::checked`] panics with, so an invalid policy reads the same wherever it is caught: in
/// the `#[idempotent]` attribute's compile error (`policy = NAME`) and in
/// the constructors of the axum feature's `IdempotencyLayer`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicyError {
    /// A duration that must be positive (`ttl`, `lease`, `derive_window`) is zero.
    Zero(&'static str),
    /// `ttl` or `retain` above [`MAX_TTL`].
    TooLong(&'static str),
    /// `retain` shorter than `ttl`.
    RetainShorterThanTtl,
    /// `derive_window` longer than `ttl`.
    DeriveWindowLongerThanTtl,
    /// `reject_after` without `missing_key = pass`.
    RejectAfterWithoutPass,
    /// `missing_key = derive` on keys shared by every caller (a global scope).
    DeriveWithGlobalScope,
    /// `key_header` is not a lower-case HTTP header name.
    InvalidKeyHeader,
    /// A JSON Pointer (of `key_field`, `fingerprint_exclude` or `fingerprint_only`, named) is not
    /// an RFC 6901 pointer to a member: it must start with `/`, and escape `~` as `~0`, `/` as `~1`.
    InvalidPointer(&'static str),
    /// `fingerprint_only` names the `key_field`, which is never part of its own fingerprint.
    KeyFieldInFingerprint,
}

impl PolicyError {
    /// The message, as `Display` writes it. A `const fn`, for [`Policy::checked`].
    pub const fn message(&self) -> &'static str {
        match self {
            Self::Zero(field) => match field.as_bytes() {
                b"ttl" => "idem policy: `ttl` must be greater than zero: a key forgotten at once protects nothing",
                b"lease" => "idem policy: `lease` must be greater than zero: a claim must be held while the handler runs",
                _ => "idem policy: `derive_window` must be greater than zero",
            },
            Self::TooLong(field) => match field.as_bytes() {
                b"ttl" => "idem policy: `ttl` must be at most 366 days (one year): a longer value is almost certainly a unit mistake",
                _ => "idem policy: `retain` must be at most 366 days (one year): a longer value is almost certainly a unit mistake",
            },
            Self::RetainShorterThanTtl => "idem policy: `retain` must be at least `ttl`: tombstones outlive the keys they remember",
            Self::DeriveWindowLongerThanTtl => "idem policy: `derive_window` must not exceed `ttl`: a derived key cannot outlive the record",
            Self::RejectAfterWithoutPass => "idem policy: `reject_after` only applies with `missing_key = pass` (pass requests without a key until the date, reject them from it)",
            Self::DeriveWithGlobalScope => "idem policy: `missing_key = derive` cannot be used with a global scope: two callers sending the identical request would share one execution; scope the handler to its caller",
            Self::InvalidKeyHeader => "idem policy: `key_header` must be a lower-case HTTP header name (letters, digits and `!#$%&'*+-.^_`|~`), like \"webhook-id\"",
            Self::InvalidPointer(option) => match option.as_bytes() {
                b"key_field" => "idem policy: `key_field` must be a JSON Pointer to a member (RFC 6901), like \"/id\" or \"/data/request_id\": it starts with `/`, and `~` is written `~0`, `/` inside a name `~1`",
                b"fingerprint_only" => "idem policy: every `fingerprint_only` entry must be a JSON Pointer to a member (RFC 6901), like \"/amount\": it starts with `/`, and `~` is written `~0`, `/` inside a name `~1`",
                _ => "idem policy: every `fingerprint_exclude` entry must be a JSON Pointer to a member (RFC 6901), like \"/sent_at\": it starts with `/`, and `~` is written `~0`, `/` inside a name `~1`",
            },
            Self::KeyFieldInFingerprint => "idem policy: `fingerprint_only` names the `key_field`, which is never part of its own fingerprint: remove it from `fingerprint_only`",
        }
    }
}

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl std::error::Error for PolicyError {}

impl Policy {
    /// The defaults: ttl 24 h, retain 7 d, lease 30 s, wait 10 s, keys required, full replays,
    /// 5xx responses released, bodies stored up to 64 KiB, requests up to 1 MiB.
    pub const fn new() -> Self {
        Self {
            ttl: Duration::from_secs(24 * 3600),
            retain: Duration::from_secs(7 * 24 * 3600),
            lease: Duration::from_secs(30),
            wait: Duration::from_secs(10),
            missing_key: MissingKey::Reject,
            derive_window: Duration::from_secs(10),
            reject_after_ms: None,
            replay: ReplayMode::Full,
            server_errors: ServerErrors::Release,
            client_errors: ClientErrors::Store,
            key_source: KeySource::IdempotencyKey,
            fingerprint: Coverage::Whole,
            max_stored_body: 64 * 1024,
            max_request_body: 1024 * 1024,
            replay_headers: &[],
            handler: "",
        }
    }

    /// Sets `ttl`; `retain` grows to `ttl` if it was shorter.
    pub const fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        if self.retain.as_millis() < ttl.as_millis() {
            self.retain = ttl;
        }
        self
    }

    /// Sets `retain`.
    pub const fn retain(mut self, retain: Duration) -> Self {
        self.retain = retain;
        self
    }

    /// Sets `lease`.
    pub const fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Sets `wait` (zero: answer 409 at once).
    pub const fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Sets what happens without a key.
    pub const fn missing_key(mut self, missing_key: MissingKey) -> Self {
        self.missing_key = missing_key;
        self
    }

    /// Sets `derive_window`.
    pub const fn derive_window(mut self, window: Duration) -> Self {
        self.derive_window = window;
        self
    }

    /// Sets `reject_after` as milliseconds since the Unix epoch (the attribute takes a date).
    pub const fn reject_after_ms(mut self, at_ms: i64) -> Self {
        self.reject_after_ms = Some(at_ms);
        self
    }

    /// Sets the replay mode.
    pub const fn replay(mut self, replay: ReplayMode) -> Self {
        self.replay = replay;
        self
    }

    /// Sets what a 5xx response does to the key ([`ServerErrors::Release`] by default).
    ///
    /// ```
    /// use idem_runtime::policy::{Policy, ServerErrors};
    /// // A payment provider's timeout may come after the charge: replay the 5xx, never charge twice.
    /// const CHARGES: Policy = Policy::new().server_errors(ServerErrors::Store);
    /// assert_eq!(CHARGES.server_errors, ServerErrors::Store);
    /// ```
    pub const fn server_errors(mut self, server_errors: ServerErrors) -> Self {
        self.server_errors = server_errors;
        self
    }

    /// Sets what a 4xx response does to the key ([`ClientErrors::Store`] by default).
    ///
    /// ```
    /// use idem_runtime::policy::{ClientErrors, Policy};
    /// // A 422 for a malformed order: the client fixes it and sends it again with the same key.
    /// const ORDERS: Policy = Policy::new().client_errors(ClientErrors::Release);
    /// assert_eq!(ORDERS.client_errors, ClientErrors::Release);
    /// ```
    pub const fn client_errors(mut self, client_errors: ClientErrors) -> Self {
        self.client_errors = client_errors;
        self
    }

    /// Reads the key from the header `name` (lower case, `"webhook-id"`) instead of
    /// `Idempotency-Key`.
    pub const fn key_header(mut self, name: &'static str) -> Self {
        self.key_source = KeySource::Header(name);
        self
    }

    /// Reads the key from the JSON body's member at `pointer` (RFC 6901, `"/data/request_id"`)
    /// instead of the `Idempotency-Key` header. That member never counts in the fingerprint.
    pub const fn key_field(mut self, pointer: &'static str) -> Self {
        self.key_source = KeySource::BodyField(pointer);
        self
    }

    /// Leaves these JSON body members (RFC 6901 pointers) out of the fingerprint: a retry that
    /// changes only them is the same request, and gets the stored response as it was.
    pub const fn fingerprint_exclude(mut self, pointers: &'static [&'static str]) -> Self {
        self.fingerprint = Coverage::Exclude(pointers);
        self
    }

    /// Fingerprints only these JSON body members (RFC 6901 pointers), besides the method and the
    /// path.
    pub const fn fingerprint_only(mut self, pointers: &'static [&'static str]) -> Self {
        self.fingerprint = Coverage::Only(pointers);
        self
    }

    /// Sets the stored-body cap.
    pub const fn max_stored_body(mut self, bytes: usize) -> Self {
        self.max_stored_body = bytes;
        self
    }

    /// Sets the request-body limit.
    pub const fn max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// Sets the extra replayed response headers (lower-case names).
    pub const fn replay_headers(mut self, names: &'static [&'static str]) -> Self {
        self.replay_headers = names;
        self
    }

    /// Sets the handler name used in logs and metrics.
    pub const fn handler(mut self, name: &'static str) -> Self {
        self.handler = name;
        self
    }

    /// Checks the rules the attribute enforces at compile time.
    pub const fn validate(&self) -> Result<(), PolicyError> {
        if self.ttl.is_zero() {
            return Err(PolicyError::Zero("ttl"));
        }
        if self.lease.is_zero() {
            return Err(PolicyError::Zero("lease"));
        }
        if self.ttl.as_millis() > MAX_TTL.as_millis() {
            return Err(PolicyError::TooLong("ttl"));
        }
        if self.retain.as_millis() > MAX_TTL.as_millis() {
            return Err(PolicyError::TooLong("retain"));
        }
        if self.retain.as_millis() < self.ttl.as_millis() {
            return Err(PolicyError::RetainShorterThanTtl);
        }
        if matches!(self.missing_key, MissingKey::Derive) {
            if self.derive_window.is_zero() {
                return Err(PolicyError::Zero("derive_window"));
            }
            if self.derive_window.as_millis() > self.ttl.as_millis() {
                return Err(PolicyError::DeriveWindowLongerThanTtl);
            }
        }
        if self.reject_after_ms.is_some() && !matches!(self.missing_key, MissingKey::Pass) {
            return Err(PolicyError::RejectAfterWithoutPass);
        }
        self.validate_sources()
    }

    /// The key source's name and the fingerprint's pointers.
    const fn validate_sources(&self) -> Result<(), PolicyError> {
        use crate::source::{check_header, check_pointer};
        match self.key_source {
            KeySource::Header(name) if check_header(name).is_err() => {
                return Err(PolicyError::InvalidKeyHeader)
            }
            KeySource::BodyField(pointer) if check_pointer(pointer).is_err() => {
                return Err(PolicyError::InvalidPointer("key_field"))
            }
            _ => {}
        }
        let (option, pointers) = match self.fingerprint {
            Coverage::Whole => return Ok(()),
            Coverage::Exclude(pointers) => ("fingerprint_exclude", pointers),
            Coverage::Only(pointers) => ("fingerprint_only", pointers),
        };
        let mut i = 0;
        while i < pointers.len() {
            if check_pointer(pointers[i]).is_err() {
                return Err(PolicyError::InvalidPointer(option));
            }
            if let (Coverage::Only(_), KeySource::BodyField(key)) =
                (self.fingerprint, self.key_source)
            {
                if same(key, pointers[i]) {
                    return Err(PolicyError::KeyFieldInFingerprint);
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// Panics at compile time when used in a `const` and the policy is invalid: `const P: Policy =
    /// Policy::new().ttl(..).checked();` turns a contradiction into a build error, with
    /// [`PolicyError`]'s message.
    pub const fn checked(self) -> Self {
        if let Err(error) = self.validate() {
            panic!("{}", error.message());
        }
        self
    }

    /// [`validate`](Self::validate), for a handler whose keys are shared by all callers (a global
    /// scope): also refuses `missing_key = Derive`, under which two callers sending the identical
    /// request within `derive_window` would share one execution and one response.
    pub const fn validate_for_global_scope(&self) -> Result<(), PolicyError> {
        if let Err(error) = self.validate() {
            return Err(error);
        }
        if let MissingKey::Derive = self.missing_key {
            return Err(PolicyError::DeriveWithGlobalScope);
        }
        Ok(())
    }

    /// [`checked`](Self::checked) under [`validate_for_global_scope`](Self::validate_for_global_scope).
    /// The `#[idempotent]` macro calls it for `scope = "global"` handlers, so the mistake is a
    /// compile error.
    ///
    /// ```
    /// use idem_runtime::policy::{MissingKey, Policy};
    /// const SHARED: Policy = Policy::new().missing_key(MissingKey::Pass).checked_for_global_scope();
    /// # let _ = SHARED;
    /// ```
    pub const fn checked_for_global_scope(self) -> Self {
        if let Err(error) = self.validate_for_global_scope() {
            panic!("{}", error.message());
        }
        self
    }
}

/// `a == b`, in a `const fn`.
const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

impl Default for Policy {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_contradictions_are_not() {
        assert_eq!(Policy::new().validate(), Ok(()));
        assert_eq!(
            Policy::new().ttl(Duration::ZERO).validate(),
            Err(PolicyError::Zero("ttl"))
        );
        assert_eq!(
            Policy::new().retain(Duration::from_secs(1)).validate(),
            Err(PolicyError::RetainShorterThanTtl)
        );
        assert_eq!(
            Policy::new()
                .missing_key(MissingKey::Derive)
                .ttl(Duration::from_secs(5))
                .derive_window(Duration::from_secs(6))
                .validate(),
            Err(PolicyError::DeriveWindowLongerThanTtl)
        );
        assert_eq!(
            Policy::new().reject_after_ms(0).validate(),
            Err(PolicyError::RejectAfterWithoutPass)
        );
        assert_eq!(
            Policy::new()
                .ttl(Duration::from_secs(400 * 24 * 3600))
                .validate(),
            Err(PolicyError::TooLong("ttl"))
        );
    }

    #[test]
    fn key_sources_and_pointers_are_checked() {
        assert_eq!(Policy::new().key_header("webhook-id").validate(), Ok(()));
        assert_eq!(
            Policy::new().key_header("Webhook Id").validate(),
            Err(PolicyError::InvalidKeyHeader)
        );
        assert_eq!(
            Policy::new().key_field("id").validate(),
            Err(PolicyError::InvalidPointer("key_field"))
        );
        assert_eq!(
            Policy::new()
                .fingerprint_exclude(&["/a", "/b~2"])
                .validate(),
            Err(PolicyError::InvalidPointer("fingerprint_exclude"))
        );
        assert_eq!(
            Policy::new()
                .key_field("/id")
                .fingerprint_only(&["/amount", "/id"])
                .validate(),
            Err(PolicyError::KeyFieldInFingerprint)
        );
        assert_eq!(
            Policy::new()
                .key_field("/id")
                .fingerprint_exclude(&["/id"])
                .validate(),
            Ok(())
        );
    }

    #[test]
    fn a_longer_ttl_pulls_retain_along() {
        let p = Policy::new().ttl(Duration::from_secs(30 * 24 * 3600));
        assert_eq!(p.retain, p.ttl);
        assert_eq!(p.validate(), Ok(()));
    }
}
