//! The host-executed all-reduce harness: rank threads launching the real `allreduce.cu`
//! through the host execution layer, and the reference they must equal bit for bit. Used by
//! `tests/host_allreduce.rs` and `autotune`'s correct stage.

use std::time::Duration;

use cuda_host::{DeviceBuffer, Function, KernelParams, LaunchConfig, LaunchOptions, launch};
use kernels::allreduce::layout::SegmentLayout;
use kernels::allreduce::tactic::{AllReduceTactic, DeviceOffsets, LaunchShape, pack_params};
use kernels::allreduce::testing::{rank_input, residual_input};
use kernels::allreduce::{Algorithm, Element, Islands, reference_reduce};

/// `ArControl.status` (allreduce.cu): after `gen` (u64) and `done`, `pad` (u32).
const STATUS_OFFSET: usize = 16;
const CONTROL_BYTES: usize = 64;

pub struct Outcome {
    /// The first call's output, for ranks that ran.
    pub outputs: Vec<Option<Vec<u8>>>,
    /// Each rank's status word after the last call (0: ok).
    pub status: Vec<Option<u64>>,
}

/// Runs `tactic`'s image over `world` rank threads (co-resident, as on a GPU), three
/// consecutive calls (both buffer parities); `dead`: a rank that never calls. Panics on a
/// launch error or when a call differs from the first.
#[allow(clippy::too_many_arguments)]
pub fn run_case<T: Element>(
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

/// What `reference_reduce` gives for the inputs [`run_case`] uses.
pub fn expected<T: Element>(
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
