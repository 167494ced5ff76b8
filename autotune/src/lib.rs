//! The tuning lab: for each kernel family and SM, every tactic is pruned by three stages —
//! static (the compile gate's manifest), correct (the goldens, through the host execution
//! layer when no device is present) and timed (on the device, else predicted by a cost model)
//! — and the winner per problem shape is written to the tactic cache
//! (`kernels::tactic::cache`) that the model reads at start.

pub mod correct;
pub mod cost;
pub mod cpu;
pub mod manifest;
pub mod mutation;
pub mod shapes;
pub mod steptime;
pub mod tune;
