//! What an interrupted process must not leave behind: staged output folders and files, and
//! all-reduce segment names in `/dev/shm`.
//!
//! Registering the first item installs handlers for SIGINT, SIGTERM and SIGHUP (signal-hook,
//! so other handlers of the same signals still run). On one of them a dedicated thread removes
//! every registered item, then ends the process with the signal's default action, so the exit
//! status still says which signal ended it. Processes that never register anything keep the
//! default signal behaviour. SIGKILL cannot be caught: staged outputs carry their writer's pid
//! in their name, and the next writer into the same folder sweeps those of dead processes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, Once};

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};

enum Item {
    Path(PathBuf),
    Segment(String),
}

static ITEMS: Mutex<Vec<(u64, Item)>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(0);
static INSTALL: Once = Once::new();
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Keeps an item registered until dropped (dropping does not remove the item itself).
#[must_use = "the item is forgotten when the registration is dropped"]
pub struct Registration(u64);

impl Drop for Registration {
    fn drop(&mut self) {
        if let Ok(mut items) = ITEMS.lock() {
            items.retain(|(id, _)| *id != self.0);
        }
    }
}

fn register(item: Item) -> Registration {
    install();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    ITEMS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .push((id, item));
    Registration(id)
}

/// Removes `path` (a file or a whole folder) if the process is interrupted.
pub fn register_path(path: impl Into<PathBuf>) -> Registration {
    register(Item::Path(path.into()))
}

/// Unlinks the shared-memory segment `name` if the process is interrupted.
pub fn register_segment(name: impl Into<String>) -> Registration {
    register(Item::Segment(name.into()))
}

/// Removes every registered item now (signal and watchdog paths; idempotent).
pub fn remove_all() {
    let items = match ITEMS.lock() {
        Ok(items) => items,
        Err(poisoned) => poisoned.into_inner(),
    };
    for (_, item) in items.iter() {
        match item {
            Item::Path(path) => remove_path(path),
            Item::Segment(name) => {
                let _ = kernels::allreduce::shm::remove_segment(name);
            }
        }
    }
}

/// Removes a file or folder; the writer may still be adding files, so a folder that is not
/// empty yet is retried a few times.
pub fn remove_path(path: &std::path::Path) {
    for _ in 0..5 {
        let result = match std::fs::symlink_metadata(path) {
            Err(_) => return,
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
            Ok(_) => std::fs::remove_file(path),
        };
        if result.is_ok() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

fn install() {
    INSTALL.call_once(|| {
        let signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]);
        let Ok(mut signals) = signals else {
            // Without handlers an interruption leaves staged outputs for the next sweep.
            return;
        };
        let spawned = std::thread::Builder::new()
            .name("cleanup-on-signal".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    INTERRUPTED.store(true, Ordering::SeqCst);
                    remove_all();
                    let _ = signal_hook::low_level::emulate_default_handler(signal);
                    std::process::exit(128 + signal);
                }
            });
        drop(spawned);
    });
}

/// Blocks for good once an interruption is being handled: the work failing because its
/// temporaries vanished must not end the process with an error of its own before the signal
/// ends it.
pub fn wait_if_interrupted() {
    while INTERRUPTED.load(Ordering::SeqCst) {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Whether process `pid` exists (for sweeping what dead processes left).
pub fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence and permission.
    let result = unsafe { libc::kill(pid, 0) };
    result == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}
