//! The process heap's policy for the activations a forward step frees.
//!
//! A prefill step allocates and frees megabytes of activations per layer (a 128-token prompt's
//! absorbed queries alone are 2 MiB). glibc, by default, serves such blocks with `mmap` or trims
//! them off the heap's top once freed, so the next layer faults the same memory back in, a page
//! at a time, zeroed by the kernel: 16,500 page faults and about 10 ms of a 128-token prefill's
//! 160 ms (measured, AVX2). llama.cpp sidesteps this with one compute buffer planned ahead; we
//! keep freed blocks in the heap instead, where the next step's allocations find them.
//!
//! The step runs on a pool thread, and glibc gives each thread an arena of its own whose heaps
//! are at most 64 MiB; a heap left empty is unmapped whatever the trim threshold. A 512-token
//! prefill's activations outgrow one such heap, and its next step faulted 43,000 pages back in.
//! So every thread shares the main arena, which grows without that bound (small blocks still
//! come from each thread's cache, without the arena's lock).

/// Blocks up to this size come from the heap, not from their own `mmap` (glibc's largest
/// allowed threshold on 64-bit targets).
pub const HEAP_BLOCK_MAX_BYTES: usize = 32 << 20;

/// Freed memory at the heap's top that stays mapped before glibc gives any back.
pub const RETAINED_FREE_BYTES: usize = 1 << 30;

/// Arenas the process's threads share: the main one only (see the module's text).
pub const ARENAS: usize = 1;

/// Makes freed activations stay in the heap for the next step (see the module's text). Call it
/// before any other thread exists: a thread that has allocated keeps its arena. Returns whether
/// the allocator took the settings; elsewhere than glibc it has no such knobs and this returns
/// `false`.
pub fn keep_freed_activations() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets allocator parameters; glibc takes its own lock.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, HEAP_BLOCK_MAX_BYTES as libc::c_int) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, RETAINED_FREE_BYTES as libc::c_int) == 1
                && libc::mallopt(libc::M_ARENA_MAX, ARENAS as libc::c_int) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;

    /// Minor page faults of the calling thread so far.
    fn thread_minor_faults() -> i64 {
        // SAFETY: getrusage writes the struct it is given.
        unsafe {
            let mut usage: libc::rusage = std::mem::zeroed();
            assert_eq!(libc::getrusage(libc::RUSAGE_THREAD, &mut usage), 0);
            usage.ru_minflt
        }
    }

    /// A prefill layer's pattern: several activation blocks alive at once, then all freed.
    fn one_layer(blocks: usize, bytes: usize) {
        let live: Vec<Vec<u8>> = (0..blocks)
            .map(|_| {
                let mut block = vec![0u8; bytes];
                for page in block.chunks_mut(4096) {
                    page[0] = 1;
                }
                block
            })
            .collect();
        std::hint::black_box(&live);
    }

    #[test]
    fn freed_activation_blocks_are_reused_without_page_faults() {
        assert!(keep_freed_activations());
        let (blocks, bytes) = (6, 2 << 20);
        let pages = (blocks * bytes / 4096) as i64;
        // The first layer may fault its pages in; the next ones get the same memory back.
        // glibc's defaults trim the freed 12 MiB off the heap (its trim threshold follows the
        // largest freed block, 2 MiB, doubled), so there every layer faults every page. A test
        // on another thread sharing this thread's arena could take freed blocks in between:
        // the best of three layers counts.
        one_layer(blocks, bytes);
        let fewest_faults = (0..3)
            .map(|_| {
                let before = thread_minor_faults();
                one_layer(blocks, bytes);
                thread_minor_faults() - before
            })
            .min()
            .unwrap();
        assert!(
            fewest_faults < pages / 8,
            "{fewest_faults} page faults re-allocating {pages} freed pages: the heap gave them back"
        );
    }

    /// Set in the child process of [`a_pool_thread_reuses_freed_activations_beyond_one_arena_heap`].
    const CHILD: &str = "KIMI_HEAP_TEST_CHILD";

    #[test]
    fn a_pool_thread_reuses_freed_activations_beyond_one_arena_heap() {
        // The arenas are fixed once threads have allocated, and a test binary's threads have:
        // the check runs in a child process of this test binary, this test alone.
        if std::env::var_os(CHILD).is_none() {
            let name = "exec::cpu::heap::tests::a_pool_thread_reuses_freed_activations_beyond_one_arena_heap";
            let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
                .args([name, "--exact", "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .expect("the test binary runs");
            let text = String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success() && text.contains("1 passed"), "{text}");
            return;
        }
        assert!(keep_freed_activations());
        // 80 MiB live at once: more than one 64 MiB arena heap holds.
        let (blocks, bytes) = (5, 16 << 20);
        let pages = (blocks * bytes / 4096) as i64;
        let fewest_faults = std::thread::spawn(move || {
            one_layer(blocks, bytes);
            (0..2)
                .map(|_| {
                    let before = thread_minor_faults();
                    one_layer(blocks, bytes);
                    thread_minor_faults() - before
                })
                .min()
                .unwrap()
        })
        .join()
        .unwrap();
        assert!(
            fewest_faults < pages / 8,
            "{fewest_faults} page faults re-allocating {pages} freed pages on a new thread"
        );
    }
}
