//! Where the CPU backend's kernels run: the calling thread and rayon's global pool, or the
//! thread pool of a tuned [`CpuTactic`], with a step's threads waiting for its work awake and
//! fewer threads while other processes keep the cores busy.

use std::sync::Arc;

use kernels::cpu_tactic::CpuTactic;

/// The CPU kernels' tactic and threads. Every knob but the thread count is passed to the
/// kernels with each call; a tactic with a thread count of its own runs the calls in a rayon
/// pool of that size, owned here (so no process-wide setting: a call is handed to that pool
/// exactly as a call from outside rayon's global pool is handed to the global one).
///
/// Made [`tuned`](Self::tuned) (`model run`, `serve`, `chat`), a step runs on a thread of the
/// pool with the others waiting for its work awake, and while other processes keep cores busy
/// with only the cores they leave ([`step_threads`]): a fork-join step waits at every join for
/// its slowest thread, and a thread that shares its core with another process is descheduled
/// for whole time slices, so with one busy process on two cores a two-thread step ran at 0.3
/// of its quiet speed where one thread keeps about half. `KIMI_CPU_ADAPTIVE_THREADS=0` turns
/// this off. Made [`plain`](Self::plain) (tests, calibration), a step runs on the calling
/// thread with the default tactic, its calls forking into rayon's global pool.
#[derive(Clone, Debug, Default)]
pub struct CpuCompute {
    tactic: CpuTactic,
    /// Steps run on the pool, with helpers and adaptive threads (else on the caller's thread).
    managed: bool,
    pool: Option<Arc<rayon::ThreadPool>>,
    /// Pools of fewer threads for contended steps, by size, made when first needed.
    reduced: Arc<std::sync::Mutex<Vec<Arc<rayon::ThreadPool>>>>,
    contention: Arc<std::sync::Mutex<ContentionSamples>>,
}

/// How often a step re-reads how busy the other processes keep the cores. Reading
/// `/proc/loadavg` and every thread's `stat` takes about 0.1 ms on a VM, 1.3 % of a decode step
/// when it ran before every step (measured with `model run --profile-ops`, `mini`, 2 vCPUs;
/// every 25 ms still cost 0.04 ms per step); the contention a step reacts to lasts seconds.
pub const CONTENTION_SAMPLE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// The last two samples of [`step_threads`], for [`ContentionSamples::threads`].
#[derive(Debug, Default)]
struct ContentionSamples {
    sampled_at: Option<std::time::Instant>,
    /// Threads the newest and the one before allowed.
    recent: [usize; 2],
}

impl ContentionSamples {
    /// Threads a step at `now` should use out of `threads`: `sample()` (the cores other
    /// processes leave) is re-read once [`CONTENTION_SAMPLE_INTERVAL`] has passed, and a step
    /// runs on fewer threads only when the last two samples both say so. One sample can catch
    /// a stray runnable thread (a kernel worker, a shell starting a command), which would
    /// halve a two-thread step for nothing.
    fn threads(
        &mut self,
        now: std::time::Instant,
        threads: usize,
        sample: impl FnOnce() -> usize,
    ) -> usize {
        let due = self
            .sampled_at
            .is_none_or(|at| now.duration_since(at) >= CONTENTION_SAMPLE_INTERVAL);
        if due {
            let previous = if self.sampled_at.is_some() {
                self.recent[0]
            } else {
                threads
            };
            self.recent = [sample(), previous];
            self.sampled_at = Some(now);
        }
        self.recent[0].max(self.recent[1]).clamp(1, threads)
    }
}

/// Environment variable that turns the contended-step thread reduction off (`0`).
pub const ADAPTIVE_THREADS_ENV: &str = "KIMI_CPU_ADAPTIVE_THREADS";

thread_local! {
    /// Set while a contended step runs on a reduced pool: the backend's calls stay in it.
    static IN_REDUCED_STEP: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Threads a step should use out of `threads`: the cores that other processes' runnable
/// threads leave (at least one), from `/proc/loadavg`'s running count minus this process's
/// running threads; `threads` where that cannot be read.
pub fn step_threads(threads: usize) -> usize {
    let cores = kernels::cpu_tactic::machine_cores();
    match others_running() {
        Some(others) => threads.min(cores.saturating_sub(others).max(1)),
        None => threads,
    }
}

/// Runnable threads of other processes, system-wide, now.
fn others_running() -> Option<usize> {
    use kernels::files::{TEXT_FILE_LIMIT, read_text_bounded};
    let loadavg = read_text_bounded(std::path::Path::new("/proc/loadavg"), TEXT_FILE_LIMIT);
    let running = running_in_loadavg(&loadavg.ok()?)?;
    let mut own = 0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = read_text_bounded(&task.ok()?.path().join("stat"), TEXT_FILE_LIMIT).ok()?;
        own += usize::from(task_is_running(&stat)?);
    }
    Some(running.saturating_sub(own))
}

/// The runnable count of `/proc/loadavg` (its fourth field, `running/total`).
fn running_in_loadavg(text: &str) -> Option<usize> {
    text.split_whitespace()
        .nth(3)?
        .split('/')
        .next()?
        .parse()
        .ok()
}

/// Whether a `/proc/<pid>/task/<tid>/stat` line is of a running thread: its state follows the
/// `)` that closes the command name (which may itself hold spaces and parentheses).
fn task_is_running(stat: &str) -> Option<bool> {
    Some(stat.rsplit_once(')')?.1.split_whitespace().next()? == "R")
}

/// Environment variable that stops the pool's other threads from waiting for a step's work
/// spinning (`0`): they then sleep between the step's calls, as rayon's idle threads do.
pub const SPIN_ENV: &str = "KIMI_CPU_SPIN";

/// Runs `step` on this pool thread while every other thread of the pool waits for its work
/// awake, taking each job the step forks as soon as it is pushed. A thread that rayon has put
/// to sleep between two calls takes a futex wake to join the next one, tens of µs on a VM:
/// as long as a decode step's smaller products, so the second core used to join them late.
/// (llama.cpp's threads spin between operations for the same reason.) Where other processes
/// keep cores busy, [`step_threads`] has already given the step a smaller pool.
fn step_with_helpers(step: &mut (dyn FnMut() + Send)) {
    let helpers = rayon::current_num_threads().saturating_sub(1);
    if helpers == 0 || std::env::var_os(SPIN_ENV).is_some_and(|v| v == "0") {
        return step();
    }
    let done = std::sync::atomic::AtomicBool::new(false);
    let owner = rayon::current_thread_index();
    rayon::in_place_scope(|scope| {
        for _ in 0..helpers {
            scope.spawn(|_| {
                // The step's own thread, finding a helper job in a join, must not wait for the
                // step to end: it is that step.
                if rayon::current_thread_index() == owner {
                    return;
                }
                while !done.load(std::sync::atomic::Ordering::Acquire) {
                    if rayon::yield_now() != Some(rayon::Yield::Executed) {
                        std::hint::spin_loop();
                    }
                }
            });
        }
        step();
        done.store(true, std::sync::atomic::Ordering::Release);
    });
}

impl CpuCompute {
    /// The default tactic, each step on the calling thread.
    pub fn plain() -> Self {
        Self::default()
    }

    /// `tactic`, each step on its pool (see the type's documentation).
    ///
    /// # Errors
    /// If the tactic is invalid or its thread pool cannot be built.
    pub fn tuned(tactic: CpuTactic) -> Result<Self, String> {
        tactic.validate().map_err(|e| e.to_string())?;
        let pool = if tactic.threads == 0 {
            None
        } else {
            Some(Arc::new(tactic.build_pool().map_err(|e| {
                format!("cpu tactic threads={}: {e}", tactic.threads)
            })?))
        };
        Ok(Self {
            tactic,
            managed: true,
            pool,
            reduced: Default::default(),
            contention: Default::default(),
        })
    }

    fn reduced_pool(&self, threads: usize) -> Option<Arc<rayon::ThreadPool>> {
        let mut pools = self.reduced.lock().ok()?;
        if let Some(pool) = pools.iter().find(|p| p.current_num_threads() == threads) {
            return Some(pool.clone());
        }
        let pool = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("cpu-step-{i}"))
                .build()
                .ok()?,
        );
        pools.push(pool.clone());
        Some(pool)
    }

    pub fn tactic(&self) -> &CpuTactic {
        &self.tactic
    }

    /// Runs one kernel call in the pool it belongs to (at once, inside a step already there).
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.pool {
            Some(pool) if !IN_REDUCED_STEP.get() => pool.install(f),
            _ => f(),
        }
    }

    /// Runs `step`, which makes all of one forward step's calls.
    pub fn run_step(&self, step: &mut (dyn FnMut() + Send)) {
        if !self.managed {
            return step();
        }
        let threads = self
            .pool
            .as_ref()
            .map_or_else(rayon::current_num_threads, |p| p.current_num_threads());
        let adaptive = std::env::var_os(ADAPTIVE_THREADS_ENV).is_none_or(|v| v != "0");
        let want = if adaptive {
            self.contention.lock().map_or(threads, |mut samples| {
                samples.threads(std::time::Instant::now(), threads, || step_threads(threads))
            })
        } else {
            threads
        };
        match (want < threads).then(|| self.reduced_pool(want)).flatten() {
            Some(pool) => pool.install(|| {
                IN_REDUCED_STEP.set(true);
                step();
                IN_REDUCED_STEP.set(false);
            }),
            // The whole step on a thread of the pool its calls run in: a call from inside the
            // pool forks there, while a call from outside hands itself to the pool and sleeps
            // until it is done, two thread switches for each of the ~70 calls of a decode step.
            None => match &self.pool {
                Some(pool) => pool.install(|| step_with_helpers(step)),
                None => rayon::scope(|_| step_with_helpers(step)),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_gets_between_one_thread_and_all_of_them() {
        for threads in 1..5 {
            let n = step_threads(threads);
            assert!((1..=threads).contains(&n), "{threads} threads: {n}");
        }
    }

    #[test]
    fn contention_is_sampled_at_intervals_and_acted_on_when_two_samples_agree() {
        use std::time::{Duration, Instant};
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut samples = ContentionSamples::default();
        let mut reads = 0;
        let mut step = |samples: &mut ContentionSamples, now, free: usize| {
            samples.threads(now, 2, || {
                reads += 1;
                free
            })
        };
        // A first busy sample alone does not reduce the step; nor do steps before the next.
        assert_eq!(step(&mut samples, at(0), 1), 2);
        assert_eq!(step(&mut samples, at(5), 1), 2);
        // The second busy sample agrees: one thread.
        let next = CONTENTION_SAMPLE_INTERVAL.as_millis() as u64;
        assert_eq!(step(&mut samples, at(next), 1), 1);
        assert_eq!(step(&mut samples, at(next + 1), 2), 1);
        // A quiet sample gives the threads back at once.
        assert_eq!(step(&mut samples, at(2 * next), 2), 2);
        // A stray busy sample between quiet ones changes nothing.
        assert_eq!(step(&mut samples, at(3 * next), 1), 2);
        assert_eq!(step(&mut samples, at(4 * next), 2), 2);
        assert_eq!(reads, 5, "one read per interval");
    }

    /// Steps on a pool of several threads, with helpers waiting for their work awake: each
    /// gives the sum its forks compute on the pool's threads, and steps that run at once from
    /// several threads (a helper may pick up another step's job) all end. (Which threads take
    /// part is not asserted: on a busy machine a step runs on a reduced pool.)
    #[test]
    fn steps_with_spinning_helpers_compute_their_forks_and_end() {
        use rayon::prelude::*;
        use std::collections::HashSet;
        use std::sync::Mutex;
        for threads in [2, 3] {
            let backend = CpuCompute::tuned(CpuTactic {
                threads,
                ..CpuTactic::DEFAULT
            })
            .unwrap();
            let workers = Mutex::new(HashSet::new());
            std::thread::scope(|s| {
                for caller in 0..3u64 {
                    let (backend, workers) = (&backend, &workers);
                    s.spawn(move || {
                        for step in 0..20u64 {
                            let mut sum = 0u64;
                            backend.run_step(&mut || {
                                sum = (0..10_000usize)
                                    .into_par_iter()
                                    .with_max_len(64)
                                    .map(|i| {
                                        workers
                                            .lock()
                                            .unwrap()
                                            .insert(rayon::current_thread_index());
                                        i as u64 * (caller + step)
                                    })
                                    .sum();
                            });
                            assert_eq!(sum, 49_995_000 * (caller + step));
                        }
                    });
                }
            });
            let workers = workers.into_inner().unwrap();
            assert!(
                !workers.is_empty() && workers.iter().all(Option::is_some),
                "every fork ran in a pool"
            );
        }
    }

    #[test]
    fn the_proc_files_are_read_as_linux_writes_them() {
        assert_eq!(running_in_loadavg("0.70 1.74 2.29 3/412 12345\n"), Some(3));
        assert_eq!(running_in_loadavg("0.70 1.74"), None);
        assert_eq!(
            task_is_running("4242 (cpu step (1)) R 1 4242 0"),
            Some(true)
        );
        assert_eq!(task_is_running("4242 (model) S 1 4242 0"), Some(false));
        assert_eq!(task_is_running("garbage"), None);
        if std::path::Path::new("/proc/loadavg").exists() {
            assert!(others_running().is_some(), "/proc is readable here");
        }
    }
}
