//! The sqlite store (in progress).
