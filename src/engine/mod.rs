//! The engine: the filter's protocol as plain state machines (no host calls): inputs in,
//! commands out; `src/filter/` executes the commands.

pub mod request;
