//! What an interrupted process must not leave behind: staged output folders and files, and
//! all-reduce segment names in `/dev/shm`.
//!
//! Registering the first item installs handlers for SIGINT, SIGTERM and SIGHUP (signal-hook,
//! so other handlers of the same signals still run). On one of them a dedicated thread removes
//! every registered item, then ends the process with the signal's default action, so the exit
//! status still says which signal ended it. Processes that never register anything keep the
//! default signal behaviour. A process that drains on SIGINT and SIGTERM itself leaves the
//! first of them to its own handler ([`leave_interruptions_to_the_process`]); a
//! tensor-parallel follower ignores them while rank 0 lives ([`interruptions_follow_parent`]).
//! SIGKILL cannot be caught: staged outputs carry their writer's pid
//! in their name, and the next writer into the same folder sweeps those of dead processes.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
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
static PROCESS_DRAINS: AtomicBool = AtomicBool::new(false);

/// For a process that handles SIGINT and SIGTERM itself by draining its work and ending in
/// order (the server), which removes what it registered on the way: the first of those
/// signals is left to it. A second one, or SIGHUP, removes every item and ends the process as
/// usual, so an operator can still cut a drain short.
pub fn leave_interruptions_to_the_process() {
    PROCESS_DRAINS.store(true, Ordering::SeqCst);
}

/// The parent a tensor-parallel follower takes its interruptions from; 0 for none.
static FOLLOWED_PARENT: AtomicU32 = AtomicU32::new(0);

/// For a tensor-parallel follower: SIGINT and SIGTERM are ignored while its parent (rank 0)
/// lives, because rank 0 decides when the group stops (a terminal's Ctrl-C, or a service
/// manager's SIGTERM to every process of the group, reaches the followers too, and a follower
/// that died would fail the drain rank 0 is running). Once the parent is gone (the
/// parent-death signal) the signal ends the process as usual.
pub fn interruptions_follow_parent() {
    FOLLOWED_PARENT.store(std::os::unix::process::parent_id(), Ordering::SeqCst);
    install();
}

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
                let mut drain_left_to_the_process = true;
                for signal in signals.forever() {
                    let parent = FOLLOWED_PARENT.load(Ordering::SeqCst);
                    if parent != 0
                        && signal != SIGHUP
                        && std::os::unix::process::parent_id() == parent
                    {
                        continue;
                    }
                    if signal != SIGHUP
                        && PROCESS_DRAINS.load(Ordering::SeqCst)
                        && std::mem::take(&mut drain_left_to_the_process)
                    {
                        continue;
                    }
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
