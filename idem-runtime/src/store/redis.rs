//! The redis store (in progress).
