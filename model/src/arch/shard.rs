//! Tensor parallelism's split of the model: which heads, intermediate rows and vocabulary ids
//! a rank holds.

use std::ops::Range;

/// One rank's part of a tensor-parallel model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpShard {
    pub rank: usize,
    pub world: usize,
}

impl TpShard {
    pub const SINGLE: Self = Self { rank: 0, world: 1 };

    /// This rank's `start..end` of `total` items split evenly.
    pub fn range(&self, total: usize) -> (usize, usize) {
        let per = total / self.world;
        (self.rank * per, (self.rank + 1) * per)
    }

    /// This rank's rows of a `vocab`-row table (the embedding and `lm_head`): nearly equal
    /// parts in rank order, the first `vocab % world` ranks one row longer, so any vocabulary
    /// splits and rank 0 holds the most. The one definition of the vocabulary split: the CPU
    /// shard, the device executor and `model plan` all take it from here.
    pub fn vocab_rows(&self, vocab: usize) -> Range<usize> {
        let world = self.world.max(1);
        let (base, extra) = (vocab / world, vocab % world);
        let start = self.rank * base + self.rank.min(extra);
        start..start + base + usize::from(self.rank < extra)
    }

    /// The rank of `world` whose [`vocab_rows`](Self::vocab_rows) are `rows`, if one is.
    pub fn holding_vocab_rows(world: usize, vocab: usize, rows: &Range<usize>) -> Option<Self> {
        (0..world.max(1))
            .map(|rank| Self { rank, world })
            .find(|s| s.vocab_rows(vocab) == *rows)
    }
}

#[cfg(test)]
mod tests {
    use super::TpShard;

    /// The vocabulary split covers every id once, in rank order, the parts at most one row
    /// apart with rank 0 the largest; and each part names its rank back.
    #[test]
    fn vocabulary_rows_partition_the_vocabulary_in_rank_order() {
        for (vocab, world) in [
            (163_840, 8),
            (512, 4),
            (10, 3),
            (8, 8),
            (129_280, 3),
            (7, 1),
        ] {
            let parts: Vec<_> = (0..world)
                .map(|rank| TpShard { rank, world }.vocab_rows(vocab))
                .collect();
            assert_eq!(parts[0].start, 0, "{vocab} over {world}");
            assert_eq!(parts[world - 1].end, vocab, "{vocab} over {world}");
            for (rank, pair) in parts.windows(2).enumerate() {
                assert_eq!(
                    pair[0].end, pair[1].start,
                    "{vocab} over {world}, rank {rank}"
                );
            }
            let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
            let (max, min) = (lens.iter().max().unwrap(), lens.iter().min().unwrap());
            assert!(
                max - min <= 1 && lens[0] == *max,
                "{vocab} over {world}: {lens:?}"
            );
            for (rank, rows) in parts.iter().enumerate() {
                assert_eq!(
                    TpShard::holding_vocab_rows(world, vocab, rows),
                    Some(TpShard { rank, world })
                );
            }
        }
        assert_eq!(TpShard::holding_vocab_rows(4, 512, &(0..100)), None);
        assert_eq!(TpShard { rank: 0, world: 8 }.vocab_rows(163_840), 0..20_480);
    }
}
