//! The device backend: [`StepOps`](crate::exec::ops::StepOps) as device work on any
//! [`Device`](kernels::device::Device) — a GPU through cudarc (`cuda`), or the same kernels
//! and launch arguments run by the host execution layer on the CPU (`cuda-emulated`).
//!
//! The design follows candle's split of storage from device: weights are uploaded once as
//! device allocations ([`DeviceWeights`]), the paged latent cache lives in device memory (one
//! [`DeviceCache`](kernels::mla::launch::DeviceCache) per layer, pages handed out by the same
//! [`PageTables`](kernels::mla::cache::PageTables) the CPU cache uses), and a step's
//! activations live in a workspace whose buffers keep their addresses from step to step
//! ([`workspace`]). Every operation is a fixed set of launches decided by the host from the
//! step's shape alone, never from values on the device. The host writes the token ids,
//! positions, cache slots, block tables and logit rows in (one
//! [`Device::write_bytes`](kernels::device::Device::write_bytes) each) and reads sampled ids
//! or logits back: [`STEP_WRITES`] and one read per step, which `tests/device_executor.rs`
//! counts. Decode steps are captured once per shape and replayed.
//!
//! On a tensor-parallel rank ([`DeviceOps::set_all_reduce`]) the rank's all-reduce sums, in
//! stream order and inside captured graphs, what the step asks it to.
//!
//! The numerics are the CPU backend's with the device kernels' roundings: queries reach MLA
//! in BF16, the MoE input in BF16 (as on a GPU), the norm weights as BF16 (what the checkpoint
//! stores), and FP32 sums in another order; with
//! [`DenseTactic::CublasLt`](kernels::blas::DenseTactic::CublasLt) the dense products' inputs
//! in BF16 as well.
//!
//! The executor is `ops` (its operations in `ops::step`); `support` holds the tactics it runs
//! with and what its kernels fix, below the tactic selection that chooses among them. This
//! module only re-exports: its children import each other, never it.

mod all_reduce;
mod counting;
mod launch_list;
mod ops;
mod products;
pub(crate) mod support;
mod weights;
mod workspace;

#[cfg(feature = "cuda")]
pub use all_reduce::IpcAllReduce;
pub use all_reduce::{DryAllReduce, HostAddressed, ShmAllReduce, TpAllReduce};
pub use counting::{CountingDevice, DeviceTraffic, LaunchEntry};
pub use launch_list::{DryStep, KernelTotals, RecordedStep, weights_every_step_reads};
pub use ops::{
    DeviceBytes, DeviceOps, DeviceOptions, DeviceRunner, STEP_WRITES, device_moe_tactics,
    device_runner, runner_with_weights,
};
pub use support::{ExecutorTactics, device_expert_inter};
pub use weights::{DeviceHeads, DeviceKinds, DeviceMatrix, DeviceWeights, WeightsError};
pub use workspace::{
    SPLIT_ROWS, StepCapacity, WorkspaceShape, max_pages, workspace_buffer_bytes, workspace_bytes,
};
