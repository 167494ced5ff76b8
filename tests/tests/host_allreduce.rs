//! Every all-reduce kernel image — the real `allreduce.cu` (one-shot, two-shot,
//! island-hierarchical; push and pull; BF16 and F32; 256 and 512 threads), compiled for the
//! CPU and run by the host execution layer — against `reference_reduce`, bit for bit.
//!
//! Ranks are threads of this process, each launching the kernel co-resident (every block
//! running at once, as the kernel requires on a GPU) over its own "device" buffers; peers'
//! regions are plain addresses, where a GPU maps them through CUDA IPC. Parameters are packed
//! by `pack_params`, the function the CUDA communicator uses. Three consecutive calls per case
//! exercise both buffer parities and the device-side generation counter; a rank that never
//! calls makes the others end with a timeout naming it.

use cuda_host::{Function, Module};
use kernels::allreduce::cpu::default_islands;
use kernels::allreduce::tactic::{AllReduceTactic, KernelStatus};
use kernels::allreduce::{Algorithm, DType, Element, Islands};
use project_tests::allreduce_host::{expected, run_case};

fn check_image<T: Element>(t: &AllReduceTactic, function: &Function) -> usize {
    let mut cases = 0;
    for world in [1usize, 2, 3, 4, 8] {
        let mut sets = vec![default_islands(world)];
        if world == 4 && matches!(t.algorithm, Algorithm::IslandHierarchical(_)) {
            sets.push(Islands::new(vec![vec![0, 1, 2], vec![3]]).unwrap());
            sets.push(Islands::new(vec![vec![3, 0], vec![2, 1]]).unwrap());
        }
        // Eight ranks only at one size: 8 co-resident rank threads on two cores are slow.
        let sizes: &[usize] = if world == 8 {
            &[1003]
        } else {
            &[1, 13, 100, 1003]
        };
        for islands in &sets {
            for (k, &n) in sizes.iter().enumerate() {
                let residual = k % 2 == 1;
                // Several blocks (lanes) on the longer messages: per-block flags and the
                // block split of every range.
                let blocks = match n {
                    1003 => 3,
                    100 => 2,
                    _ => 1,
                };
                let o = run_case::<T>(function, t, world, islands, n, residual, blocks, None);
                let want = expected::<T>(t.algorithm, world, islands, n, residual);
                for rank in 0..world {
                    let word = o.status[rank].unwrap();
                    assert_eq!(
                        word,
                        0,
                        "{} world {world} n {n} rank {rank}: status {:?}",
                        t.image_id(),
                        KernelStatus::decode(word)
                    );
                    assert!(
                        o.outputs[rank].as_ref() == Some(&want),
                        "{} world {world} islands {} n {n} blocks {blocks} rank {rank}: differs from \
                         reference_reduce",
                        t.image_id(),
                        islands.to_spec()
                    );
                }
                cases += 1;
            }
        }
    }
    // A dead peer: rank 1 never calls. Rank 2 waits on it first under every algorithm and must
    // name it. Rank 0 names it too, except under the hierarchical exchange (islands {0} {1,2}):
    // there rank 0 waits in phase 1 on ranks 1 and 2 at once, and rank 2, stuck in phase 0,
    // never signals phase 1 either, so whichever of the two polls expires first is named.
    let o = run_case::<T>(function, t, 3, &default_islands(3), 64, false, 1, Some(1));
    let hierarchical = matches!(t.algorithm, Algorithm::IslandHierarchical(_));
    for rank in [0, 2] {
        let status = KernelStatus::decode(o.status[rank].unwrap());
        let named_a_silent_peer = match status {
            KernelStatus::Timeout { peer: 1, .. } => true,
            KernelStatus::Timeout {
                peer: 2, phase: 1, ..
            } => rank == 0 && hierarchical,
            _ => false,
        };
        assert!(
            named_a_silent_peer,
            "{} rank {rank}: {status:?}",
            t.image_id()
        );
    }
    cases
}

#[test]
fn every_allreduce_image_matches_reference_reduce_on_the_host() {
    let mut cases = 0;
    let images = AllReduceTactic::images();
    for t in &images {
        let function = Module::find("allreduce", &t.image_id())
            .and_then(|m| m.function("allreduce"))
            .unwrap();
        cases += match t.dtype {
            DType::Bf16 => check_image::<half::bf16>(t, &function),
            DType::F32 => check_image::<f32>(t, &function),
        };
    }
    println!(
        "host all-reduce: {} images, {cases} cases, each 3 calls on every rank",
        images.len()
    );
}
