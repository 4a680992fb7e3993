//! The payments service's tests. Each module runs the example's binary as its users would (several
//! processes, the shared stores, connections cut by proxies) and counts charges and payments. One
//! test binary: the modules compile once, and their waits on leases and processes overlap.

mod support;

mod client_hangs_up;
mod concurrent_payments;
mod consumer;
mod contract;
mod hang_up_after_send;
mod hostile_network;
mod killed_mid_flight;
mod long_user_ids;
mod many_instances;
mod metrics;
mod sigterm;
mod slower_than_the_lease;
mod stalled_lock;
mod store_lost;
mod store_outage;
mod webhooks;
