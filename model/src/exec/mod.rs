//! Execution: the forward pass on the CPU and on devices, the decode loop, sampling, tensor
//! parallelism and tactic selection.

pub mod cpu;
pub mod device;
pub mod forward;
pub mod generate;
pub mod plan;
pub mod sampler;
pub mod tactics;
pub mod tp;
