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

use std::time::Duration;

use cuda_host::{
    DeviceBuffer, Function, KernelParams, LaunchConfig, LaunchOptions, Module, launch,
};
use kernels::allreduce::cpu::default_islands;
use kernels::allreduce::layout::SegmentLayout;
use kernels::allreduce::tactic::{
    AllReduceTactic, DeviceOffsets, KernelStatus, LaunchShape, pack_params,
};
use kernels::allreduce::testing::{rank_input, residual_input};
use kernels::allreduce::{Algorithm, DType, Element, Islands, reference_reduce};

/// `ArControl.status` (allreduce.cu): after `gen` (u64) and `done`, `pad` (u32).
const STATUS_OFFSET: usize = 16;
const CONTROL_BYTES: usize = 64;

struct Outcome {
    /// The last call's output, for ranks that ran.
    outputs: Vec<Option<Vec<u8>>>,
    status: Vec<Option<u64>>,
}

#[allow(clippy::too_many_arguments)]
fn run_case<T: Element>(
    function: &Function,
    tactic: &AllReduceTactic,
    world: usize,
    islands: &Islands,
    n: usize,
    residual: bool,
    blocks: u32,
    dead: Option<usize>,
) -> Outcome {
    let layout = SegmentLayout::new(world, n * std::mem::size_of::<T>(), true);
    let offsets = DeviceOffsets::new(&layout);
    let seed = (n * 31 + world) as u64;
    let regions: Vec<DeviceBuffer> = (0..world)
        .map(|_| DeviceBuffer::zeroed(offsets.region_bytes).unwrap())
        .collect();
    let peers: Vec<u64> = regions.iter().map(DeviceBuffer::ptr).collect();
    let inputs: Vec<Vec<T>> = (0..world).map(|r| rank_input(seed, r, n)).collect();
    let mut data: Vec<DeviceBuffer> = (0..world)
        .map(|_| DeviceBuffer::zeroed(n * std::mem::size_of::<T>()).unwrap())
        .collect();
    let res = DeviceBuffer::from_slice(&residual_input::<T>(seed, n)).unwrap();
    let controls: Vec<DeviceBuffer> = (0..world)
        .map(|_| DeviceBuffer::zeroed(CONTROL_BYTES).unwrap())
        .collect();
    let timeout_ns = if dead.is_some() {
        300_000_000
    } else {
        20_000_000_000
    };
    let params: Vec<_> = (0..world)
        .map(|rank| {
            let shape = LaunchShape {
                algorithm: tactic.algorithm,
                dtype: T::DTYPE,
                len: n,
                rank,
                offsets,
                islands,
                timeout_ns,
            };
            pack_params(
                &shape,
                &peers,
                data[rank].ptr(),
                residual.then(|| res.ptr()),
                controls[rank].ptr(),
            )
            .unwrap()
        })
        .collect();
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (tactic.threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let opts = LaunchOptions {
        co_resident: true,
        timeout: Some(Duration::from_secs(120)),
        ..LaunchOptions::default()
    };
    let mut first: Vec<Option<Vec<u8>>> = vec![None; world];
    for call in 0..3 {
        for (buf, input) in data.iter_mut().zip(&inputs) {
            buf.write(input).unwrap();
        }
        std::thread::scope(|s| {
            for (rank, p) in params.iter().enumerate() {
                if Some(rank) == dead {
                    continue;
                }
                let opts = opts.clone();
                s.spawn(move || {
                    let mut args = KernelParams::new();
                    args.arg(p);
                    // SAFETY: every address in the parameters is a live buffer of this
                    // function's scope, sized by the layout for this message.
                    unsafe { launch(function, cfg, &args, &opts) }
                        .unwrap_or_else(|e| panic!("{} rank {rank} call {call}: {e}", tactic.id()));
                });
            }
        });
        for rank in 0..world {
            if Some(rank) == dead {
                continue;
            }
            let out = data[rank].bytes().to_vec();
            match &first[rank] {
                None => first[rank] = Some(out),
                Some(f) if dead.is_none() => assert!(
                    *f == out,
                    "{} world {world} n {n} rank {rank}: call {call} differs from call 0",
                    tactic.image_id()
                ),
                Some(_) => {}
            }
        }
        if dead.is_some() {
            break; // the communicator is poisoned after a timeout
        }
    }
    let status = controls
        .iter()
        .enumerate()
        .map(|(rank, c)| {
            (Some(rank) != dead).then(|| {
                u64::from_le_bytes(
                    c.bytes()[STATUS_OFFSET..STATUS_OFFSET + 8]
                        .try_into()
                        .unwrap(),
                )
            })
        })
        .collect();
    Outcome {
        outputs: first,
        status,
    }
}

fn expected<T: Element>(
    algorithm: Algorithm,
    world: usize,
    islands: &Islands,
    n: usize,
    residual: bool,
) -> Vec<u8> {
    let seed = (n * 31 + world) as u64;
    let inputs: Vec<Vec<T>> = (0..world).map(|r| rank_input(seed, r, n)).collect();
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let res: Vec<T> = residual_input(seed, n);
    let e = reference_reduce(
        algorithm,
        &refs,
        residual.then_some(res.as_slice()),
        islands,
    );
    bytemuck::cast_slice(&e).to_vec()
}

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
