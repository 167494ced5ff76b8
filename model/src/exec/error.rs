//! The error of every step, runner and backend of [`crate::exec`], and what becomes of the
//! errors of the layers below it (the device, the latent cache's pages).

use kernels::device::DeviceError;
use kernels::mla::cache::CacheError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ExecError {
    #[error(transparent)]
    Cache(CacheError),
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("position {pos} exceeds max_position_embeddings {max}")]
    ContextTooLong { pos: usize, max: usize },
    #[error("tensor-parallel all-reduce failed: {0}")]
    AllReduce(String),
    /// A tensor-parallel rank exited or stopped taking commands; the message names it.
    #[error("{0}")]
    RankLost(String),
    /// The first place whose output holds NaN or Inf: a damaged weight, or values the model
    /// cannot represent. Nothing after it would mean anything.
    #[error(
        "the output of {place} is not finite (row {row}, element {element} is {value}); `model inspect` checks the checkpoint's weights"
    )]
    NonFinite {
        place: String,
        row: usize,
        element: usize,
        value: f32,
    },
    #[error("{0}")]
    InvalidRequest(String),
    /// The device (GPU or host execution layer) failed.
    #[error("device: {0}")]
    Device(String),
    /// The model's shape, or a weight, is outside what the backend implements.
    #[error("the {backend} backend cannot run this model: {why}")]
    Unsupported { backend: &'static str, why: String },
}

impl ExecError {
    /// Whether the caller asked for something the model cannot do (rather than the model
    /// failing while doing it).
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            Self::TokenOutOfRange { .. } | Self::ContextTooLong { .. } | Self::InvalidRequest(_)
        )
    }

    /// Whether the runner cannot go on after it: the device failed, or a tensor-parallel rank
    /// (or its collective) did.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Self::Device(_) | Self::AllReduce(_) | Self::RankLost(_)
        )
    }

    /// Whether the model or its options are outside what the backend runs (refused before any
    /// work: exit code 2).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. })
    }
}

impl From<DeviceError> for ExecError {
    fn from(e: DeviceError) -> Self {
        Self::Device(e.to_string())
    }
}

impl From<CacheError> for ExecError {
    fn from(e: CacheError) -> Self {
        Self::Cache(e)
    }
}
