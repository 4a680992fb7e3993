//! A counting global allocator: live heap bytes and allocation calls, for bytes per record and
//! allocations per request.
//!
//! Counting is on only while the `memory` section and `profile` run (one task, one thread), and
//! [`stop_counting`] turns it off before any throughput is measured. The counters are shared atomics:
//! under load on two threads every allocation and free would bounce their cache line between the
//! cores, a cost proportional to the allocations per request, so it would charge the annotated
//! handler (more allocations) more than the plain one and distort the very ratio the bench reports.
//! Switched off, an allocation pays one load of a flag that is never written again.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU64, Ordering::Relaxed};

pub(crate) struct Counting;

static ON: AtomicBool = AtomicBool::new(true);
static LIVE: AtomicIsize = AtomicIsize::new(0);
static LIVE_BLOCKS: AtomicIsize = AtomicIsize::new(0);
static LIVE_CHUNKS: AtomicIsize = AtomicIsize::new(0);
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Turns counting off for the rest of the process (throughput, latency and the other sections).
pub(crate) fn stop_counting() {
    ON.store(false, Relaxed);
}

/// The bytes glibc's malloc takes for a request of `size` bytes on 64-bit Linux: the size plus an
/// 8-byte header, rounded up to 16, at least 32 (its `request2size`; `malloc_usable_size` is this
/// minus 8). Not modelled, all negligible for the records measured: blocks served by `mmap` (128 KiB
/// and up, page-rounded), alignments above 16, and a shrinking `realloc` that keeps the larger block.
fn chunk(size: usize) -> isize {
    ((size + 8).div_ceil(16) * 16).max(32) as isize
}

/// One allocation of `size` bytes came (`sign` 1) or went (`sign` -1); `calls` allocation calls.
fn count(size: usize, sign: isize, calls: u64) {
    if ON.load(Relaxed) {
        LIVE.fetch_add(sign * size as isize, Relaxed);
        LIVE_BLOCKS.fetch_add(sign, Relaxed);
        LIVE_CHUNKS.fetch_add(sign * chunk(size), Relaxed);
        CALLS.fetch_add(calls, Relaxed);
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size(), 1, 1);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size(), 1, 1);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every path above forwards to it).
        unsafe { System.dealloc(ptr, layout) };
        count(layout.size(), -1, 0);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as for `dealloc`; the caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(layout.size(), -1, 0);
            count(new_size, 1, 1);
        }
        p
    }
}

/// Heap bytes currently allocated (requested sizes, not the allocator's rounding).
pub(crate) fn live_bytes() -> isize {
    LIVE.load(Relaxed)
}

/// Allocations currently live.
pub(crate) fn live_blocks() -> isize {
    LIVE_BLOCKS.load(Relaxed)
}

/// Heap bytes currently allocated as glibc's malloc lays them out ([`chunk`]).
pub(crate) fn live_chunk_bytes() -> isize {
    LIVE_CHUNKS.load(Relaxed)
}

/// Allocation calls so far (alloc, alloc_zeroed, realloc).
pub(crate) fn calls() -> u64 {
    CALLS.load(Relaxed)
}
