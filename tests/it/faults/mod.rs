//! What `make test-faults` runs besides the `faults` submodules of the other suites: the fault
//! matrix, hostile input, the soak, capacity, durability, a hostile store and a flood of keys.

mod capacity;
mod durability;
mod hostile;
mod hostile_store;
mod matrix;
mod memory_flood;
mod soak;
