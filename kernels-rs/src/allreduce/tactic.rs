//! Tactics of the CUDA all-reduce (`allreduce.cu`): algorithm × dtype × threads per block ×
//! blocks, with stable ids, the nvcc defines of their kernel image, and the device-side view of
//! the buffer layout.
//!
//! One kernel image (cubin) serves every block count of an (algorithm, dtype, threads): the
//! block count is only the launch's grid size, so the compile gate builds images, not tactics.
//! [`AllReduceTactic`] implements [`Tactic`] here, with the default `CudaIpcConfig` runs.

use std::fmt;

use super::AlgorithmPolicy;
use super::algorithm::{Algorithm, Transfer};
use super::cost::{Choice, Host, LinkParams};
use super::element::DType;
use super::layout::{LINE, MAX_PHASES, SegmentLayout};
use crate::arch::Sm;
use crate::tactic::{KernelFamily, ProblemShape, Tactic, TacticError};

/// Kernel family name: the folder under `ptx/` and the manifest's `family`.
pub const FAMILY: &str = "allreduce";
/// The kernel's entry point in every image.
pub const KERNEL: &str = "allreduce";
/// Ranks one launch can address (`AR_MAX_RANKS` in `allreduce.cu`).
pub const MAX_RANKS: usize = 16;
/// Blocks per launch: each block signals on its own u64 word ("lane") of a 64-byte flag line
/// of the layout, so at most `LINE / 8` blocks.
pub const MAX_BLOCKS: usize = LINE / 8;
/// Threads per block the images are built for.
pub const THREADS: [u32; 2] = [256, 512];
/// Block counts enumerated for tuning.
pub const BLOCKS: [u32; 4] = [1, 2, 4, 8];

/// One launch configuration of the all-reduce kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AllReduceTactic {
    pub algorithm: Algorithm,
    pub dtype: DType,
    pub threads: u32,
    pub blocks: u32,
}

impl AllReduceTactic {
    /// Every tactic, in a fixed order: algorithm, dtype, threads, blocks.
    pub fn enumerate() -> Vec<AllReduceTactic> {
        let mut out = Vec::new();
        for algorithm in Algorithm::ALL {
            for dtype in [DType::Bf16, DType::F32] {
                for threads in THREADS {
                    for blocks in BLOCKS {
                        out.push(AllReduceTactic {
                            algorithm,
                            dtype,
                            threads,
                            blocks,
                        });
                    }
                }
            }
        }
        out
    }

    /// The distinct kernel images (one per algorithm, dtype, threads): tactics with
    /// `blocks = 1` stand for them.
    pub fn images() -> Vec<AllReduceTactic> {
        Self::enumerate()
            .into_iter()
            .filter(|t| t.blocks == 1)
            .collect()
    }

    /// Stable identifier (tactic caches, logs, command lines). Never rename.
    pub fn id(&self) -> String {
        format!("{}_b{}", self.image_id(), self.blocks)
    }

    /// The kernel image's file stem under `ptx/allreduce/<sm>/`.
    pub fn image_id(&self) -> String {
        format!(
            "{}_{}_t{}",
            self.algorithm.id(),
            self.dtype.id(),
            self.threads
        )
    }

    /// Parses [`id`](Self::id).
    pub fn parse(id: &str) -> Option<AllReduceTactic> {
        let (rest, blocks) = id.rsplit_once("_b")?;
        let (rest, threads) = rest.rsplit_once("_t")?;
        let (algorithm, dtype) = rest.rsplit_once('_')?;
        let t = AllReduceTactic {
            algorithm: algorithm.parse().ok()?,
            dtype: dtype.parse().ok()?,
            threads: threads.parse().ok()?,
            blocks: blocks.parse().ok()?,
        };
        (t.validate().is_ok() && t.id() == id).then_some(t)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !THREADS.contains(&self.threads) {
            return Err(format!(
                "{} threads per block: images exist for {THREADS:?}",
                self.threads
            ));
        }
        if self.blocks == 0 || self.blocks as usize > MAX_BLOCKS {
            return Err(format!("{} blocks: 1..={MAX_BLOCKS}", self.blocks));
        }
        Ok(())
    }

    /// `-D` macros selecting this tactic's image in `allreduce.cu`.
    pub fn nvcc_defines(&self) -> Vec<String> {
        let algo = match self.algorithm {
            Algorithm::OneShot(_) => 0,
            Algorithm::TwoShot(_) => 1,
            Algorithm::IslandHierarchical(_) => 2,
        };
        vec![
            format!("-DAR_ALGO={algo}"),
            format!(
                "-DAR_PUSH={}",
                u8::from(self.algorithm.transfer() == Transfer::Push)
            ),
            format!("-DAR_F32={}", u8::from(self.dtype == DType::F32)),
            format!("-DAR_THREADS={}", self.threads),
        ]
    }
}

impl fmt::Display for AllReduceTactic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())
    }
}

impl Tactic for AllReduceTactic {
    const FAMILY: KernelFamily = KernelFamily::AllReduce;

    fn tactic_id(&self) -> String {
        self.id()
    }

    fn parse_id(id: &str) -> Result<Self, TacticError> {
        AllReduceTactic::parse(id).ok_or_else(|| TacticError::Parse(id.to_string()))
    }

    fn image_id(&self) -> String {
        AllReduceTactic::image_id(self)
    }

    /// Every image is built for both SMs; only the block count and threads are checked.
    fn validate_for(&self, _sm: Sm) -> Result<(), TacticError> {
        self.validate()
            .map_err(|why| TacticError::invalid(self.id(), why))
    }

    /// The flag and status words of the kernel's static shared memory (the manifest's
    /// `static_smem_bytes`: 136 B, 264 B for the hierarchical exchange).
    fn smem_bytes(&self) -> usize {
        match self.algorithm {
            Algorithm::IslandHierarchical(_) => 264,
            _ => 136,
        }
    }

    fn space(_sm: Sm) -> Vec<Self> {
        AllReduceTactic::enumerate()
    }

    fn serves(&self, shape: &ProblemShape) -> bool {
        match shape {
            ProblemShape::AllReduce { dtype, ranks, .. } => {
                dtype == self.dtype.id()
                    && (*ranks as usize) <= MAX_RANKS
                    && (!matches!(self.algorithm, Algorithm::IslandHierarchical(_)) || *ranks >= 4)
            }
            _ => false,
        }
    }

    /// What `CudaIpcConfig::default` runs: one-shot pull, 512 threads, blocks by size.
    fn heuristic_default(_sm: Sm, shape: &ProblemShape) -> Option<Self> {
        let ProblemShape::AllReduce {
            elements, dtype, ..
        } = shape
        else {
            return None;
        };
        let dtype: DType = dtype.parse().ok()?;
        let bytes = *elements as usize * dtype.size();
        Some(AllReduceTactic {
            algorithm: Algorithm::OneShot(Transfer::Pull),
            dtype,
            threads: 512,
            blocks: default_blocks(bytes),
        })
    }
}

/// SASS every image must contain (checked by the compile gate): the acquire load and the
/// release store at system scope, as nvcc 13.5 emits them for `ld.acquire.sys.global.u64`
/// (`LDG.E.64.STRONG.SYS`, followed by `CCTL.IVALL`) and `st.release.sys.global.u64`
/// (`MEMBAR.ALL.SYS` then `STG.E.64.STRONG.SYS`) on sm_90a and sm_120a.
pub const REQUIRED_SASS: [&str; 2] = ["LDG.E.64.STRONG.SYS", "STG.E.64.STRONG.SYS"];
/// Global atomics allowed per image: the one `atomicAdd` on the rank's own control block.
/// More would mean an atomic crept into the data or flag path, where it could hit peer
/// memory (no peer atomics over PCIe).
pub const MAX_GLOBAL_ATOMICS: u32 = 1;

/// Offsets inside one rank's region as the kernel computes them (`Ctx` in `allreduce.cu`):
/// the layout's offsets relative to [`SegmentLayout::region`], as bases plus strides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceOffsets {
    pub world: usize,
    pub pull_flag0: usize,
    pub push_flag0: usize,
    pub outbox0: usize,
    /// 0 when the layout has no push inboxes.
    pub inbox0: usize,
    pub capacity: usize,
    /// Bytes of one rank's region: what each rank allocates.
    pub region_bytes: usize,
}

impl DeviceOffsets {
    pub fn new(layout: &SegmentLayout) -> Self {
        let r0 = layout.region(0);
        DeviceOffsets {
            world: layout.world,
            pull_flag0: layout.pull_flag(0, 0) - r0,
            push_flag0: layout.push_flag(0, 0, 0) - r0,
            outbox0: layout.outbox(0, 0, 0) - r0,
            inbox0: if layout.push {
                layout.inbox(0, 0, 0, 0) - r0
            } else {
                0
            },
            capacity: layout.capacity,
            region_bytes: if layout.world > 1 {
                layout.region(1) - r0
            } else {
                layout.total() - r0
            },
        }
    }

    /// `Ctx::pull_flag`: the word of `lane` (block) in the line of `phase`.
    pub fn pull_flag(&self, phase: usize, lane: usize) -> usize {
        self.pull_flag0 + phase * LINE + lane * 8
    }
    pub fn push_flag(&self, phase: usize, producer: usize, lane: usize) -> usize {
        self.push_flag0 + (phase * self.world + producer) * LINE + lane * 8
    }
    pub fn outbox(&self, parity: usize, phase: usize) -> usize {
        self.outbox0 + (parity * MAX_PHASES + phase) * self.capacity
    }
    pub fn inbox(&self, parity: usize, phase: usize, producer: usize) -> usize {
        self.inbox0 + ((parity * MAX_PHASES + phase) * self.world + producer) * self.capacity
    }
}

/// Packs (algorithm, dtype, length) like the CPU backend's call descriptor.
pub fn descriptor(algorithm: Algorithm, dtype: DType, len: usize) -> u64 {
    (algorithm.code() << 56) | (dtype.code() << 48) | (len as u64 & ((1 << 48) - 1))
}

/// The 8-bit tag carried in the low byte of every flag word: a non-zero digest of the call's
/// descriptor, so a peer that launched another collective is detected without extra reads.
pub fn flag_tag(algorithm: Algorithm, dtype: DType, len: usize) -> u32 {
    let d = descriptor(algorithm, dtype, len);
    // FNV-1a over the descriptor's bytes, folded to 1..=255.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in d.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % 255) as u32 + 1
}

/// Error word the kernel leaves in its control block: `(code << 56) | (peer << 48) |
/// (phase << 40) | generation`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelStatus {
    Ok,
    Timeout {
        peer: usize,
        phase: usize,
        generation: u64,
    },
    Mismatch {
        peer: usize,
        phase: usize,
        generation: u64,
    },
    Unknown(u64),
}

impl KernelStatus {
    pub fn decode(word: u64) -> Self {
        let peer = ((word >> 48) & 0xff) as usize;
        let phase = ((word >> 40) & 0xff) as usize;
        let generation = word & 0xff_ffff_ffff;
        match word >> 56 {
            0 if word == 0 => KernelStatus::Ok,
            1 => KernelStatus::Timeout {
                peer,
                phase,
                generation,
            },
            2 => KernelStatus::Mismatch {
                peer,
                phase,
                generation,
            },
            _ => KernelStatus::Unknown(word),
        }
    }
}

/// The kernel's single by-value parameter; field order and types mirror `struct ArParams` in
/// `allreduce.cu` (asserted there and below).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ArParams {
    /// Each rank's region as mapped in this process (own region included).
    pub peer: [u64; MAX_RANKS],
    pub data: u64,
    pub residual: u64,
    pub ctl: u64,
    pub timeout_ns: u64,
    pub pull_flag0: u64,
    pub push_flag0: u64,
    pub outbox0: u64,
    pub inbox0: u64,
    pub capacity: u64,
    pub n: u32,
    pub world: u32,
    pub rank: u32,
    pub tag: u32,
    pub island_of: [u8; MAX_RANKS],
    pub position_of: [u8; MAX_RANKS],
    pub members: [u8; MAX_RANKS],
    pub island_start: [u8; MAX_RANKS + 1],
    pub islands: u8,
    pub pad: [u8; 6],
}

const _: () = {
    assert!(std::mem::size_of::<ArParams>() == 288);
    assert!(std::mem::offset_of!(ArParams, data) == 128);
    assert!(std::mem::offset_of!(ArParams, capacity) == 192);
    assert!(std::mem::offset_of!(ArParams, n) == 200);
    assert!(std::mem::offset_of!(ArParams, tag) == 212);
    assert!(std::mem::offset_of!(ArParams, island_of) == 216);
    assert!(std::mem::offset_of!(ArParams, island_start) == 264);
    assert!(std::mem::offset_of!(ArParams, islands) == 281);
};

/// Bytes of the per-rank control block (`ArControl`: generation, done count, status).
pub const CONTROL_BYTES: usize = 64;
/// Byte offset of the status word in the control block.
pub const CONTROL_STATUS: usize = 16;

/// Everything but the buffers' addresses of one launch.
#[derive(Debug, Clone)]
pub struct LaunchShape<'a> {
    pub algorithm: Algorithm,
    pub dtype: DType,
    pub len: usize,
    pub rank: usize,
    pub offsets: DeviceOffsets,
    pub islands: &'a super::topology::Islands,
    pub timeout_ns: u64,
}

/// Packs the kernel parameter, checking what the kernel assumes but cannot check cheaply:
/// world and island limits, capacity, 16-byte alignment of every buffer.
pub fn pack_params(
    shape: &LaunchShape<'_>,
    peers: &[u64],
    data: u64,
    residual: Option<u64>,
    ctl: u64,
) -> Result<ArParams, String> {
    let world = shape.offsets.world;
    if world == 0 || world > MAX_RANKS || peers.len() != world || shape.rank >= world {
        return Err(format!(
            "rank {} of {world} with {} peer regions (the kernels address 1..={MAX_RANKS} ranks)",
            shape.rank,
            peers.len()
        ));
    }
    if shape.islands.world_size() != world {
        return Err(format!(
            "islands {} do not cover world {world}",
            shape.islands.to_spec()
        ));
    }
    let bytes = shape.len * shape.dtype.size();
    if bytes > shape.offsets.capacity || shape.len > u32::MAX as usize {
        return Err(format!(
            "{bytes} B message exceeds the slot capacity of {} B",
            shape.offsets.capacity
        ));
    }
    if shape.algorithm.transfer() == Transfer::Push && shape.offsets.inbox0 == 0 {
        return Err(format!(
            "{} needs push inboxes, but the buffers were laid out without them",
            shape.algorithm
        ));
    }
    for (what, ptr) in [
        ("data", data),
        ("residual", residual.unwrap_or(0)),
        ("control", ctl),
    ]
    .into_iter()
    .chain(peers.iter().map(|&p| ("peer region", p)))
    {
        if ptr % 16 != 0 {
            return Err(format!("{what} pointer {ptr:#x} is not 16-byte aligned"));
        }
    }
    let mut p = ArParams::zeroed_params();
    p.peer[..world].copy_from_slice(peers);
    p.data = data;
    p.residual = residual.unwrap_or(0);
    p.ctl = ctl;
    p.timeout_ns = shape.timeout_ns;
    p.pull_flag0 = shape.offsets.pull_flag0 as u64;
    p.push_flag0 = shape.offsets.push_flag0 as u64;
    p.outbox0 = shape.offsets.outbox0 as u64;
    p.inbox0 = shape.offsets.inbox0 as u64;
    p.capacity = shape.offsets.capacity as u64;
    p.n = shape.len as u32;
    p.world = world as u32;
    p.rank = shape.rank as u32;
    p.tag = flag_tag(shape.algorithm, shape.dtype, shape.len);
    let groups = shape.islands.groups();
    let mut next = 0;
    for (k, group) in groups.iter().enumerate() {
        p.island_start[k] = next as u8;
        for (pos, &r) in group.iter().enumerate() {
            p.island_of[r] = k as u8;
            p.position_of[r] = pos as u8;
            p.members[next] = r as u8;
            next += 1;
        }
    }
    p.island_start[groups.len()] = next as u8;
    p.islands = groups.len() as u8;
    Ok(p)
}

impl ArParams {
    fn zeroed_params() -> Self {
        bytemuck::Zeroable::zeroed()
    }
}

/// Which backend runs a message size: one of our algorithms or NCCL, as the cost model
/// ([`super::cost::Host::choose`]) decides per size.
#[derive(Debug, Clone, PartialEq)]
pub struct ChoicePolicy {
    /// `(largest message in bytes, choice)`, ascending by size.
    pub thresholds: Vec<(usize, Choice)>,
    /// For messages above every threshold.
    pub largest: Choice,
}

impl ChoicePolicy {
    pub fn fixed(choice: Choice) -> Self {
        ChoicePolicy {
            thresholds: Vec::new(),
            largest: choice,
        }
    }

    /// Our algorithms only, as an [`AlgorithmPolicy`] says.
    pub fn custom(policy: &AlgorithmPolicy) -> Self {
        ChoicePolicy {
            thresholds: policy
                .thresholds
                .iter()
                .map(|&(max, a)| (max, Choice::Custom(a)))
                .collect(),
            largest: Choice::Custom(policy.largest),
        }
    }

    /// The cost model's pick (ours or NCCL) at each of `sizes` (ascending), merged into
    /// thresholds. Hosts spanning several nodes should use `fixed(Choice::Nccl)`: IPC does not
    /// cross nodes.
    pub fn from_host(host: &Host, sizes: &[usize], p: &LinkParams) -> Self {
        let mut thresholds: Vec<(usize, Choice)> = Vec::new();
        for &s in sizes {
            let (c, _) = host.choose(s, p);
            match thresholds.last_mut() {
                Some((max, last)) if *last == c => *max = s,
                _ => thresholds.push((s, c)),
            }
        }
        let largest = thresholds
            .pop()
            .map(|(_, c)| c)
            .unwrap_or(Choice::Custom(Algorithm::OneShot(Transfer::Pull)));
        ChoicePolicy {
            thresholds,
            largest,
        }
    }

    pub fn choose(&self, bytes: usize) -> Choice {
        self.thresholds
            .iter()
            .find(|(max, _)| bytes <= *max)
            .map(|(_, c)| *c)
            .unwrap_or(self.largest)
    }

    /// Every choice the policy can make.
    pub fn choices(&self) -> Vec<Choice> {
        let mut out: Vec<Choice> = Vec::new();
        for c in self
            .thresholds
            .iter()
            .map(|(_, c)| *c)
            .chain([self.largest])
        {
            if !out.contains(&c) {
                out.push(c);
            }
        }
        out
    }

    pub fn uses_nccl(&self) -> bool {
        self.choices().contains(&Choice::Nccl)
    }

    /// The policy where NCCL is missing: each size it gave NCCL goes to the algorithm of the
    /// nearest smaller size our kernels run (else the nearest larger, else one-shot pull).
    pub fn without_nccl(&self) -> Self {
        let mut all: Vec<Choice> = self.thresholds.iter().map(|(_, c)| *c).collect();
        all.push(self.largest);
        let custom = |i: usize| -> Choice {
            all[..i]
                .iter()
                .rev()
                .chain(all[i..].iter())
                .copied()
                .find(|c| *c != Choice::Nccl)
                .unwrap_or(Choice::Custom(Algorithm::OneShot(Transfer::Pull)))
        };
        let fixed: Vec<Choice> = (0..all.len())
            .map(|i| {
                if all[i] == Choice::Nccl {
                    custom(i)
                } else {
                    all[i]
                }
            })
            .collect();
        ChoicePolicy {
            thresholds: self
                .thresholds
                .iter()
                .zip(&fixed)
                .map(|(&(max, _), &c)| (max, c))
                .collect(),
            largest: *fixed.last().expect("largest"),
        }
    }
}

/// Blocks per launch by message size when the configuration does not fix it: one block keeps
/// the latency-bound sizes to one flag round per phase; bandwidth-bound sizes need more
/// blocks in flight to fill the links. To be replaced by measured choices (the GPU check
/// times every block count).
pub fn default_blocks(bytes: usize) -> u32 {
    match bytes {
        0..=32_768 => 1,
        32_769..=262_144 => 2,
        262_145..=1_048_576 => 4,
        _ => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_nccl_gives_its_sizes_to_the_nearest_custom_choice() {
        let one = Choice::Custom(Algorithm::OneShot(Transfer::Pull));
        let two = Choice::Custom(Algorithm::TwoShot(Transfer::Push));
        let p = ChoicePolicy {
            thresholds: vec![(1 << 10, one), (1 << 16, Choice::Nccl), (1 << 20, two)],
            largest: Choice::Nccl,
        };
        let q = p.without_nccl();
        assert!(!q.uses_nccl());
        assert_eq!(q.choose(512), one);
        // The NCCL range below 64 KiB takes the smaller sizes' algorithm, above 1 MiB the one
        // just below it.
        assert_eq!(q.choose(1 << 15), one);
        assert_eq!(q.choose(1 << 19), two);
        assert_eq!(q.choose(1 << 24), two);
        let all_nccl = ChoicePolicy::fixed(Choice::Nccl).without_nccl();
        assert_eq!(all_nccl.choose(1 << 24), one);
    }

    #[test]
    fn ids_are_stable_and_parse_back() {
        let t = AllReduceTactic {
            algorithm: Algorithm::OneShot(Transfer::Push),
            dtype: DType::Bf16,
            threads: 512,
            blocks: 4,
        };
        assert_eq!(t.id(), "one-shot-push_bf16_t512_b4");
        assert_eq!(t.image_id(), "one-shot-push_bf16_t512");
        let all = AllReduceTactic::enumerate();
        assert_eq!(all.len(), 6 * 2 * THREADS.len() * BLOCKS.len());
        for t in &all {
            assert_eq!(AllReduceTactic::parse(&t.id()), Some(*t), "{t}");
        }
        let ids: std::collections::HashSet<String> = all.iter().map(|t| t.id()).collect();
        assert_eq!(ids.len(), all.len());
        assert_eq!(
            AllReduceTactic::parse("island-hierarchical-pull_f32_t256_b8").map(|t| t.algorithm),
            Some(Algorithm::IslandHierarchical(Transfer::Pull))
        );
        for bad in [
            "one-shot-pull_bf16_t512_b9",
            "one-shot-pull_bf16_t100_b1",
            "ring_bf16_t512_b1",
            "one-shot-pull_f16_t512_b1",
            "one-shot-pull_bf16_t512_b01",
        ] {
            assert_eq!(AllReduceTactic::parse(bad), None, "{bad}");
        }
        assert_eq!(AllReduceTactic::images().len(), 6 * 2 * THREADS.len());
    }

    #[test]
    fn defines_select_the_image() {
        let t = AllReduceTactic {
            algorithm: Algorithm::IslandHierarchical(Transfer::Push),
            dtype: DType::F32,
            threads: 256,
            blocks: 2,
        };
        assert_eq!(
            t.nvcc_defines(),
            [
                "-DAR_ALGO=2",
                "-DAR_PUSH=1",
                "-DAR_F32=1",
                "-DAR_THREADS=256"
            ]
        );
    }

    #[test]
    fn device_offsets_match_the_layout() {
        for (world, capacity, push) in [(2, 14_336, true), (8, 1 << 20, true), (4, 100, false)] {
            let layout = SegmentLayout::new(world, capacity, push);
            let d = DeviceOffsets::new(&layout);
            for rank in 0..world {
                let base = layout.region(rank);
                assert_eq!(
                    base + d.region_bytes,
                    if rank + 1 < world {
                        layout.region(rank + 1)
                    } else {
                        layout.total()
                    }
                );
                for phase in 0..MAX_PHASES {
                    // Lane 0 is the layout's flag word; the other lanes stay inside its line.
                    assert_eq!(base + d.pull_flag(phase, 0), layout.pull_flag(rank, phase));
                    assert_eq!(
                        d.pull_flag(phase, MAX_BLOCKS - 1) + 8,
                        layout.pull_flag(rank, phase) - base + LINE
                    );
                    for parity in 0..2 {
                        assert_eq!(
                            base + d.outbox(parity, phase),
                            layout.outbox(rank, parity, phase)
                        );
                    }
                    for producer in 0..world {
                        assert_eq!(
                            base + d.push_flag(phase, producer, 0),
                            layout.push_flag(rank, phase, producer)
                        );
                        if push {
                            for parity in 0..2 {
                                assert_eq!(
                                    base + d.inbox(parity, phase, producer),
                                    layout.inbox(rank, parity, phase, producer)
                                );
                            }
                        }
                    }
                }
            }
            // Slots are page aligned, so element 0 of every slot is 16-byte aligned (the
            // kernel's vector path relies on it).
            assert_eq!(d.outbox0 % 16, 0);
            assert_eq!(d.inbox0 % 16, 0);
            assert_eq!(d.capacity % 16, 0);
        }
    }

    #[test]
    fn tags_are_nonzero_and_tell_calls_apart() {
        let mut seen = std::collections::HashSet::new();
        for a in Algorithm::ALL {
            for dt in [DType::Bf16, DType::F32] {
                let t = flag_tag(a, dt, 7168);
                assert!((1..=255).contains(&t));
                seen.insert(t);
            }
        }
        assert!(
            seen.len() >= 10,
            "12 calls should give nearly distinct tags"
        );
        assert_ne!(
            flag_tag(Algorithm::OneShot(Transfer::Pull), DType::Bf16, 7168),
            flag_tag(Algorithm::OneShot(Transfer::Pull), DType::Bf16, 7169)
        );
    }

    #[test]
    fn params_pack_islands_offsets_and_tag() {
        use crate::allreduce::topology::Islands;
        let layout = SegmentLayout::new(4, 14_336, true);
        let islands = Islands::new(vec![vec![2, 0], vec![3, 1]]).unwrap();
        let shape = LaunchShape {
            algorithm: Algorithm::IslandHierarchical(Transfer::Push),
            dtype: DType::Bf16,
            len: 7168,
            rank: 1,
            offsets: DeviceOffsets::new(&layout),
            islands: &islands,
            timeout_ns: 5_000_000_000,
        };
        let peers = [0x10000, 0x20000, 0x30000, 0x40000];
        let p = pack_params(&shape, &peers, 0x5000, None, 0x6000).unwrap();
        assert_eq!(&p.peer[..4], &peers);
        assert_eq!(p.peer[4..], [0; MAX_RANKS - 4]);
        assert_eq!((p.n, p.world, p.rank, p.residual), (7168, 4, 1, 0));
        assert_eq!(&p.members[..4], &[2, 0, 3, 1]);
        assert_eq!(&p.island_start[..3], &[0, 2, 4]);
        assert_eq!(&p.island_of[..4], &[0, 1, 0, 1]);
        assert_eq!(&p.position_of[..4], &[1, 1, 0, 0]);
        assert_eq!(p.islands, 2);
        assert_eq!(
            p.outbox0 as usize,
            layout.outbox(0, 0, 0) - layout.region(0)
        );
        assert_eq!(p.tag, flag_tag(shape.algorithm, DType::Bf16, 7168));
        // The bytes the driver copies are exactly the struct's.
        assert_eq!(bytemuck::bytes_of(&p).len(), 288);
        assert_eq!(&bytemuck::bytes_of(&p)[200..204], &7168u32.to_le_bytes());

        let err = |s: &LaunchShape<'_>, data| pack_params(s, &peers, data, None, 0x6000);
        assert!(err(&shape, 0x5008).unwrap_err().contains("16-byte"));
        // 14,336 B rounds up to a 16 KiB slot: 8192 bf16 fit, 8193 do not.
        let big = LaunchShape {
            len: 8193,
            ..shape.clone()
        };
        assert!(err(&big, 0x5000).unwrap_err().contains("capacity"));
        let no_push = LaunchShape {
            offsets: DeviceOffsets::new(&SegmentLayout::new(4, 14_336, false)),
            ..shape.clone()
        };
        assert!(err(&no_push, 0x5000).unwrap_err().contains("push"));
        assert!(pack_params(&shape, &peers[..3], 0x5000, None, 0x6000).is_err());
    }

    #[test]
    fn choice_policy_follows_the_cost_model() {
        use crate::allreduce::LinkKind::{Pix, SelfLink};
        use crate::allreduce::topology::Topology;
        let host = Host::new(
            Topology::from_links(vec![vec![SelfLink, Pix], vec![Pix, SelfLink]]).unwrap(),
        );
        let p = LinkParams::default();
        let sizes = crate::allreduce::cost::table_sizes();
        let from_model = ChoicePolicy::from_host(&host, &sizes, &p);
        for &s in &sizes {
            assert_eq!(from_model.choose(s), host.choose(s, &p).0, "{s} B");
        }
        let policy = ChoicePolicy {
            thresholds: vec![
                (16 << 10, Choice::Custom(Algorithm::OneShot(Transfer::Push))),
                (1 << 20, Choice::Nccl),
            ],
            largest: Choice::Custom(Algorithm::TwoShot(Transfer::Pull)),
        };
        assert_eq!(
            policy.choose(14_336),
            Choice::Custom(Algorithm::OneShot(Transfer::Push))
        );
        assert_eq!(policy.choose(64 << 10), Choice::Nccl);
        assert_eq!(
            policy.choose(8 << 20),
            Choice::Custom(Algorithm::TwoShot(Transfer::Pull))
        );
        assert!(policy.uses_nccl());
        assert_eq!(policy.choices().len(), 3);
        let custom =
            ChoicePolicy::custom(&AlgorithmPolicy::fixed(Algorithm::OneShot(Transfer::Pull)));
        assert!(!custom.uses_nccl());
        assert!((1..=8).contains(&default_blocks(0)));
        assert_eq!(default_blocks(14_336), 1);
        assert_eq!(default_blocks(8 << 20), 8);
    }

    #[test]
    fn status_words_decode() {
        assert_eq!(KernelStatus::decode(0), KernelStatus::Ok);
        let w = (1u64 << 56) | (3 << 48) | (2 << 40) | 77;
        assert_eq!(
            KernelStatus::decode(w),
            KernelStatus::Timeout {
                peer: 3,
                phase: 2,
                generation: 77
            }
        );
        assert!(matches!(
            KernelStatus::decode((2u64 << 56) | 5),
            KernelStatus::Mismatch { generation: 5, .. }
        ));
        assert!(matches!(
            KernelStatus::decode(9u64 << 56),
            KernelStatus::Unknown(_)
        ));
    }

    #[test]
    fn the_space_round_trips() {
        crate::tactic::assert_space_round_trips::<AllReduceTactic>();
    }

    #[test]
    fn the_default_serves_its_shape() {
        let ar = ProblemShape::AllReduce {
            elements: 7168,
            dtype: "bf16".into(),
            ranks: 8,
        };
        for sm in Sm::ALL {
            let t = AllReduceTactic::heuristic_default(sm, &ar).unwrap();
            assert!(t.serves(&ar) && t.blocks == 1);
        }
    }
}
