//! Sampling on the device (`sample_rows` in `layers.cu`, launched by
//! [`LayerKernels::sample_rows`]) and its CPU reference.
//!
//! A draw is a pure function of the logits and one [`SampleRow`]: temperature, top-k, top-p,
//! and a counter-based random number (Philox4x32-10 of the sequence's seed and the draw's
//! index). So the CPU sampler, a captured CUDA graph and a replay after a restart draw the same
//! token, with no generator state to carry.
//!
//! The cuts are thresholds on a total order of (probability, index) — more probable first, the
//! lower index first on ties, the order a stable sort would give — found by a bitwise search,
//! one pass over the row per key bit: exact, with no sort on the device. The sums run in the
//! kernel's fixed order (each of [`THREADS`] threads sums a contiguous slice; a halving tree
//! combines them during the searches, a sequential scan for the draw), which
//! [`sample_row`] reproduces bit for bit, `expf` included.

use super::{F32, I32, LayerKernels, THREADS, as_i32, need, rows_config};
use crate::device::{Device, DeviceMemory, KernelParams, Result};

/// One row's sampling parameters, as `sample_rows` reads them (`struct SampleRow`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
pub struct SampleRow {
    /// 0 (or less) is greedy: the first index of the largest logit.
    pub temperature: f32,
    /// 0 (or at least the vocabulary) keeps every token.
    pub top_k: i32,
    /// 1 keeps the whole mass.
    pub top_p: f32,
    pub reserved: u32,
    pub seed: u64,
    /// The draw's index in its sequence's stream.
    pub counter: u64,
}

/// Bytes of one [`SampleRow`] (the kernel asserts the same size).
pub const SAMPLE_ROW_BYTES: usize = std::mem::size_of::<SampleRow>();

/// The device's draw, beside its reference.
impl<D: Device> LayerKernels<D> {
    /// `ids [rows]` = one draw per row of `logits [rows][vocab]` under `params [rows]`
    /// ([`SampleRow`]). Rows with a temperature above 0 are overwritten with their
    /// unnormalized probabilities. The CPU reference is [`sample_row`].
    pub fn sample_rows(
        &self,
        dev: &D,
        logits: &D::Memory,
        rows: usize,
        vocab: usize,
        params: &D::Memory,
        ids: &D::Memory,
    ) -> Result<()> {
        const K: &str = "sample_rows";
        need(logits, rows * vocab * F32, K, "logits")?;
        need(params, rows * SAMPLE_ROW_BYTES, K, "params")?;
        need(ids, rows * I32, K, "ids")?;
        let (l, s, i) = (logits.device_ptr(), params.device_ptr(), ids.device_ptr());
        let vocab = as_i32(vocab, K, "vocab")?;
        let mut p = KernelParams::new();
        p.arg(&l).arg(&vocab).arg(&s).arg(&i);
        // At a temperature the row is rewritten as probabilities; the key searches re-read it
        // (from L2 on a GPU), which is not counted.
        let row_bytes = rows * vocab as usize * F32;
        p.traffic(row_bytes + rows * SAMPLE_ROW_BYTES, row_bytes + rows * I32);
        // SAFETY: `sample_rows(float*, int, const SampleRow*, int*)`; sizes checked above.
        unsafe { dev.launch(self.kernel(K), rows_config(rows, K)?, &p) }
    }
}

const PHILOX_M0: u64 = 0xD251_1F53;
const PHILOX_M1: u64 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32-10 of `counter` (four words) under `key` (two words), as Random123 defines it.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(PHILOX_W0);
            k1 = k1.wrapping_add(PHILOX_W1);
        }
        let p0 = PHILOX_M0 * u64::from(c0);
        let p1 = PHILOX_M1 * u64::from(c2);
        let n0 = (p1 >> 32) as u32 ^ c1 ^ k0;
        let n2 = (p0 >> 32) as u32 ^ c3 ^ k1;
        c1 = p1 as u32;
        c3 = p0 as u32;
        c0 = n0;
        c2 = n2;
    }
    [c0, c1, c2, c3]
}

/// The uniform in [0, 1) of draw `counter` under `seed`: the top 24 bits of Philox's first
/// word for counter `{counter, 0, 0}` and key `seed`.
pub fn philox_uniform(seed: u64, counter: u64) -> f32 {
    let words = philox4x32_10(
        [counter as u32, (counter >> 32) as u32, 0, 0],
        [seed as u32, (seed >> 32) as u32],
    );
    (words[0] >> 8) as f32 * (1.0 / 16_777_216.0)
}

/// Probabilities are >= 0, so their bits order as unsigned integers.
fn sample_key(prob: f32, index: usize, vocab: usize, index_bits: u32) -> u64 {
    (u64::from(prob.to_bits()) << index_bits) | (vocab - 1 - index) as u64
}

/// The kernel's halving-tree sum of one value per thread.
fn tree_sum(mut values: Vec<f32>) -> f32 {
    let mut stride = values.len() / 2;
    while stride > 0 {
        for t in 0..stride {
            values[t] += values[t + stride];
        }
        stride /= 2;
    }
    values[0]
}

/// The token `sample_rows` draws from `logits` (one row) under `params`.
pub fn sample_row(logits: &[f32], params: &SampleRow) -> u32 {
    let vocab = logits.len();
    assert!(vocab > 0, "sampling from an empty row");
    if params.temperature.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        return greedy(logits);
    }
    let threads = THREADS as usize;
    let chunk = vocab.div_ceil(threads);
    let slices: Vec<std::ops::Range<usize>> = (0..threads)
        .map(|t| {
            let lo = (t * chunk).min(vocab);
            lo..(lo + chunk).min(vocab)
        })
        .collect();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let probs: Vec<f32> = logits
        .iter()
        .map(|&l| ((l - max) / params.temperature).exp())
        .collect();
    let index_bits = if vocab > 1 {
        32 - ((vocab - 1) as u32).leading_zeros()
    } else {
        0
    };
    let key_bits = 32 + index_bits;
    let keys: Vec<u64> = probs
        .iter()
        .enumerate()
        .map(|(i, &p)| sample_key(p, i, vocab, index_bits))
        .collect();
    let mass_from = |cut: u64| {
        tree_sum(
            slices
                .iter()
                .map(|s| {
                    s.clone()
                        .filter(|&i| keys[i] >= cut)
                        .fold(0.0f32, |a, i| a + probs[i])
                })
                .collect(),
        )
    };
    let mut lower = 0u64;
    if params.top_k > 0 && (params.top_k as usize) < vocab {
        let mut threshold = 0u64;
        for b in (0..key_bits).rev() {
            let candidate = threshold | (1u64 << b);
            let count = keys.iter().filter(|&&k| k >= candidate).count();
            if count >= params.top_k as usize {
                threshold = candidate;
            }
        }
        lower = threshold;
    }
    if params.top_p < 1.0 {
        let target = params.top_p * mass_from(lower);
        let mut threshold = 0u64;
        for b in (0..key_bits).rev() {
            let candidate = threshold | (1u64 << b);
            if mass_from(candidate.max(lower)) >= target {
                threshold = candidate;
            }
        }
        lower = lower.max(threshold);
    }
    let kept = |s: &std::ops::Range<usize>| s.clone().filter(|&i| keys[i] >= lower);
    let slice_sums: Vec<f32> = slices
        .iter()
        .map(|s| kept(s).fold(0.0f32, |a, i| a + probs[i]))
        .collect();
    let total = slice_sums.iter().fold(0.0f32, |a, &s| a + s);
    let target = philox_uniform(params.seed, params.counter) * total;
    let mut before = 0.0f32;
    for (s, &sum) in slices.iter().zip(&slice_sums) {
        let local = target - before;
        if sum > local {
            let mut cumulative = 0.0f32;
            let mut last = None;
            for i in kept(s) {
                cumulative += probs[i];
                last = Some(i);
                if cumulative > local {
                    return i as u32;
                }
            }
            return last.expect("a slice with mass keeps a token") as u32;
        }
        before += sum;
    }
    // u · mass rounded up to the whole mass: the last kept token in index order.
    (0..vocab).rev().find(|&i| keys[i] >= lower).unwrap_or(0) as u32
}

/// The first index of the largest value (`argmax_rows`).
pub fn greedy(logits: &[f32]) -> u32 {
    // The first index of the maximum, as a scan keeping the first of strictly greater values
    // gives it, in two vector passes (the maximum, then the first block holding it): the
    // scan's compare-and-branch per element took 13 µs for 32,768 logits, most of a decode
    // step's sampling. A NaN at index 0 wins that scan (nothing compares greater); NaNs
    // elsewhere never do, as `max` passes over them.
    const LANES: usize = 16;
    if logits.first().is_none_or(|v| v.is_nan()) {
        return 0;
    }
    let (blocks, rest) = logits.as_chunks::<LANES>();
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for block in blocks {
        for (m, &v) in lanes.iter_mut().zip(block) {
            *m = m.max(v);
        }
    }
    let max = lanes
        .iter()
        .chain(rest)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let first_block = blocks
        .iter()
        .position(|block| block.iter().fold(false, |found, &v| found | (v == max)))
        .unwrap_or(blocks.len());
    logits[first_block * LANES..]
        .iter()
        .position(|&v| v == max)
        .map_or(0, |i| (first_block * LANES + i) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scan `greedy` replaces: the first index whose value is greater than every earlier
    /// one's.
    fn first_greatest(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    proptest::proptest! {
        /// Ties (values from a few levels), NaNs and infinities anywhere, every length around
        /// the 16-lane blocks: the same index as the plain scan.
        #[test]
        fn greedy_is_the_first_greatest(
            codes in proptest::collection::vec(0u8..12, 0..200),
        ) {
            let logits: Vec<f32> = codes
                .iter()
                .map(|&c| match c {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => f32::INFINITY,
                    c => f32::from(c) * 0.5 - 3.0,
                })
                .collect();
            proptest::prop_assert_eq!(greedy(&logits), first_greatest(&logits), "{:?}", logits);
        }
    }

    /// Random123's published known-answer vectors for Philox4x32-10 (kat_vectors).
    #[test]
    fn philox_matches_random123_known_answers() {
        assert_eq!(
            philox4x32_10([0, 0, 0, 0], [0, 0]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    fn row(temperature: f32, top_k: i32, top_p: f32, counter: u64) -> SampleRow {
        SampleRow {
            temperature,
            top_k,
            top_p,
            seed: 7,
            counter,
            ..SampleRow::default()
        }
    }

    #[test]
    fn cuts_keep_what_a_sort_keeps() {
        // Ties at 2.0 (indices 1 and 4): a sort by (logit desc, index asc) keeps index 1 first.
        let logits = [0.1f32, 2.0, 1.9, -1.0, 2.0];
        for counter in 0..64 {
            assert_eq!(sample_row(&logits, &row(1.0, 1, 1.0, counter)), 1);
            let two = sample_row(&logits, &row(1.0, 2, 1.0, counter));
            assert!(two == 1 || two == 4, "top-2 drew {two}");
            let nucleus = sample_row(&logits, &row(0.8, 0, 0.9, counter));
            assert_ne!(nucleus, 3, "top-p 0.9 must cut the unlikely token");
        }
        assert_eq!(sample_row(&logits, &row(0.0, 0, 1.0, 0)), 1);
    }

    #[test]
    fn frequencies_follow_the_softmax_over_a_wide_row() {
        // A row wider than the kernel's threads, so draws cross slice boundaries.
        let vocab = 1000;
        let logits: Vec<f32> = (0..vocab).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let weights: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let draws = 40_000;
        let mut counts = vec![0usize; vocab];
        for counter in 0..draws {
            counts[sample_row(&logits, &row(1.0, 0, 1.0, counter)) as usize] += 1;
        }
        // Grouped by logit value (11 classes), each class frequency within 5 sigma.
        for class in 0..11 {
            let members: Vec<usize> = (0..vocab).filter(|i| (i * 37) % 11 == class).collect();
            let p: f64 = members.iter().map(|&i| weights[i]).sum::<f64>() / total;
            let seen = members.iter().map(|&i| counts[i]).sum::<usize>() as f64 / draws as f64;
            let sigma = (p * (1.0 - p) / draws as f64).sqrt();
            assert!(
                (seen - p).abs() < 5.0 * sigma,
                "class {class}: {seen} vs {p}"
            );
        }
    }
}
