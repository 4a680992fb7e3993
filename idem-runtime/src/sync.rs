//! The synchronisation primitives the memory store and the wake-up registry are built on.
//!
//! `std::sync` normally; under `--cfg loom` the same names are loom's, whose every lock and atomic
//! operation is a point where the model checker may switch threads, so `tests/loom.rs` can explore
//! every interleaving of that code. Only code whose synchronisation loom should check goes through
//! here: a loom type used outside a loom model panics, so nothing the PostgreSQL, Redis or SQLite
//! stores need at run time (beyond [`Waiters`](crate::store::Waiters)) may use it.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{fence, AtomicUsize},
    Arc, Mutex, MutexGuard,
};
#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{fence, AtomicUsize},
    Arc, Mutex, MutexGuard,
};
