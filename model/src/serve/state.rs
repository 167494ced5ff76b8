//! What every request handler of the server shares: the runtime, the names clients see, the
//! drain's state, and the redaction of server paths from what clients read.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::sync::{Semaphore, watch};

use super::api::ApiError;
use super::api_key::ApiKey;
use super::runtime::Runtime;

pub(super) struct AppState {
    pub(super) runtime: Runtime,
    pub(super) model_name: String,
    /// The checkpoint folder's name: what clients see instead of its path.
    pub(super) checkpoint_name: String,
    /// The checkpoint folder's absolute spellings, replaced by its name in what clients see.
    pub(super) checkpoint_paths: Vec<String>,
    pub(super) created: u64,
    /// What `/v1/*` requests must carry, if anything.
    pub(super) api_key: Option<ApiKey>,
    pub(super) shutting_down: AtomicBool,
    pub(super) body_read_timeout: Duration,
    /// Turns true when the drain's grace period ends: every choice still generating stops.
    pub(super) grace_over: watch::Receiver<bool>,
    /// Template renders and prompt tokenization run on blocking threads, one per core at most.
    pub(super) prompt_workers: Arc<Semaphore>,
}

pub(super) type Shared = Arc<AppState>;

impl AppState {
    /// `text` with the checkpoint's path replaced by its name: a client learns nothing of the
    /// server's file system.
    pub(super) fn redact(&self, text: &str) -> String {
        self.checkpoint_paths
            .iter()
            .fold(text.to_string(), |text, path| {
                text.replace(path.as_str(), &self.checkpoint_name)
            })
    }

    pub(super) fn public(&self, mut error: ApiError) -> ApiError {
        error.message = self.redact(&error.message);
        error
    }
}
