//! Real OS processes: each rank is an `allreduce-rank` process mapping the same POSIX
//! shared-memory segment. Checks bit-identical results against the reference, and that killing a
//! rank mid-collective makes every survivor fail within the timeout without leaking segments.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use half::bf16;
use kernels::allreduce::shm::{live_segments, unique_segment_name};
use kernels::allreduce::testing::{digest, rank_input, residual_input};
use kernels::allreduce::{Algorithm, Element, Islands, reference_reduce};

const RANK_BIN: &str = env!("CARGO_BIN_EXE_allreduce-rank");

fn spawn_ranks(name: &str, world: usize, extra: &[String]) -> Vec<Child> {
    (0..world)
        .map(|rank| {
            Command::new(RANK_BIN)
                .arg(format!("name={name}"))
                .arg(format!("rank={rank}"))
                .arg(format!("world={world}"))
                .args(extra)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn allreduce-rank")
        })
        .collect()
}

/// Waits for `child` until `deadline`; kills it (and fails) if it is still running then.
fn wait_until(child: &mut Child, deadline: Instant, what: &str) -> std::process::ExitStatus {
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            panic!("{what} hung past its deadline");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn expected_digests<T: Element>(
    world: usize,
    len: usize,
    seed: u64,
    islands: &Islands,
    residual: bool,
) -> Vec<String> {
    let res: Vec<T> = residual_input(seed, len);
    Algorithm::ALL
        .iter()
        .enumerate()
        .map(|(i, &algorithm)| {
            let inputs: Vec<Vec<T>> = (0..world)
                .map(|r| rank_input(seed + i as u64, r, len))
                .collect();
            let views: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
            let out = reference_reduce(algorithm, &views, residual.then_some(&res[..]), islands);
            format!(
                "result algorithm={} digest={:016x}",
                algorithm.id(),
                digest(&out)
            )
        })
        .collect()
}

fn run_check(world: usize, dtype: &str, len: usize, islands: &str, residual: bool) {
    let name = unique_segment_name("proc-check");
    let seed = 99;
    let extra = [
        format!("dtype={dtype}"),
        format!("len={len}"),
        format!("islands={islands}"),
        format!("seed={seed}"),
        format!("residual={}", u8::from(residual)),
        "timeout-ms=20000".into(),
    ];
    let children = spawn_ranks(&name, world, &extra);
    let islands = Islands::from_spec(islands).unwrap();
    let expected = match dtype {
        "bf16" => expected_digests::<bf16>(world, len, seed, &islands, residual),
        _ => expected_digests::<f32>(world, len, seed, &islands, residual),
    };
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().expect("rank output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank} failed: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Vec<String> = stdout.lines().map(str::to_string).collect();
        assert_eq!(
            got, expected,
            "rank {rank} ({dtype}, world {world}, len {len})"
        );
    }
    assert!(live_segments(&name).is_empty(), "segment {name} leaked");
}

#[test]
fn four_processes_bf16_match_the_reference_bit_for_bit() {
    run_check(4, "bf16", 1001, "0,1/2,3", true);
}

#[test]
fn five_processes_f32_uneven_islands_match_the_reference_bit_for_bit() {
    run_check(5, "f32", 777, "0,2,4/1,3", false);
}

#[derive(Clone, Copy, PartialEq)]
enum Fault {
    /// SIGKILL: the process is gone (survivors may notice the pid is gone before the timeout).
    Kill,
    /// SIGSTOP: the process exists but makes no progress; only the timeout can catch it.
    Stall,
}

/// Starts `world` looping ranks, faults `victim` once all are mid-stream, and checks that each
/// survivor exits with an error within the timeout (plus scheduling slack) and nothing leaks.
fn fault_one(world: usize, victim: usize, fault: Fault) {
    let timeout = Duration::from_millis(500);
    let name = unique_segment_name("proc-kill");
    let extra = [
        format!("timeout-ms={}", timeout.as_millis()),
        "mode=loop".into(),
        "len=3000".into(),
        "algorithms=one-shot-pull,two-shot-push,island-hierarchical-pull".into(),
    ];
    let mut children = spawn_ranks(&name, world, &extra);
    let mut readers: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().unwrap()))
        .collect();
    for (rank, reader) in readers.iter_mut().enumerate() {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "rank {rank} did not start");
    }
    // Let the ranks get into the stream of collectives, then kill one without warning.
    std::thread::sleep(Duration::from_millis(50));
    let killed_at = Instant::now();
    match fault {
        Fault::Kill => {
            children[victim].kill().expect("SIGKILL");
            children[victim].wait().expect("reap victim");
        }
        Fault::Stall => {
            // SAFETY: plain signal to our own child.
            assert_eq!(
                unsafe { libc::kill(children[victim].id() as libc::pid_t, libc::SIGSTOP) },
                0
            );
        }
    }
    for (rank, child) in children
        .iter_mut()
        .enumerate()
        .filter(|(r, _)| *r != victim)
    {
        // Generous slack for an oversubscribed 2-core machine, still far below "hang".
        let status = wait_until(
            child,
            killed_at + timeout + Duration::from_secs(5),
            &format!("rank {rank}"),
        );
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut readers[rank], &mut rest).unwrap();
        eprintln!(
            "{} rank {rank} after {:?}: {}",
            if fault == Fault::Kill {
                "kill"
            } else {
                "stall"
            },
            killed_at.elapsed(),
            rest.trim()
        );
        assert_eq!(
            status.code(),
            Some(3),
            "rank {rank} should fail, printed {rest:?}"
        );
        assert!(rest.contains("error"), "rank {rank}: {rest:?}");
        let named = match fault {
            Fault::Kill => {
                rest.contains("timed out") || rest.contains("exited") || rest.contains("aborted")
            }
            Fault::Stall => rest.contains("timed out") || rest.contains("aborted by"),
        };
        assert!(named, "rank {rank} error should name the cause: {rest:?}");
    }
    let elapsed = killed_at.elapsed();
    if fault == Fault::Stall {
        assert!(
            elapsed >= timeout / 2,
            "survivors gave up after {elapsed:?}, before the timeout could have passed"
        );
        children[victim].kill().expect("SIGKILL stopped rank");
        children[victim].wait().expect("reap victim");
    }
    assert!(
        elapsed < timeout * 4 + Duration::from_secs(2),
        "survivors took {elapsed:?}"
    );
    assert!(
        live_segments(&name).is_empty(),
        "segment {name} leaked: {:?}",
        live_segments(&name)
    );
}

#[test]
fn killing_a_rank_mid_collective_fails_the_survivors_fast() {
    fault_one(4, 2, Fault::Kill);
}

#[test]
fn a_stopped_rank_times_out_the_survivors() {
    fault_one(4, 1, Fault::Stall);
}

#[test]
fn killing_the_creating_rank_leaks_nothing() {
    fault_one(3, 0, Fault::Kill);
}
