//! What the binary-level tests share: `model serve` on loopback ([`server`]), and the rank
//! processes and shared-memory segments a run may leave behind.

// Each test file uses a part of it.
#![allow(dead_code)]

pub mod cli;
pub mod server;

/// The `model` binary under test: this crate's, or the one `MODEL_BIN` names (to show that a
/// suite fails on an older build).
pub fn model_binary() -> std::path::PathBuf {
    std::env::var_os("MODEL_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_model").into())
}

impl server::Server {
    /// Starts `model serve EXTRA…` ([`model_binary`]) and waits until `/health` answers 200.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_with(std::process::Command::new(model_binary()), extra)
    }
}

/// Processes whose parent is `parent` (`/proc/PID/stat`'s fourth field).
pub fn children_of(parent: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                let after = stat.rsplit(')').next().unwrap_or("");
                after.split_whitespace().nth(1) == Some(&parent.to_string())
            })
        })
        .collect()
}

/// Whether `pid` is gone or a zombie nobody reaped yet.
pub fn exited(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
    })
}

/// Names in `/dev/shm` containing `containing`.
pub fn shm_entries(containing: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.contains(containing))
                .collect()
        })
        .unwrap_or_default()
}
