//! The store conformance suite on the in-memory store.

use idem_runtime::clock::Clock;
use idem_runtime::store::memory::MemoryStore;
use idem_tests::conformance::Backend;
use std::sync::Arc;

struct Memory;

#[async_trait::async_trait]
impl Backend for Memory {
    type Store = MemoryStore;
    async fn open(&self, clock: Arc<dyn Clock>) -> MemoryStore {
        MemoryStore::new().with_clock(clock)
    }
    fn durable(&self) -> bool {
        false
    }
    async fn unreachable(&self) -> Option<MemoryStore> {
        None
    }
}

async fn memory() -> Memory {
    Memory
}

idem_tests::conformance_suite!(memory);
