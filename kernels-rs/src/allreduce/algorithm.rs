//! The all-reduce algorithms, their stable ids, and the fixed reduction order each one promises.
//!
//! Every algorithm reduces each element in one fixed order, computed by exactly one rank (or by
//! every rank in the same order), so all ranks end with identical bits. [`reference_reduce`] is
//! the sequential statement of that order; backends are tested against it bit for bit.

use std::fmt;
use std::str::FromStr;

use super::element::Element;
use super::topology::Islands;

/// How data moves between ranks in a phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Transfer {
    /// The producer writes into its own buffer; consumers read it over the link. Reads do not
    /// collapse across root complexes, so this is the safe default.
    Pull,
    /// The producer writes into each consumer's inbox; consumers poll local memory. Lower latency
    /// (one posted write instead of a read round trip) but writes across root complexes can
    /// collapse to a tenth of the bandwidth on some hosts.
    Push,
}

/// The algorithm families, each with a pull and a push variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Every rank gathers every peer's whole input and reduces it locally: one phase, N-1 full
    /// messages per rank. Best for small messages (latency bound).
    OneShot(Transfer),
    /// Reduce-scatter (rank r reduces chunk r) then all-gather: two phases, 2(N-1)/N of the
    /// message per rank. Best for large messages (bandwidth bound).
    TwoShot(Transfer),
    /// Reduce-scatter inside each island, exchange island partials across islands (each rank
    /// only its 1/island_size share), then all-gather inside the island. Three phases; the slow
    /// links between islands carry 1/island_size of the message per rank.
    IslandHierarchical(Transfer),
}

impl Algorithm {
    /// All algorithms, in a fixed order (used by tables and tests).
    pub const ALL: [Algorithm; 6] = [
        Algorithm::OneShot(Transfer::Pull),
        Algorithm::OneShot(Transfer::Push),
        Algorithm::TwoShot(Transfer::Pull),
        Algorithm::TwoShot(Transfer::Push),
        Algorithm::IslandHierarchical(Transfer::Pull),
        Algorithm::IslandHierarchical(Transfer::Push),
    ];

    /// A stable identifier for logs, tables, command lines and tactic caches. Never rename.
    pub fn id(self) -> &'static str {
        match self {
            Algorithm::OneShot(Transfer::Pull) => "one-shot-pull",
            Algorithm::OneShot(Transfer::Push) => "one-shot-push",
            Algorithm::TwoShot(Transfer::Pull) => "two-shot-pull",
            Algorithm::TwoShot(Transfer::Push) => "two-shot-push",
            Algorithm::IslandHierarchical(Transfer::Pull) => "island-hierarchical-pull",
            Algorithm::IslandHierarchical(Transfer::Push) => "island-hierarchical-push",
        }
    }

    /// A small code written into the shared segment so ranks can detect that they were asked to
    /// run different collectives.
    pub fn code(self) -> u64 {
        Algorithm::ALL
            .iter()
            .position(|a| *a == self)
            .expect("ALL lists every algorithm") as u64
            + 1
    }

    pub fn transfer(self) -> Transfer {
        match self {
            Algorithm::OneShot(t) | Algorithm::TwoShot(t) | Algorithm::IslandHierarchical(t) => t,
        }
    }

    /// Synchronisation phases (each ends with flags every consumer waits on).
    pub fn phases(self) -> usize {
        match self {
            Algorithm::OneShot(_) => 1,
            Algorithm::TwoShot(_) => 2,
            Algorithm::IslandHierarchical(_) => 3,
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "unknown all-reduce algorithm {0:?}; known: one-shot-pull, one-shot-push, two-shot-pull, two-shot-push, island-hierarchical-pull, island-hierarchical-push"
)]
pub struct UnknownAlgorithm(pub String);

impl FromStr for Algorithm {
    type Err = UnknownAlgorithm;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Algorithm::ALL
            .into_iter()
            .find(|a| a.id() == s)
            .ok_or_else(|| UnknownAlgorithm(s.to_string()))
    }
}

/// The element range `[start, end)` of part `part` when `len` elements are split into `parts`
/// nearly equal contiguous parts (the first `len % parts` parts get one more element).
pub fn chunk_range(len: usize, parts: usize, part: usize) -> std::ops::Range<usize> {
    let base = len / parts;
    let extra = len % parts;
    let start = part * base + part.min(extra);
    let end = start + base + usize::from(part < extra);
    start..end
}

/// Intersection of two ranges (empty when disjoint).
pub fn intersect(a: &std::ops::Range<usize>, b: &std::ops::Range<usize>) -> std::ops::Range<usize> {
    let start = a.start.max(b.start);
    let end = a.end.min(b.end).max(start);
    start..end
}

/// Folds `values` left to right in the accumulator type: `((v0 + v1) + v2) + ...`.
///
/// Starting from the first value (not from zero) matters: `0.0 + -0.0` is `+0.0`, which would
/// change the sign bit of an all-negative-zero sum.
fn fold<T: Element>(values: impl Iterator<Item = T>) -> f32 {
    let mut it = values;
    let first = it.next().expect("at least one rank").to_acc();
    it.fold(first, |acc, v| acc + v.to_acc())
}

fn finish<T: Element>(acc: f32, residual: Option<T>) -> T {
    match residual {
        Some(r) => T::from_acc(acc + r.to_acc()),
        None => T::from_acc(acc),
    }
}

/// The result every rank must produce, computed sequentially in the algorithm's fixed order.
///
/// * One-shot and two-shot: `round(((x0 + x1) + ...) + x_{N-1} [+ residual])` with the sum in
///   f32, rank order 0..N.
/// * Island-hierarchical: each island's partial `round(fold over the island's ranks in island
///   order)` in the element type (that is what crosses the slow link), then
///   `round(fold over islands in order of the partials [+ residual])`.
///
/// `residual` is the same on every rank (the replicated hidden state in tensor parallelism);
/// it is added once, after the reduction, before the final rounding.
pub fn reference_reduce<T: Element>(
    algorithm: Algorithm,
    inputs: &[&[T]],
    residual: Option<&[T]>,
    islands: &Islands,
) -> Vec<T> {
    let len = inputs[0].len();
    assert!(
        inputs.iter().all(|x| x.len() == len),
        "all ranks reduce the same length"
    );
    (0..len)
        .map(|i| match algorithm {
            Algorithm::OneShot(_) | Algorithm::TwoShot(_) => {
                finish(fold(inputs.iter().map(|x| x[i])), residual.map(|r| r[i]))
            }
            Algorithm::IslandHierarchical(_) => {
                let partials = islands
                    .groups()
                    .iter()
                    .map(|g| T::from_acc(fold(g.iter().map(|&r| inputs[r][i]))));
                finish(fold(partials), residual.map(|r| r[i]))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    #[test]
    fn ids_are_stable_and_round_trip() {
        let ids: Vec<&str> = Algorithm::ALL.iter().map(|a| a.id()).collect();
        assert_eq!(
            ids,
            [
                "one-shot-pull",
                "one-shot-push",
                "two-shot-pull",
                "two-shot-push",
                "island-hierarchical-pull",
                "island-hierarchical-push"
            ]
        );
        for a in Algorithm::ALL {
            assert_eq!(a.id().parse::<Algorithm>(), Ok(a));
        }
        assert!("ring".parse::<Algorithm>().is_err());
    }

    #[test]
    fn chunks_cover_the_range_exactly() {
        for len in 0..40 {
            for parts in 1..9 {
                let mut next = 0;
                for p in 0..parts {
                    let r = chunk_range(len, parts, p);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn fixed_order_is_observable_in_bf16() {
        // 256 + 1 + 1 in bf16 with f32 accumulation is 258; rounded per step it would be 256.
        let a = [bf16::from_f32(256.0)];
        let b = [bf16::from_f32(1.0)];
        let c = [bf16::from_f32(1.0)];
        let flat = reference_reduce(
            Algorithm::OneShot(Transfer::Pull),
            &[&a, &b, &c],
            None,
            &Islands::single(3),
        );
        assert_eq!(flat[0].to_f32(), 258.0);
        // Hierarchical rounds each island's partial: {256, 1} → 257 rounds to 256 in bf16 (8 bits
        // of mantissa), then + 1 → 257 → 256.
        let islands = Islands::contiguous(&[2, 1]).unwrap();
        let hier = reference_reduce(
            Algorithm::IslandHierarchical(Transfer::Pull),
            &[&a, &b, &c],
            None,
            &islands,
        );
        assert_eq!(hier[0].to_f32(), 256.0);
    }

    #[test]
    fn negative_zero_survives() {
        let z = [-0.0f32];
        let out = reference_reduce(
            Algorithm::TwoShot(Transfer::Pull),
            &[&z, &z],
            None,
            &Islands::single(2),
        );
        assert!(out[0].is_sign_negative());
    }
}
