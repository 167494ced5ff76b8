//! The MoE grouped GEMM: routed experts applied to the tokens routed to them.
//!
//! - [`reference`]: the CPU reference with the checkpoint's exact W4A4 semantics.

pub mod reference;
