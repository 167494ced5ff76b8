//! A CPU model of `allreduce.cu`'s addressing, for checking the kernels' decomposition
//! without a GPU: every rank's region is a byte vector laid out by [`DeviceOffsets`], and each
//! (rank, block) runs the kernel's code between two waits, function for function (`chunk`,
//! `block_part`, the hierarchical exchange's cuts, push intersections). Phases run as
//! barriers, which is what the all-lanes waits guarantee across ranks.
//!
//! Two properties are checked: the result equals [`reference_reduce`] bit for bit, and within
//! one call every element of a rank's `data` is touched by one block only — the kernels have
//! no barrier between blocks, so a second block touching it would be a race.
//!
//! This checks the model, not the CUDA code: a transcription slip between the two is not
//! caught here (the GPU check catches that).

#![cfg(test)]

use super::algorithm::{Algorithm, Transfer, reference_reduce};
use super::element::Element;
use super::layout::SegmentLayout;
use super::tactic::DeviceOffsets;
use super::topology::Islands;

#[derive(Clone, Copy, Debug, PartialEq)]
struct Range {
    start: usize,
    end: usize,
}

impl Range {
    fn len(&self) -> usize {
        self.end - self.start
    }
}

fn chunk(start: usize, len: usize, parts: usize, part: usize) -> Range {
    let (base, extra) = (len / parts, len % parts);
    let s = start + part * base + part.min(extra);
    Range {
        start: s,
        end: s + base + usize::from(part < extra),
    }
}

fn intersect(a: Range, b: Range) -> Range {
    let s = a.start.max(b.start);
    Range {
        start: s,
        end: a.end.min(b.end).max(s),
    }
}

#[derive(Clone, Copy)]
enum Src {
    Data,
    /// (region owner, byte offset of element 0)
    Slot(usize, usize),
}

struct Model<T> {
    offs: DeviceOffsets,
    world: usize,
    blocks: usize,
    n: usize,
    push: bool,
    parity: usize,
    regions: Vec<Vec<u8>>,
    data: Vec<Vec<T>>,
    residual: Option<Vec<T>>,
    /// Per rank and element: the block that touched `data[i]` in this call.
    toucher: Vec<Vec<Option<usize>>>,
    islands: Islands,
}

impl<T: Element> Model<T> {
    fn size() -> usize {
        std::mem::size_of::<T>()
    }
    fn outbox(&self, owner: usize, phase: usize) -> (usize, usize) {
        (owner, self.offs.outbox(self.parity, phase))
    }
    fn inbox(&self, consumer: usize, phase: usize, producer: usize) -> (usize, usize) {
        (consumer, self.offs.inbox(self.parity, phase, producer))
    }
    fn source(&self, me: usize, producer: usize, phase: usize) -> Src {
        let (r, o) = if self.push {
            self.inbox(me, phase, producer)
        } else {
            self.outbox(producer, phase)
        };
        Src::Slot(r, o)
    }
    fn touch(&mut self, rank: usize, block: usize, i: usize) {
        let t = &mut self.toucher[rank][i];
        assert!(
            t.is_none_or(|b| b == block),
            "rank {rank}: data[{i}] touched by blocks {t:?} and {block}"
        );
        *t = Some(block);
    }
    fn read(&mut self, rank: usize, block: usize, src: Src, i: usize) -> T {
        match src {
            Src::Data => {
                self.touch(rank, block, i);
                self.data[rank][i]
            }
            Src::Slot(r, o) => {
                let at = o + i * Self::size();
                assert!(i * Self::size() < self.offs.capacity, "slot overflow");
                bytemuck::pod_read_unaligned(&self.regions[r][at..at + Self::size()])
            }
        }
    }
    fn write_slot(&mut self, (r, o): (usize, usize), i: usize, v: T) {
        assert!(i * Self::size() < self.offs.capacity, "slot overflow");
        let at = o + i * Self::size();
        self.regions[r][at..at + Self::size()].copy_from_slice(bytemuck::bytes_of(&v));
    }
    fn block_part(&self, r: Range, block: usize) -> Range {
        chunk(r.start, r.len(), self.blocks, block)
    }
    /// copy_range(slot, data, r)
    fn publish(&mut self, rank: usize, block: usize, slot: (usize, usize), r: Range) {
        for i in r.start..r.end {
            let v = self.read(rank, block, Src::Data, i);
            self.write_slot(slot, i, v);
        }
    }
    /// copy_range(data, src, r)
    fn gather(&mut self, rank: usize, block: usize, src: Src, r: Range) {
        for i in r.start..r.end {
            let v = self.read(rank, block, src, i);
            self.touch(rank, block, i);
            self.data[rank][i] = v;
        }
    }
    fn reduce(&mut self, rank: usize, block: usize, terms: &[Src], residual: bool, r: Range) {
        for i in r.start..r.end {
            let mut acc = self.read(rank, block, terms[0], i).to_acc();
            for &t in &terms[1..] {
                acc += self.read(rank, block, t, i).to_acc();
            }
            if residual && let Some(res) = &self.residual {
                acc += res[i].to_acc();
            }
            self.touch(rank, block, i);
            self.data[rank][i] = T::from_acc(acc);
        }
    }

    fn others(&self, me: usize) -> Vec<usize> {
        (0..self.world).filter(|&r| r != me).collect()
    }

    /// The code of `one_shot` / `two_shot` / `hierarchical` between wait number `step - 1`
    /// and wait number `step`, for one (rank, block).
    fn segment(&mut self, algorithm: Algorithm, me: usize, b: usize, step: usize) {
        let n = self.n;
        match algorithm {
            Algorithm::OneShot(_) => {
                let mine = self.block_part(Range { start: 0, end: n }, b);
                if step == 0 {
                    if self.push {
                        for o in self.others(me) {
                            self.publish(me, b, self.inbox(o, 0, me), mine);
                        }
                    } else {
                        self.publish(me, b, self.outbox(me, 0), mine);
                    }
                } else {
                    let terms: Vec<Src> = (0..self.world)
                        .map(|r| {
                            if r == me {
                                Src::Data
                            } else {
                                self.source(me, r, 0)
                            }
                        })
                        .collect();
                    self.reduce(me, b, &terms, true, mine);
                }
            }
            Algorithm::TwoShot(_) => {
                let world = self.world;
                let chunk_of = |m: &Self, r: usize| m.block_part(chunk(0, n, world, r), b);
                let mine = chunk_of(self, me);
                match step {
                    0 => {
                        if self.push {
                            for o in self.others(me) {
                                self.publish(me, b, self.inbox(o, 0, me), chunk_of(self, o));
                            }
                        } else {
                            for r in 0..world {
                                self.publish(me, b, self.outbox(me, 0), chunk_of(self, r));
                            }
                        }
                    }
                    1 => {
                        let terms: Vec<Src> = (0..world)
                            .map(|r| {
                                if r == me {
                                    Src::Data
                                } else {
                                    self.source(me, r, 0)
                                }
                            })
                            .collect();
                        self.reduce(me, b, &terms, true, mine);
                        if self.push {
                            for o in self.others(me) {
                                self.publish(me, b, self.inbox(o, 1, me), mine);
                            }
                        } else {
                            self.publish(me, b, self.outbox(me, 1), mine);
                        }
                    }
                    _ => {
                        for o in self.others(me) {
                            let src = self.source(me, o, 1);
                            self.gather(me, b, src, chunk_of(self, o));
                        }
                    }
                }
            }
            Algorithm::IslandHierarchical(_) => {
                let islands = self.islands.clone();
                let owned = |r: usize| {
                    chunk(
                        0,
                        n,
                        islands.groups()[islands.island_of(r)].len(),
                        islands.position_of(r),
                    )
                };
                let my_island = islands.island_of(me);
                let island = islands.groups()[my_island].clone();
                let peers: Vec<usize> = island.iter().copied().filter(|&r| r != me).collect();
                let remote: Vec<usize> = (0..self.world)
                    .filter(|&r| islands.island_of(r) != my_island)
                    .collect();
                let mine = self.block_part(owned(me), b);
                match step {
                    0 => {
                        if self.push {
                            for &q in &peers {
                                let part = self.block_part(owned(q), b);
                                self.publish(me, b, self.inbox(q, 0, me), part);
                            }
                        } else {
                            for &q in &island {
                                let part = self.block_part(owned(q), b);
                                self.publish(me, b, self.outbox(me, 0), part);
                            }
                        }
                    }
                    1 => {
                        let terms: Vec<Src> = island
                            .iter()
                            .map(|&r| {
                                if r == me {
                                    Src::Data
                                } else {
                                    self.source(me, r, 0)
                                }
                            })
                            .collect();
                        self.reduce(me, b, &terms, false, mine);
                        if self.push {
                            for &u in &remote {
                                let part = intersect(owned(u), mine);
                                self.publish(me, b, self.inbox(u, 1, me), part);
                            }
                        } else {
                            self.publish(me, b, self.outbox(me, 1), mine);
                        }
                    }
                    2 => {
                        let mut cuts = vec![mine.start];
                        for &u in &remote {
                            let o = owned(u);
                            if o.start > mine.start && o.start < mine.end {
                                cuts.push(o.start);
                            }
                            if o.end > mine.start && o.end < mine.end {
                                cuts.push(o.end);
                            }
                        }
                        cuts.push(mine.end);
                        cuts.sort_unstable();
                        for w in cuts.windows(2) {
                            let seg = Range {
                                start: w[0],
                                end: w[1],
                            };
                            if seg.len() == 0 {
                                continue;
                            }
                            let terms: Vec<Src> = islands
                                .groups()
                                .iter()
                                .enumerate()
                                .map(|(k, group)| {
                                    if k == my_island {
                                        return Src::Data;
                                    }
                                    let owner = *group
                                        .iter()
                                        .find(|&&u| {
                                            let o = owned(u);
                                            seg.start >= o.start && seg.start < o.end
                                        })
                                        .expect("island parts cover the message");
                                    self.source(me, owner, 1)
                                })
                                .collect();
                            self.reduce(me, b, &terms, true, seg);
                        }
                        if self.push {
                            for &q in &peers {
                                self.publish(me, b, self.inbox(q, 2, me), mine);
                            }
                        } else {
                            self.publish(me, b, self.outbox(me, 2), mine);
                        }
                    }
                    _ => {
                        for &q in &peers {
                            let src = self.source(me, q, 2);
                            let part = self.block_part(owned(q), b);
                            self.gather(me, b, src, part);
                        }
                    }
                }
            }
        }
    }
}

/// Runs `calls` consecutive calls (alternating parity, fresh inputs each) and checks each.
fn check<T: Element>(
    algorithm: Algorithm,
    world: usize,
    islands: Islands,
    n: usize,
    blocks: usize,
    residual: bool,
    seed: u64,
) {
    let push = algorithm.transfer() == Transfer::Push;
    let layout = SegmentLayout::new(world, n.max(1) * std::mem::size_of::<T>(), push);
    let offs = DeviceOffsets::new(&layout);
    let mut m = Model::<T> {
        offs,
        world,
        blocks,
        n,
        push,
        parity: 0,
        regions: vec![vec![0u8; offs.region_bytes]; world],
        data: Vec::new(),
        residual: None,
        toucher: Vec::new(),
        islands: islands.clone(),
    };
    for call in 0..3u64 {
        m.parity = ((call + 1) % 2) as usize;
        let s = seed ^ (call << 32);
        let inputs: Vec<Vec<T>> = (0..world)
            .map(|r| super::testing::rank_input(s, r, n))
            .collect();
        m.residual = residual.then(|| super::testing::residual_input(s, n));
        let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
        let expected = reference_reduce(algorithm, &refs, m.residual.as_deref(), &islands);
        m.data = inputs.clone();
        m.toucher = vec![vec![None; n]; world];
        for step in 0..=algorithm.phases() {
            // Blocks in reverse on odd calls: the order within a step must not matter.
            for me in 0..world {
                for k in 0..blocks {
                    let b = if call % 2 == 1 { blocks - 1 - k } else { k };
                    m.segment(algorithm, me, b, step);
                }
            }
        }
        for (rank, out) in m.data.iter().enumerate() {
            assert!(
                out == &expected,
                "{algorithm} world {world} islands {} n {n} blocks {blocks} rank {rank} call {call}",
                islands.to_spec()
            );
        }
    }
}

#[test]
fn kernel_decomposition_matches_the_reference_and_has_no_cross_block_races() {
    let mut cases = 0;
    for world in [1usize, 2, 3, 4, 5, 8] {
        let mut island_sets = vec![super::cpu::default_islands(world)];
        if world >= 3 {
            island_sets
                .push(Islands::new(vec![(0..world - 1).collect(), vec![world - 1]]).unwrap());
        }
        if world == 8 {
            island_sets.push(Islands::new(vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]).unwrap());
            island_sets.push(Islands::contiguous(&[3, 3, 2]).unwrap());
        }
        for islands in island_sets {
            for algorithm in Algorithm::ALL {
                for n in [1usize, 7, 8, 13, 100, 257] {
                    for blocks in [1usize, 3, 8] {
                        for residual in [false, true] {
                            check::<half::bf16>(
                                algorithm,
                                world,
                                islands.clone(),
                                n,
                                blocks,
                                residual,
                                n as u64,
                            );
                            cases += 1;
                        }
                    }
                }
                check::<f32>(algorithm, world, islands.clone(), 1000, 8, true, 7);
            }
        }
    }
    assert!(cases > 1000);
}
