//! Execution: the model's step written once ([`deepseek`]) over the operations every backend
//! serves ([`ops::StepOps`]), the runner seam the decode loop and the server drive
//! ([`runner::ModelRunner`]), and the backends: the CPU kernels ([`cpu`]) and the device
//! executor on a GPU or on the host execution layer ([`device`]). Also sampling, the decode
//! loop, tensor-parallel rank processes and the tactics a run selects.
//!
//! What every part shares lives in leaf modules of its own, [`error`] (the [`ExecError`] of
//! every step and backend) and [`ops`] (the step's operations, inputs and results), so that
//! the parts import each other and those, never this module, which only re-exports them.

pub mod backend;
pub mod cpu;
pub mod deepseek;
pub mod device;
pub mod error;
pub mod footprint;
pub mod generate;
pub mod ops;
pub mod plan;
pub mod profile;
pub mod runner;
pub mod sampler;
pub mod tactics;
pub mod tp;
pub mod weights;

pub use error::ExecError;
pub use footprint::forward_bytes;
pub use ops::{LogitRows, Logits, SeqInput, StepOutput, StepResult};
pub use runner::{ModelRunner, Runner};
