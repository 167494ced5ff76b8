//! The model layer: checkpoint → model → kernels → backend.
//!
//! Today it holds the tensor-file reader every loader shares; config, checkpoint, layers and
//! the decode loop arrive with the model work.

pub mod nvfp4_file;
pub mod tensor_file;
