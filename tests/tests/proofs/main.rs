//! Model-based tests (random operation sequences against a reference model), fault injection in
//! the store and on the network, and decoding of damaged rows, on every store.

#[macro_use]
#[path = "../http/http_support.rs"]
mod http_support;
mod proof_support;

mod decode_rows;
mod faults;
mod faults_network;
mod functions;
mod model;
