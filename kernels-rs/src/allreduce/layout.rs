//! Byte layout of the all-reduce buffers, shared by every backend.
//!
//! The CPU backend puts all ranks' regions in one POSIX shared-memory segment after a header
//! page; the CUDA backend will allocate each rank's region with `cudaMalloc`, exchange IPC
//! handles, and use the same offsets relative to each region, so the protocol code (which slot,
//! which flag, which parity) is written once.
//!
//! ```text
//! header   magic, world size, capacity, push enabled, abort word, per-rank {attached, pid}
//! rank r   call descriptors [parity]
//!          pull flags [phase]                       written by r, polled by consumers
//!          push flags [phase][producer]             written by producer, polled by r
//!          pull outbox [parity][phase]   capacity   written by r, read by consumers
//!          push inbox [parity][phase][producer]     written by producer, read by r
//! ```
//!
//! Flags sit one per 64-byte line so pollers do not false-share; slots are page aligned.

pub const MAGIC: u64 = 0x616c_6c72_6564_7563; // "allreduc"
pub const PAGE: usize = 4096;
pub const LINE: usize = 64;
/// The most phases any algorithm uses (island-hierarchical).
pub const MAX_PHASES: usize = 3;
/// Ranks per segment; bounded by the header page holding one line per rank.
pub const MAX_WORLD: usize = 56;

pub const HEADER_MAGIC: usize = 0;
pub const HEADER_WORLD: usize = 8;
pub const HEADER_CAPACITY: usize = 16;
pub const HEADER_PUSH: usize = 24;
/// Non-zero once any rank gives up: `(rank + 1) << 8 | reason`.
pub const HEADER_ABORT: usize = LINE;
const HEADER_RANKS: usize = 2 * LINE;

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Byte offsets of everything in the segment (CPU) or in each rank's region (CUDA, minus the
/// header page and `region`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentLayout {
    pub world: usize,
    /// Bytes per data slot (the message capacity rounded up to a page).
    pub capacity: usize,
    pub push: bool,
    flags_bytes: usize,
    rank_stride: usize,
}

impl SegmentLayout {
    pub fn new(world: usize, capacity_bytes: usize, push: bool) -> Self {
        let capacity = round_up(capacity_bytes.max(1), PAGE);
        let flags_bytes = round_up(
            2 * LINE + MAX_PHASES * LINE + MAX_PHASES * world * LINE,
            PAGE,
        );
        let slots = 2 * MAX_PHASES * (1 + if push { world } else { 0 });
        SegmentLayout {
            world,
            capacity,
            push,
            flags_bytes,
            rank_stride: flags_bytes + slots * capacity,
        }
    }
    pub fn total(&self) -> usize {
        PAGE + self.world * self.rank_stride
    }
    pub fn region(&self, rank: usize) -> usize {
        PAGE + rank * self.rank_stride
    }
    pub fn attached(&self, rank: usize) -> usize {
        HEADER_RANKS + rank * LINE
    }
    pub fn pid(&self, rank: usize) -> usize {
        HEADER_RANKS + rank * LINE + 8
    }
    pub fn descriptor(&self, rank: usize, parity: usize) -> usize {
        self.region(rank) + parity * LINE
    }
    pub fn pull_flag(&self, owner: usize, phase: usize) -> usize {
        self.region(owner) + 2 * LINE + phase * LINE
    }
    pub fn push_flag(&self, consumer: usize, phase: usize, producer: usize) -> usize {
        self.region(consumer)
            + 2 * LINE
            + MAX_PHASES * LINE
            + (phase * self.world + producer) * LINE
    }
    pub fn outbox(&self, owner: usize, parity: usize, phase: usize) -> usize {
        self.region(owner) + self.flags_bytes + (parity * MAX_PHASES + phase) * self.capacity
    }
    pub fn inbox(&self, consumer: usize, parity: usize, phase: usize, producer: usize) -> usize {
        debug_assert!(self.push);
        let first = 2 * MAX_PHASES;
        self.region(consumer)
            + self.flags_bytes
            + (first + (parity * MAX_PHASES + phase) * self.world + producer) * self.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_do_not_overlap() {
        let l = SegmentLayout::new(8, 10_000, true);
        assert_eq!(l.capacity, 12_288);
        assert!(l.push_flag(0, 2, 7) + 8 <= l.outbox(0, 0, 0));
        assert!(l.outbox(0, 1, 2) + l.capacity <= l.inbox(0, 0, 0, 0));
        assert!(l.inbox(0, 1, 2, 7) + l.capacity <= l.region(1));
        assert_eq!(l.total(), l.region(8));
        assert!(l.pid(MAX_WORLD - 1) + 8 <= PAGE);
    }
}
