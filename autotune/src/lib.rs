//! The tuning lab: for each kernel family and SM, every tactic is pruned by three stages —
//! static (the compile gate's manifest), correct (the goldens, on the device when one is
//! present, else through the host execution layer) and timed (on the device, else predicted by
//! a cost model) — and the winner per problem shape is written to the tactic cache
//! (`kernels::tactic::cache`) that the model reads at start. A device run also refits the cost
//! model to its measurements (`fit`, `refit`).

pub mod correct;
pub mod cost;
pub mod cpu;
pub mod fit;
pub mod manifest;
pub mod mutation;
pub mod refit;
pub mod shapes;
pub mod steptime;
pub mod tune;
