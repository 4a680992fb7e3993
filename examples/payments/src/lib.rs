//! A small payments API protected by idem (in progress).
