//! The options of `#[idempotent(...)]`, listed once. Parsing (`attr.rs`: the keywords, "expected
//! one of"), validation and its messages (`config.rs`: what each value is), the expansion (the
//! order of the policy's builder calls) and the documentation's table (`lib.rs`) all read it.

use crate::values::{self, Choice};

/// What an option's value is.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    /// The name of a handler parameter, as a string.
    Param,
    /// A duration: whether `ms` is accepted, why zero is refused (`None`: zero is accepted), and
    /// whether it is capped at a year (the runtime's `MAX_TTL`).
    Duration {
        ms: bool,
        zero: Option<&'static str>,
        year: bool,
    },
    /// A value of the runtime's enum named first.
    Choice(&'static str, &'static [Choice]),
    /// A date, `YYYY-MM-DD`.
    Date,
    /// A size in bytes.
    Size,
    /// The path of a `const` policy.
    Path,
    /// An HTTP header name.
    Header,
    /// A JSON Pointer to a member of the body.
    Pointer,
    /// A list of JSON Pointers, `["/a", "/b"]`.
    Pointers,
    /// A Rust expression, evaluated when the function is called (function mode).
    Expr,
    /// A name the body binds (function mode's `attempt`).
    Ident,
}

/// Where an option applies: to axum handlers, to plain async functions (`key = ...`), or both.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Applies {
    Both,
    Handlers,
    Functions,
}

/// Generates, from one row per option (keyword, variant, kind, the example value messages
/// suggest, the documentation's "values" and "default" cells, and where it applies): [`Opt`],
/// and the `options_table!` macro that writes the documentation's table.
macro_rules! options {
    ($($name:ident $variant:ident: $kind:expr, $example:literal, $values:literal, $default:literal, $applies:ident;)*) => {
        /// One option.
        #[derive(Clone, Copy, PartialEq, Eq, Debug)]
        pub(crate) enum Opt { $($variant,)* }

        impl Opt {
            /// Every option, in the order the policy is built (`ttl` raises `retain`, so it comes first).
            pub(crate) const ALL: &'static [Opt] = &[$(Opt::$variant,)*];

            /// Its keyword, its kind, and the value suggested when it is not given a string literal.
            fn spec(self) -> (&'static str, Kind, &'static str, Applies) {
                match self { $(Opt::$variant => (stringify!($name), $kind, $example, Applies::$applies),)* }
            }

            pub(crate) fn name(self) -> &'static str { self.spec().0 }
            pub(crate) fn kind(self) -> Kind { self.spec().1 }
            pub(crate) fn example(self) -> &'static str { self.spec().2 }
            pub(crate) fn applies(self) -> Applies { self.spec().3 }
        }

        /// The documentation's table of options.
        macro_rules! options_table {
            () => {
                concat!(
                    "| option | values | default | applies to |\n|---|---|---|---|\n",
                    $("| `", stringify!($name), "` | ", $values, " | ", $default, " | ", options!(@applies $applies), " |\n",)*
                )
            };
        }
    };
    (@applies Both) => { "both" };
    (@applies Handlers) => { "handlers" };
    (@applies Functions) => { "functions" };
}

options! {
    scope Scope: Kind::Param, "user",
        "handlers: a parameter name, or `\"global\"`; functions: an expression (`Display`)", "**required**", Both;
    key Key: Kind::Expr, "msg.id",
        "an expression (`Display`): the call's idempotency key; selects function mode", "none (a handler)", Functions;
    engine Engine: Kind::Expr, "self.engine",
        "an expression: an `Engine`, `&Engine` or `Arc<Engine>`", "**required**", Functions;
    input Input: Kind::Expr, "msg",
        "an expression (`Serialize`) that tells a retry from another call; `()` opts out", "**required**", Functions;
    attempt Attempt: Kind::Ident, "attempt",
        "a name that the body sees the `Attempt` by", "none", Functions;
    ttl Ttl: Kind::Duration { ms: false, zero: Some(": a key forgotten at once protects nothing"), year: true }, "24h",
        "duration, > 0, ≤ `\"366d\"`", "`\"24h\"`", Both;
    retain Retain: Kind::Duration { ms: false, zero: Some(""), year: true }, "7d",
        "duration, ≥ `ttl`, ≤ `\"366d\"`", "`\"7d\"` (or `ttl` if longer)", Both;
    lease Lease: Kind::Duration { ms: true, zero: Some(": a claim must be held while the handler runs"), year: false }, "30s",
        "duration (`ms` allowed), > 0", "`\"30s\"`", Both;
    wait Wait: Kind::Duration { ms: true, zero: None, year: false }, "10s",
        "duration (`ms` allowed), may be `\"0s\"`", "`\"10s\"`", Both;
    missing_key MissingKey: Kind::Choice("MissingKey", values::MISSING_KEY), "reject",
        "`\"reject\"`, `\"pass\"`, `\"derive\"`", "`\"reject\"`", Handlers;
    derive_window DeriveWindow: Kind::Duration { ms: false, zero: Some(""), year: false }, "10s",
        "duration, > 0, ≤ `ttl`; only with `missing_key = \"derive\"`", "`\"10s\"`", Handlers;
    reject_after RejectAfter: Kind::Date, "2027-03-01",
        "date `\"YYYY-MM-DD\"`; only with `missing_key = \"pass\"`", "none", Handlers;
    replay Replay: Kind::Choice("ReplayMode", values::REPLAY), "full",
        "`\"full\"`, `\"minimal\"`", "`\"full\"`", Handlers;
    server_errors ServerErrors: Kind::Choice("ServerErrors", values::SERVER_ERRORS), "release",
        "`\"release\"`, `\"store\"`", "`\"release\"`", Handlers;
    client_errors ClientErrors: Kind::Choice("ClientErrors", values::CLIENT_ERRORS), "store",
        "`\"store\"`, `\"release\"`", "`\"store\"`", Handlers;
    key_header KeyHeader: Kind::Header, "webhook-id",
        "a header name; not with `key_field`", "`Idempotency-Key`", Handlers;
    key_field KeyField: Kind::Pointer, "/id",
        "a JSON Pointer to a body member, like `\"/data/request_id\"`", "none", Handlers;
    fingerprint_exclude FingerprintExclude: Kind::Pointers, "/sent_at",
        "JSON Pointers, `[\"/sent_at\", \"/meta/trace_id\"]`; not with `fingerprint_only`", "none", Handlers;
    fingerprint_only FingerprintOnly: Kind::Pointers, "/amount",
        "JSON Pointers, `[\"/amount\", \"/currency\"]`", "the whole request", Handlers;
    policy Policy: Kind::Path, "PAYMENTS",
        "path of a `const` [`Policy`]", "`Policy::new()`", Both;
    max_body MaxBody: Kind::Size, "1MiB",
        "size: `\"<n>B\"`, `\"KiB\"`, `\"MiB\"`, `\"GiB\"`, > 0, ≤ `\"1GiB\"`", "`\"1MiB\"`", Handlers;
    transaction Transaction: Kind::Param, "tx",
        "a parameter name, of type `idem_runtime::Tx<Postgres>` or `Tx<Sqlite>`", "none", Handlers;
}
