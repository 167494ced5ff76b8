//! Other processes as a peer sees them: running, stopped (SIGSTOP, a job-control stop), or
//! gone. A collective or a launcher waiting on a stopped peer would otherwise wait out its whole
//! timeout, since a stopped process still exists.

use std::time::{Duration, Instant};

/// How long a peer may stay stopped, in this process's own running time, before it counts as
/// lost. Long enough for a terminal's `fg` to continue a whole group after Ctrl-Z (every
/// process continues within microseconds), short against any collective's timeout.
pub const STOPPED_PEER_GRACE: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessState {
    Running,
    /// Stopped by a signal (`T` in `/proc/PID/stat`); a debugger's tracing stop is not this.
    Stopped,
    Gone,
}

/// The state of `pid`: `/proc/PID/stat`'s state field (a zombie is gone).
pub fn process_state(pid: u32) -> ProcessState {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return ProcessState::Gone;
    };
    // The command name in parentheses may hold spaces and parentheses: the state follows the
    // last ')'.
    match stat
        .rsplit(')')
        .next()
        .and_then(|rest| rest.trim_start().chars().next())
    {
        Some('T') => ProcessState::Stopped,
        Some('Z' | 'X') | None => ProcessState::Gone,
        Some(_) => ProcessState::Running,
    }
}

/// How long a peer has been seen stopped, counting only time in which this process itself ran:
/// two looks further apart than [`StoppedClock::MAX_GAP`] (this process was stopped or starved
/// too, as the whole group is after Ctrl-Z) start the count again.
#[derive(Debug, Default)]
pub struct StoppedClock {
    stopped_for: Duration,
    last_look: Option<Instant>,
}

impl StoppedClock {
    const MAX_GAP: Duration = Duration::from_millis(250);

    /// Records one look at `state`; true once the peer has been stopped for `grace`.
    pub fn stopped_beyond(&mut self, state: ProcessState, grace: Duration) -> bool {
        let now = Instant::now();
        let previous = self.last_look.replace(now);
        if state != ProcessState::Stopped {
            self.stopped_for = Duration::ZERO;
            return false;
        }
        match previous {
            Some(at) if now - at <= Self::MAX_GAP => self.stopped_for += now - at,
            _ => self.stopped_for = Duration::ZERO,
        }
        self.stopped_for >= grace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_child_is_seen_stopped_then_running_then_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        assert_eq!(process_state(pid), ProcessState::Running);
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while process_state(pid) != ProcessState::Stopped {
            assert!(Instant::now() < deadline, "SIGSTOP shows as stopped");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut clock = StoppedClock::default();
        let started = Instant::now();
        while !clock.stopped_beyond(process_state(pid), Duration::from_millis(200)) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(started.elapsed() >= Duration::from_millis(200));
        unsafe { libc::kill(pid as i32, libc::SIGCONT) };
        while process_state(pid) == ProcessState::Stopped {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!clock.stopped_beyond(process_state(pid), Duration::ZERO));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(process_state(pid), ProcessState::Gone);
    }

    #[test]
    fn looks_far_apart_do_not_add_up() {
        let mut clock = StoppedClock::default();
        assert!(!clock.stopped_beyond(ProcessState::Stopped, Duration::from_millis(1)));
        std::thread::sleep(StoppedClock::MAX_GAP + Duration::from_millis(50));
        assert!(!clock.stopped_beyond(ProcessState::Stopped, Duration::from_millis(1)));
    }
}
