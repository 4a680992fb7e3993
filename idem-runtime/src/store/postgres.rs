//! The postgres store (in progress).
