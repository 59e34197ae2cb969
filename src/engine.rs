//! The filter's protocol as sans-IO state machines (issue 26): each takes inputs with the
//! time (`now_ms`: work handed over, a callout answered, lost or refused, a tick) and gives
//! actions back (send this request, answer this waiter, count this, stop now). No host call: the
//! glue (`src/filter/mod.rs`) feeds them Envoy's callbacks and carries out their actions, and
//! their tests drive them with a clock they move.
//!
//! - `request`: what a request's headers, body and MCP body decide (route, key, scope, limits,
//!   fingerprint), and what a protected request does next once the local tier, its fingerprint or
//!   the store has answered (the decisions of `src/filter/http.rs`, returned as a `Step` it
//!   carries out);
//! - `machine`: one protected request as a machine (its phase with its data; headers, body
//!   chunks and end, an MCP POST's body, store answers, the response, an internal redirect's
//!   hand-over and adoption, and the exchange's end in; commands out), driven by
//!   `src/filter/http.rs` and by `world`;
//! - `budget`: the worker's buffer budget as one request counts in it (bodies buffered, the
//!   bucket read at headers kept, what is given back);
//! - `writes`: the store writes made after forwarding, their retry schedule and fallback, and the
//!   stopping root's hold until they are over;
//! - `waiters`: the requests held by `in_flight: "wait"`, answered from the local tier, the
//!   store's polls, or at their deadline;
//! - `keeper`: etcd's lease and token, kept ahead of need;
//! - `settle`: what a finished exchange does to its claim (complete, release, mark
//!   outcome-unknown) in the local tier and, through `writes`, in the store;
//! - `sweep`: the local table's sweep on a host's timer and the gauges it makes (the Wasm root's
//!   tick, the native configuration's tick);
//! - `forwards`: the detached forwards (`forwarding: "detached"`) and the probes of the internal
//!   listener chains they go through;
//! - `world` (tests only): whole requests of two proxies and a store in memory, the Envoy suites'
//!   scenarios and random schedules checked against the promise.

pub mod budget;
pub mod forwards;
pub mod keeper;
pub mod machine;
pub mod request;
pub mod settle;
pub mod sweep;
pub mod waiters;
#[cfg(test)]
pub mod world;
pub mod writes;
