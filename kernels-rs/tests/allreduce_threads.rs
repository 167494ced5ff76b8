//! Property: for random sizes, dtypes, rank counts 2–8 and islands, every algorithm's result on
//! every rank equals the sequential sum in that algorithm's fixed order, bit for bit. Ranks are
//! threads here (fast to start); `allreduce_processes.rs` runs real processes.

use std::time::Duration;

use half::bf16;
use kernels::allreduce::cpu::{CpuCommunicator, CpuConfig};
use kernels::allreduce::shm::{live_segments, unique_segment_name};
use kernels::allreduce::testing::{rank_input, residual_input};
use kernels::allreduce::{Algorithm, Element, Islands, reference_reduce};
use proptest::prelude::*;

/// Runs every algorithm `rounds` times on one communicator per rank (exercising both buffer
/// parities and switches between algorithms) and checks each result against the reference.
fn check_all<T: Element>(
    world: usize,
    len: usize,
    islands: &Islands,
    seed: u64,
    with_residual: bool,
) -> Result<(), TestCaseError> {
    let name = unique_segment_name("prop");
    let config = CpuConfig {
        timeout: Duration::from_secs(20),
        capacity_bytes: len * std::mem::size_of::<T>(),
        islands: Some(islands.clone()),
        ..CpuConfig::default()
    };
    let residual: Vec<T> = residual_input(seed, len);
    let rounds = 2;
    let outputs: Vec<Vec<Vec<T>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (name, config, residual) = (&name, config.clone(), &residual);
                s.spawn(move || {
                    let mut comm = CpuCommunicator::new(name, rank, world, config).expect("join");
                    let mut outs = Vec::new();
                    for round in 0..rounds {
                        for (i, algorithm) in Algorithm::ALL.into_iter().enumerate() {
                            let mut data: Vec<T> =
                                rank_input(seed + (round * 10 + i) as u64, rank, len);
                            let r = (with_residual && i % 2 == 0).then_some(&residual[..]);
                            comm.all_reduce_with(algorithm, &mut data, r)
                                .unwrap_or_else(|e| panic!("{algorithm}: {e}"));
                            outs.push(data);
                        }
                    }
                    outs
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    });
    prop_assert!(live_segments(&name).is_empty(), "segment {} leaked", name);
    for round in 0..rounds {
        for (i, algorithm) in Algorithm::ALL.into_iter().enumerate() {
            let inputs: Vec<Vec<T>> = (0..world)
                .map(|r| rank_input(seed + (round * 10 + i) as u64, r, len))
                .collect();
            let views: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
            let r = (with_residual && i % 2 == 0).then_some(&residual[..]);
            let expected = reference_reduce(algorithm, &views, r, islands);
            for (rank, outs) in outputs.iter().enumerate() {
                let got = &outs[round * Algorithm::ALL.len() + i];
                let first_diff = got
                    .iter()
                    .zip(&expected)
                    .position(|(a, b)| bytemuck::bytes_of(a) != bytemuck::bytes_of(b));
                prop_assert!(
                    first_diff.is_none(),
                    "{} rank {} len {} islands {}: first differing element {:?}",
                    algorithm,
                    rank,
                    len,
                    islands.to_spec(),
                    first_diff
                );
            }
        }
    }
    Ok(())
}

/// A random partition of 0..world into contiguous or interleaved islands.
fn islands_strategy(world: usize) -> impl Strategy<Value = Islands> {
    (1..=world.min(4), any::<bool>()).prop_map(move |(count, interleave)| {
        let mut groups = vec![Vec::new(); count];
        for r in 0..world {
            let g = if interleave {
                r % count
            } else {
                r * count / world
            };
            groups[g].push(r);
        }
        Islands::new(groups).expect("partition")
    })
}

fn case_strategy() -> impl Strategy<Value = (usize, usize, Islands, u64, bool, bool)> {
    (2usize..=8).prop_flat_map(|world| {
        // Lengths below the world size exercise empty chunks; larger ones uneven chunks.
        (
            Just(world),
            prop_oneof![0usize..12, 12usize..3000],
            islands_strategy(world),
            any::<u64>(),
            any::<bool>(),
            any::<bool>(),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_algorithm_matches_its_fixed_order_on_every_rank((world, len, islands, seed, bf16_dtype, residual) in case_strategy()) {
        if bf16_dtype {
            check_all::<bf16>(world, len, &islands, seed, residual)?;
        } else {
            check_all::<f32>(world, len, &islands, seed, residual)?;
        }
    }
}

#[test]
fn an_order_bug_would_be_caught() {
    // The inputs make the order matter: reducing rank 0..N versus N..0 gives different bits for
    // some element, so the bit-for-bit property above is not vacuous. (In f32: sums of a few bf16
    // values accumulated in f32 are usually exact, so bf16 mostly tests the hierarchical rounding.)
    let world = 8;
    let inputs: Vec<Vec<f32>> = (0..world).map(|r| rank_input(11, r, 512)).collect();
    let forward: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let backward: Vec<&[f32]> = forward.iter().rev().copied().collect();
    let one = Islands::single(world);
    let a = reference_reduce(Algorithm::ALL[0], &forward, None, &one);
    let b = reference_reduce(Algorithm::ALL[0], &backward, None, &one);
    assert_ne!(a, b);
}
