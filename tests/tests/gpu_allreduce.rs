//! GPU tests of the CUDA all-reduce (feature `cuda`).
//!
//! Compiled only with `--features cuda`, and `#[ignore]`d so that a build without a GPU
//! reports them as ignored, never as passed. Run them on a machine with a GPU and the gate's
//! cubins (`scripts/compile-gates.sh`):
//!
//! ```sh
//! cargo test -p project-tests --features cuda --test gpu_allreduce -- --ignored --nocapture
//! ```
//!
//! A plain `cargo test` lists them as ignored; asked to run them (`--ignored`) without a GPU,
//! each fails with "no GPU" (a GPU test never passes without running). The same kernels run
//! on the CPU through the host execution layer in `host_allreduce.rs`. The ranks run in this
//! process as
//! concurrent streams on device 0 (`CudaIpcCommunicator::in_process_group`); the
//! multi-process IPC path is exercised by the `allreduce-gpu-check` binary.

#![cfg(feature = "cuda")]

use std::time::Duration;

use half::bf16;
use kernels::allreduce::cost::Choice;
use kernels::allreduce::cuda::{CudaIpcCommunicator, CudaIpcConfig, is_no_device};
use kernels::allreduce::tactic::ChoicePolicy;
use kernels::allreduce::testing::{rank_input, residual_input};
use kernels::allreduce::{
    Algorithm, AllReduce, AllReduceError, Element, Islands, Transfer, reference_reduce,
};

fn group(test: &str, world: usize, islands: Islands) -> Vec<CudaIpcCommunicator> {
    let config = CudaIpcConfig {
        timeout: Duration::from_secs(10),
        capacity_bytes: 1 << 20,
        islands: Some(islands),
        policy: ChoicePolicy::fixed(Choice::Custom(Algorithm::TwoShot(Transfer::Pull))),
        ..CudaIpcConfig::default()
    };
    match CudaIpcCommunicator::in_process_group(world, config) {
        Ok(g) => g,
        Err(e) if is_no_device(&e) => panic!("{test}: no GPU: {e}"),
        Err(e) => panic!("{test}: GPU present but unusable: {e}"),
    }
}

fn run_all<T: Element>(
    comms: &mut [CudaIpcCommunicator],
    algorithm: Algorithm,
    len: usize,
    seed: u64,
    residual: bool,
) -> (Vec<Vec<T>>, Vec<T>) {
    let world = comms.len();
    let inputs: Vec<Vec<T>> = (0..world).map(|r| rank_input(seed, r, len)).collect();
    let res: Option<Vec<T>> = residual.then(|| residual_input(seed, len));
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let expected = reference_reduce(algorithm, &refs, res.as_deref(), comms[0].islands());
    let outs = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .iter_mut()
            .zip(&inputs)
            .map(|(c, x)| {
                let res = res.as_deref();
                s.spawn(move || -> Result<Vec<T>, AllReduceError> {
                    let mut d = x.clone();
                    c.all_reduce_with(algorithm, &mut d, res)?;
                    Ok(d)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect::<Vec<_>>()
    });
    (outs, expected)
}

#[test]
#[ignore = "needs an NVIDIA GPU (sm_90 or sm_120) and the gate's cubins: run with --ignored"]
fn gpu_allreduce_every_algorithm_is_bit_identical_to_the_reference() {
    for (world, islands) in [
        (2, Islands::contiguous(&[1, 1]).unwrap()),
        (4, Islands::contiguous(&[2, 2]).unwrap()),
        (4, Islands::new(vec![vec![0, 1, 2], vec![3]]).unwrap()),
    ] {
        let mut comms = group("gpu_allreduce_bit_identical", world, islands);
        for algorithm in Algorithm::ALL {
            for (k, len) in [1usize, 13, 7168, 20_000].into_iter().enumerate() {
                for residual in [false, true] {
                    let (outs, expected) =
                        run_all::<bf16>(&mut comms, algorithm, len, k as u64, residual);
                    for (rank, out) in outs.iter().enumerate() {
                        assert!(out == &expected, "{algorithm} bf16 len {len} rank {rank}");
                    }
                    let (outs, expected) =
                        run_all::<f32>(&mut comms, algorithm, len, 99 + k as u64, residual);
                    for (rank, out) in outs.iter().enumerate() {
                        assert!(out == &expected, "{algorithm} f32 len {len} rank {rank}");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU (sm_90 or sm_120) and the gate's cubins: run with --ignored"]
fn gpu_allreduce_dead_peer_times_out_instead_of_hanging() {
    let mut comms = group(
        "gpu_allreduce_dead_peer",
        2,
        Islands::contiguous(&[1, 1]).unwrap(),
    );
    // Rank 1 never calls: rank 0's kernel must give up after the timeout and report it.
    let mut rank0 = comms.remove(0);
    let start = std::time::Instant::now();
    let mut data = vec![bf16::from_f32(1.0); 64];
    let err = rank0
        .all_reduce_bf16(&mut data, None)
        .expect_err("a peer that never arrives is an error");
    assert!(
        matches!(err, AllReduceError::Timeout { peer: 1, .. }),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(30));
    // Poisoned afterwards, without touching the device.
    assert!(matches!(
        rank0.all_reduce_bf16(&mut data, None),
        Err(AllReduceError::Poisoned(_))
    ));
}
