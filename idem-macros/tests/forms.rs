//! The forms `#[idempotent]` accepts. Each module is a file in `forms/` that writes handlers one way
//! under `#![deny(warnings)]`; its test hands them to an axum router, so the file compiling without
//! a warning is what it checks. The forms it must refuse, with their messages, are `ui.rs`'s cases.
// The files are written as the crates users write, where `pub` items are reachable.
#![allow(unreachable_pub)]

#[path = "ui/support.rs"]
mod support;
#[path = "ui/tx_support.rs"]
mod tx_support;

#[path = "forms/all_options.rs"]
mod all_options;
#[path = "forms/attributes_and_visibility.rs"]
mod attributes_and_visibility;
#[path = "forms/debug_handler.rs"]
mod debug_handler;
#[path = "forms/global_scope.rs"]
mod global_scope;
#[path = "forms/named_policy.rs"]
mod named_policy;
#[path = "forms/no_params.rs"]
mod no_params;
#[path = "forms/parts_only_last_param.rs"]
mod parts_only_last_param;
#[path = "forms/payments.rs"]
mod payments;
#[path = "forms/result_with_question_mark.rs"]
mod result_with_question_mark;
#[path = "forms/transaction_last_parameter.rs"]
mod transaction_last_parameter;
#[path = "forms/transaction_sqlite.rs"]
mod transaction_sqlite;
#[path = "forms/type_shadowing.rs"]
mod type_shadowing;
