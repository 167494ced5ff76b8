//! Fast CPU path of absorbed MLA attention: same contract as
//! [`mla_attention_reference`](super::reference::mla_attention_reference), built like the GPU
//! kernel so the two share one design:
//!
//! - one pass over the cache with an online softmax (the reference reads and dequantizes every
//!   token twice);
//! - each token tile is dequantized once and used by every head (the cache is shared by heads);
//!   a decode over a BF16 cache instead reads each key where it lies, a group of heads per task
//!   (two, four or eight) widening each key once for the group;
//! - split-KV: a request's tokens are cut into chunks processed in parallel, so batch 1 with a
//!   long context uses every core; chunks are merged exactly through their log-sum-exp;
//! - inner loops over 16 independent accumulators, which the compiler turns into SIMD (a plain
//!   `iter().sum()` must keep the sequential FP order and does not vectorize).

use rayon::prelude::*;

use super::cache::{CacheError, PagedLatentCache, RawLayer};
use super::reference::MlaProblem;
use crate::cpu_tactic::{CpuTactic, MLA_TILE};
use crate::formats::widen_bf16;
#[cfg(target_arch = "x86_64")]
use crate::formats::widen16_bf16;
use crate::isa::Isa;
use crate::scratch::sized;

/// Tokens dequantized together and reused by every head.
const TILE: usize = MLA_TILE;

/// One chunk's unnormalized result: `acc[h] = Σ_t exp(s_t - m[h]) c_t`, `l[h] = Σ_t exp(s_t - m[h])`.
struct Partial<'a> {
    m: Vec<f32>,
    l: Vec<f32>,
    /// Its part of the call's one accumulator buffer (see [`mla_attention_compiled_for`]).
    acc: &'a mut [f32],
}

impl<'a> Partial<'a> {
    /// The empty result of `heads` heads over `acc` (zeroed by the caller).
    fn empty(heads: usize, acc: &'a mut [f32]) -> Self {
        // Not `vec![0.0; n]`: glibc's calloc, which that becomes, skips the per-thread cache
        // and takes the arena's lock.
        let mut sums = Vec::with_capacity(heads);
        sums.resize(heads, 0.0);
        Self {
            m: vec![f32::NEG_INFINITY; heads],
            l: sums,
            acc,
        }
    }
}

/// Computes `out[row, h] = Σ_t softmax_t(score) · c_t` and the log-sum-exp of the scaled scores,
/// like the reference, in one pass with split-KV parallelism.
pub fn mla_attention(
    cache: &PagedLatentCache,
    problem: &MlaProblem<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), CacheError> {
    mla_attention_tuned(&CpuTactic::DEFAULT, cache, problem, out, lse)
}

/// [`mla_attention`] under a tactic: split-KV chunks aim for
/// [`mla_tasks_per_thread`](CpuTactic::mla_tasks_per_thread) tasks per pool thread over the
/// whole batch, none shorter than [`mla_min_chunk`](CpuTactic::mla_min_chunk) tokens (below it
/// the merge and scheduling overhead wins). Where the chunks are cut changes the order of the
/// softmax sums, so tactics agree to rounding, not bit for bit.
///
/// # Panics
/// If the tactic is invalid.
pub fn mla_attention_tuned(
    tactic: &CpuTactic,
    cache: &PagedLatentCache,
    problem: &MlaProblem<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), CacheError> {
    mla_attention_compiled_for(Isa::detect(), tactic, cache, problem, out, lse)
}

/// [`mla_attention_tuned`] with its loops compiled for `isa` (every ISA gives the same bits).
///
/// # Panics
/// If the tactic is invalid or this CPU does not support `isa`.
pub fn mla_attention_compiled_for(
    isa: Isa,
    tactic: &CpuTactic,
    cache: &PagedLatentCache,
    problem: &MlaProblem<'_>,
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), CacheError> {
    if let Err(e) = tactic.validate() {
        panic!("{e}");
    }
    let shape = cache.shape();
    let (l, r, h) = (shape.latent_dim, shape.rope_dim, problem.heads);
    let slots = problem.slots(cache, out, lse)?;
    let rows = slots.len();

    // Enough chunks for the tactic's tasks per thread over the whole batch, none shorter than
    // its minimum chunk.
    let total: usize = slots.iter().map(Vec::len).sum();
    // Per planned thread, not per thread of the pool this call happens to run in: where the
    // chunks are cut sets the rounding, and a backend that runs a contended step on fewer
    // threads must still give the same bits.
    let planned_threads = match tactic.threads {
        0 => crate::cpu_tactic::machine_cores(),
        n => n,
    };
    let want_tasks = tactic.mla_tasks_per_thread * planned_threads;
    let chunk = total
        .div_ceil(want_tasks)
        .max(tactic.mla_min_chunk)
        .next_multiple_of(TILE);
    // Blocks of consecutive rows of one sequence (a prefill chunk's positions): their slot
    // lists are prefixes of one another, so a block reads and dequantizes each cache tile
    // once for all its rows. A row's chunks are cut at the same positions as alone, and its
    // sums are the same bits.
    let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
    for row in 0..rows {
        match blocks.last_mut() {
            Some(b)
                if b.len() < BLOCK_ROWS
                    && problem.queries[b.start].seq == problem.queries[row].seq =>
            {
                b.end = row + 1
            }
            _ => blocks.push(row..row + 1),
        }
    }
    // (block, its longest row, start, end) per chunk of the longest row.
    let chunks: Vec<(usize, usize, usize, usize)> = blocks
        .iter()
        .enumerate()
        .flat_map(|(b, block)| {
            let longest = block
                .clone()
                .max_by_key(|&row| slots[row].len())
                .expect("a row");
            let len = slots[longest].len();
            (0..len.div_ceil(chunk))
                .map(move |c| (b, longest, c * chunk, ((c + 1) * chunk).min(len)))
        })
        .collect();
    // Too few chunks for the tasks wanted (decode: one row, a context shorter than the minimum
    // chunk): the heads are cut into groups too. A head's sums do not depend on its group.
    // Decode rows (blocks of one row) over a BF16 cache, where the pool has threads to share
    // them: heads in groups of pairs whose keys are read in place (`attend_row_in_place`) at
    // any context (a pair per task: 1.23x at 1,500 keys on 2 threads). The groups are the
    // widest that still give the tactic's tasks: a task reads its chunk's keys from memory
    // once for all its heads, the pairs after the first from L1, where a pair per task made
    // each key cross the caches once per pair. Whole decode steps of `mini` on Zen 4 (2
    // threads, alternating in one process, median of per-round ratios of the step time to a
    // pair per task): this rule 0.951 at 2,048-2,140 keys (groups of 8); fixed groups of 4
    // 0.946 at 1,024-1,300 keys and 1.004 at 128-512, fixed groups of 8 0.924 at 3,000-3,300
    // but 1.035 at 128-512 (one task: one thread idle). On one thread the widening the
    // in-place reads repeat per pair costs more than they save, and one task takes all heads
    // from a dequantized tile.
    let one_row_blocks = blocks.iter().all(|b| b.len() == 1);
    let bf16 = matches!(cache.raw_layer(problem.layer), RawLayer::Bf16 { .. });
    let in_place = one_row_blocks && bf16 && rayon::current_num_threads() > 1;
    let heads_per_task = if in_place {
        let mut width = DOT_HEADS;
        while width * 2 <= h && chunks.len() * h.div_ceil(width * 2) >= want_tasks {
            width *= 2;
        }
        // With the AVX-512 group kernels, groups of four heads (where that still leaves a task
        // per thread) even when the tactic wants more tasks: a quad widens each key once for
        // four heads, which pays more than the extra tasks balance (decode of 8 heads on 2
        // threads, calls alternating in one process, median time over pairs: 0.78-0.89 at
        // 128-256 keys, 0.81-0.85 at 512).
        if group_kernels(isa) {
            while width < QUAD_GROUP
                && width * 2 <= h
                && chunks.len() * h.div_ceil(width * 2) >= planned_threads
            {
                width *= 2;
            }
        }
        width.min(h)
    } else if chunks.len() >= want_tasks {
        h
    } else {
        let groups = want_tasks.div_ceil(chunks.len().max(1));
        h.div_ceil(groups).max(MIN_HEADS_PER_TASK).min(h)
    };
    let groups = h.div_ceil(heads_per_task.max(1));
    let tasks: Vec<(usize, usize, usize, usize, usize)> = chunks
        .iter()
        .flat_map(|&(b, longest, start, end)| (0..groups).map(move |g| (b, longest, g, start, end)))
        .collect();

    // The loops are plain Rust over 16 accumulators; compiled for the CPU's ISA they run a
    // zmm (or two ymm) per step instead of four SSE registers, with the same bits.
    assert!(isa.is_supported(), "{isa:?} is not supported by this CPU");
    let head_range = |g: usize| g * heads_per_task..((g + 1) * heads_per_task).min(h);
    // Every task's accumulators (its block's rows × its heads × L) in one buffer kept by the
    // calling thread between calls, each task zeroing its part: allocated inside the tasks,
    // they made the pool's threads queue on the allocator's lock.
    let task_floats = |&(b, _, g, _, _): &(usize, usize, usize, usize, usize)| {
        blocks[b].len() * head_range(g).len() * l
    };
    let mut acc_buffer = ACC_BUFFER.take();
    let mut acc_spaces: Vec<&mut [f32]> = Vec::with_capacity(tasks.len());
    let mut rest = sized(&mut acc_buffer, tasks.iter().map(task_floats).sum());
    for task in &tasks {
        let (space, tail) = rest.split_at_mut(task_floats(task));
        acc_spaces.push(space);
        rest = tail;
    }
    let partials: Vec<(usize, Vec<(usize, Partial<'_>)>)> = tasks
        .par_iter()
        .zip(acc_spaces)
        .map(|(&(b, longest, g, start, end), acc_space)| {
            let heads = head_range(g);
            // The block's rows that reach into this chunk, and how many of its keys each takes.
            let queries: Vec<(usize, BlockRow<'_>)> = blocks[b]
                .clone()
                .filter(|&row| slots[row].len() > start)
                .map(|row| {
                    debug_assert_eq!(slots[row][start..], slots[longest][start..slots[row].len()]);
                    let q = BlockRow {
                        q_abs: &problem.q_abs
                            [(row * h + heads.start) * l..(row * h + heads.end) * l],
                        q_pe: &problem.q_pe[(row * h + heads.start) * r..(row * h + heads.end) * r],
                        keys: slots[row].len().min(end) - start,
                    };
                    (row, q)
                })
                .collect();
            let args = BlockArgs {
                cache,
                layer: problem.layer,
                slots: &slots[longest][start..end],
                rows: &queries,
                heads: heads.len(),
                scale: problem.softmax_scale,
                isa,
                in_place,
            };
            let parts = match isa {
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU supports the ISA (asserted above).
                Isa::Avx512 => unsafe { attend_block_avx512(args, acc_space) },
                #[cfg(target_arch = "x86_64")]
                // SAFETY: as above.
                Isa::Avx2Fma => unsafe { attend_block_avx2(args, acc_space) },
                _ => attend_block(args, acc_space),
            };
            (g, queries.iter().map(|(row, _)| *row).zip(parts).collect())
        })
        .collect();

    // Merge each row's chunks per head group (a row's chunks come in order).
    let mut by_row: Vec<Vec<Vec<&Partial<'_>>>> =
        (0..rows).map(|_| vec![Vec::new(); groups]).collect();
    for (g, parts) in &partials {
        for (row, p) in parts {
            by_row[*row][*g].push(p);
        }
    }
    out.par_chunks_mut(h * l)
        .zip(lse.par_chunks_mut(h))
        .zip(by_row.par_iter())
        .for_each(|((out_row, lse_row), groups)| {
            for (g, parts) in groups.iter().enumerate() {
                let heads = head_range(g);
                merge(
                    parts,
                    heads.len(),
                    l,
                    &mut out_row[heads.start * l..heads.end * l],
                    &mut lse_row[heads.clone()],
                );
            }
        });
    drop(by_row);
    drop(partials);
    if acc_buffer.len() * size_of::<f32>() <= KEEP_ACC_BYTES {
        ACC_BUFFER.set(acc_buffer);
    }
    Ok(())
}

/// The largest accumulator buffer a thread keeps for its next call (a long prefill's is freed).
const KEEP_ACC_BYTES: usize = 32 << 20;

thread_local! {
    /// [`mla_attention_compiled_for`]'s accumulator buffer, reused across its calls.
    static ACC_BUFFER: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Rows of one sequence a task attends together.
const BLOCK_ROWS: usize = 8;

/// Heads one task takes at least when the heads are cut into groups: each task dequantizes
/// the cache tiles it reads, once for all its heads.
const MIN_HEADS_PER_TASK: usize = 2;

/// One query row of a block: its heads' queries and how many of the chunk's keys it attends
/// (a prefix: the rows of a block are positions of one sequence).
struct BlockRow<'a> {
    q_abs: &'a [f32],
    q_pe: &'a [f32],
    keys: usize,
}

/// What [`attend_block`] works on: a block's rows over a chunk of their cache slots.
#[derive(Clone, Copy)]
struct BlockArgs<'a> {
    cache: &'a PagedLatentCache,
    layer: usize,
    /// The chunk's slots, as the block's longest row sees them.
    slots: &'a [usize],
    rows: &'a [(usize, BlockRow<'a>)],
    heads: usize,
    scale: f32,
    /// The ISA of the inner loops, which run as functions of their own: inlined into the
    /// block's loop nest, the compiler left the latent accumulation scalar.
    isa: Isa,
    /// A decode row's task over a BF16 cache whatever its heads: read the keys in place.
    in_place: bool,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn attend_block_avx512<'a>(args: BlockArgs<'_>, acc_space: &'a mut [f32]) -> Vec<Partial<'a>> {
    attend_block(args, acc_space)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_block_avx2<'a>(args: BlockArgs<'_>, acc_space: &'a mut [f32]) -> Vec<Partial<'a>> {
    attend_block(args, acc_space)
}

/// Online-softmax attention of every row of a block, all its heads, over `slots`: each tile
/// of keys is read from the cache once and used by every row that reaches it. `acc_space`
/// holds at least `rows × heads × L` floats, the rows' accumulators.
#[inline(always)]
fn attend_block<'a>(args: BlockArgs<'_>, acc_space: &'a mut [f32]) -> Vec<Partial<'a>> {
    let BlockArgs {
        cache,
        layer,
        slots,
        rows,
        heads,
        scale,
        isa,
        in_place,
    } = args;
    if rows.len() == 1
        && (in_place || heads <= DOT_HEADS)
        && let RawLayer::Bf16 { values } = cache.raw_layer(layer)
    {
        return attend_row_in_place(args, values, acc_space);
    }
    let shape = cache.shape();
    let (l, r) = (shape.latent_dim, shape.rope_dim);
    // The tile buffers, kept per thread: every slot read overwrites the rows it uses, and a
    // 72 KB allocation per task made the pool's threads queue on the allocator's lock.
    let mut tile_buffers = TILE_BUFFERS.take();
    let tile_keys = TILE.min(slots.len());
    let (latent, rope) = &mut tile_buffers;
    let (latent, rope) = (sized(latent, tile_keys * l), sized(rope, tile_keys * r));
    acc_space.fill(0.0);
    let mut space = acc_space;
    let mut parts: Vec<Partial<'a>> = rows
        .iter()
        .map(|_| {
            let (acc, rest) = std::mem::take(&mut space).split_at_mut(heads * l);
            space = rest;
            Partial::empty(heads, acc)
        })
        .collect();
    let mut scores = Vec::with_capacity(heads);
    scores.resize(heads, [0.0f32; TILE]);
    for (t, tile) in slots.chunks(TILE).enumerate() {
        let t0 = t * TILE;
        for (i, &slot) in tile.iter().enumerate() {
            cache.read_slot(
                layer,
                slot,
                &mut latent[i * l..(i + 1) * l],
                &mut rope[i * r..(i + 1) * r],
            );
        }
        for ((_, row), part) in rows.iter().zip(parts.iter_mut()) {
            if row.keys <= t0 {
                continue;
            }
            let n = tile.len().min(row.keys - t0);
            // Every head's scores of the tile first, two heads at a time: each key's vectors
            // are loaded once for both, and eight accumulator chains overlap instead of four.
            // A score is the same function of its head and key in any grouping (same bits).
            for h0 in (0..heads).step_by(DOT_HEADS) {
                let h1 = (h0 + 1).min(heads - 1);
                let qa = [h0, h1].map(|h| &row.q_abs[h * l..(h + 1) * l]);
                let qp = [h0, h1].map(|h| &row.q_pe[h * r..(h + 1) * r]);
                let key = |i: usize| (&latent[i * l..(i + 1) * l], &rope[i * r..(i + 1) * r]);
                [scores[h0], scores[h1]] = pair_scores(isa, qa, qp, key, n, scale);
            }
            for (head, scores) in scores.iter().enumerate().take(heads) {
                let scores = &scores[..n];
                let mut probs = [0.0f32; TILE];
                let alpha = softmax_tile(
                    isa,
                    &mut part.m[head],
                    &mut part.l[head],
                    scores,
                    &mut probs,
                );
                let acc = &mut part.acc[head * l..(head + 1) * l];
                accumulate_tile_with(isa, acc, alpha, &probs[..n], &latent[..n * l]);
            }
        }
    }
    TILE_BUFFERS.set(tile_buffers);
    parts
}

/// The scaled scores of a tile's first `n` keys (`key(i)`: key `i`'s latent and RoPE parts)
/// for a pair of heads (`qa`, `qp`: their queries; one head twice for a last odd head), four
/// keys at a time, each key's sum in `dot`'s order: each key's vectors are loaded once for
/// both heads, and eight accumulator chains overlap instead of four. A score is the same
/// function of its head and key in any grouping (the same bits).
#[inline(always)]
fn pair_scores<'k, E: KeyElement + 'k>(
    isa: Isa,
    qa: [&[f32]; DOT_HEADS],
    qp: [&[f32]; DOT_HEADS],
    key: impl Fn(usize) -> (&'k [E], &'k [E]),
    n: usize,
    scale: f32,
) -> [[f32; TILE]; DOT_HEADS] {
    let mut scores = [[0.0f32; TILE]; DOT_HEADS];
    let mut i = 0;
    while i + DOT_KEYS <= n {
        let keys: [(&[E], &[E]); DOT_KEYS] = std::array::from_fn(|k| key(i + k));
        let d_latent = dots_with(isa, qa, keys.map(|k| k.0));
        let d_rope = dots_with(isa, qp, keys.map(|k| k.1));
        for j in 0..DOT_HEADS {
            for k in 0..DOT_KEYS {
                scores[j][i + k] = (d_latent[j][k] + d_rope[j][k]) * scale;
            }
        }
        i += DOT_KEYS;
    }
    for i in i..n {
        let (latent, rope) = key(i);
        for (scores, (qa, qp)) in scores.iter_mut().zip(qa.iter().zip(qp)) {
            scores[i] = (dot(qa, latent) + dot(qp, rope)) * scale;
        }
    }
    scores
}

/// One tile's step of a head's online softmax: its running maximum `m` and sum `l` take in
/// the tile's `scores`; `probs` gets their exponentials. Returns the factor by which the
/// head's accumulator is rescaled (0 on the first tile, whose `m` is −∞: the empty
/// accumulator is simply replaced).
#[inline(always)]
fn softmax_tile(
    isa: Isa,
    m: &mut f32,
    l: &mut f32,
    scores: &[f32],
    probs: &mut [f32; TILE],
) -> f32 {
    let tile_max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let m_new = m.max(tile_max);
    let alpha = (*m - m_new).exp();
    exps_below_with(isa, m_new, scores, probs);
    let sum = probs[..scores.len()].iter().fold(0.0f32, |sum, &p| sum + p);
    *l = *l * alpha + sum;
    *m = m_new;
    alpha
}

/// `e^x` for the `x ≤ 0` of a softmax (`score − max`), in plain arithmetic that vectorizes and
/// gives the same bits on every ISA (no fused multiply-adds): Cephes' `expf`, a reduction to
/// `r ∈ [−ln2/2, ln2/2]` by `n = ⌊x·log₂e + ½⌋` with ln 2 in two parts, then
/// `1 + r + r²·P(r)` times `2ⁿ`. Within 1 ulp of the exact value for `−87.3 ≤ x ≤ 0` (a
/// positive `x`, which a softmax never has, counts as 0); 0 below (where `e^x` is under
/// 1.2e−38); NaN as it comes.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    /// Below this `2ⁿ` would leave the normal range.
    const LOWEST: f32 = -87.336_55;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let clamped = x.clamp(LOWEST, 0.0);
    let n = (clamped * std::f32::consts::LOG2_E + 0.5).floor();
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let poly = (((((1.987_569_2e-4 * r + 1.398_2e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2)
        * r
        + 1.666_666_5e-1)
        * r
        + 0.5)
        * (r * r)
        + r
        + 1.0;
    // n ∈ [−126, 0]: 2ⁿ by its exponent field.
    let y = poly * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x >= LOWEST {
        y
    } else if x < LOWEST {
        0.0
    } else {
        x
    }
}

/// [`attend_block`] of one row over a BF16 cache (a decode task: the call cuts a decode's
/// heads into groups): each key is used once per group of heads (eight or four with AVX-512's
/// group kernels, else a pair), so it is read where it lies in the cache and widened in
/// registers, once for the group, instead of copied into an f32 tile first (the copy's writes
/// and re-reads were a third of the call). The sums are the same bits.
// Not inlined into attend_block: its loops kept apart from the tile path's, whose decode
// calls measured 8% slower with them inlined; the inner loops are compiled for the ISA
// through their own wrappers.
#[inline(never)]
fn attend_row_in_place<'a>(
    args: BlockArgs<'_>,
    values: &[half::bf16],
    acc_space: &'a mut [f32],
) -> Vec<Partial<'a>> {
    let (heads, scale, isa) = (args.heads, args.scale, args.isa);
    let shape = args.cache.shape();
    let (l, r) = (shape.latent_dim, shape.rope_dim);
    let row = &args.rows[0].1;
    acc_space.fill(0.0);
    let mut part = Partial::empty(heads, &mut acc_space[..heads * l]);
    for (t, tile) in args.slots.chunks(TILE).enumerate() {
        let t0 = t * TILE;
        if row.keys <= t0 {
            break;
        }
        let n = tile.len().min(row.keys - t0);
        let empty: &[half::bf16] = &[];
        let mut latents = [empty; TILE];
        let mut ropes = [empty; TILE];
        for (i, &slot) in tile[..n].iter().enumerate() {
            (latents[i], ropes[i]) = values[slot * (l + r)..(slot + 1) * (l + r)].split_at(l);
        }
        // The task's heads in groups, the tile's keys still in L1 for every group after the
        // first: eight or four at a time where the AVX-512 group kernels take them (each key
        // widened once for the whole group), then pairs (a last single head is scored as a
        // pair of itself).
        let mut h0 = 0;
        while h0 < heads {
            let left = heads - h0;
            #[cfg(target_arch = "x86_64")]
            if group_kernels(isa) && left >= QUAD_GROUP {
                let (group, attend): (usize, GroupKernel) = if left >= WIDE_GROUP {
                    (WIDE_GROUP, attend_group_avx512::<WIDE_GROUP, 1>)
                } else {
                    (QUAD_GROUP, attend_group_avx512::<QUAD_GROUP, 2>)
                };
                attend(
                    row,
                    &mut part,
                    h0,
                    &latents[..n],
                    &ropes[..n],
                    (l, r),
                    scale,
                );
                h0 += group;
                continue;
            }
            let pair = DOT_HEADS.min(left);
            let h1 = h0 + pair - 1;
            let qa = [h0, h1].map(|h| &row.q_abs[h * l..(h + 1) * l]);
            let qp = [h0, h1].map(|h| &row.q_pe[h * r..(h + 1) * r]);
            let scores = pair_scores(isa, qa, qp, |i| (latents[i], ropes[i]), n, scale);
            let mut probs = [[0.0f32; TILE]; DOT_HEADS];
            let mut alpha = [0.0f32; DOT_HEADS];
            for j in 0..pair {
                let (m, sum) = (&mut part.m[h0 + j], &mut part.l[h0 + j]);
                alpha[j] = softmax_tile(isa, m, sum, &scores[j][..n], &mut probs[j]);
            }
            let acc = &mut part.acc[h0 * l..(h0 + pair) * l];
            if pair == DOT_HEADS {
                let (first, second) = acc.split_at_mut(l);
                let probs = [&probs[0][..n], &probs[1][..n]];
                accumulate_widened_with(isa, [first, second], alpha, probs, &latents[..n]);
            } else {
                let probs = [&probs[0][..n]];
                accumulate_widened_with(isa, [acc], [alpha[0]], probs, &latents[..n]);
            }
            h0 += pair;
        }
    }
    vec![part]
}

/// Heads [`attend_group_avx512`] takes at once: eight (each key's latent widened once for all
/// eight), or four when fewer are left.
#[cfg(target_arch = "x86_64")]
const WIDE_GROUP: usize = 8;
const QUAD_GROUP: usize = 4;

/// Whether a decode task's heads go through [`attend_group_avx512`] four or eight at a time.
fn group_kernels(isa: Isa) -> bool {
    cfg!(target_arch = "x86_64") && isa == Isa::Avx512
}

/// One tile's step of heads `h0..h0 + H` of a decode row over a BF16 cache read in place
/// (`latents`, `ropes`: the tile's keys), with AVX-512: the scores by [`group_dots_avx512`]
/// (`K` keys per call, `H · K` = [`GROUP_ACCUMULATORS`]),
/// the softmax per head, the accumulation by [`accumulate_group_avx512`] for all `H` heads. Each
/// head's sums are the operations and order of the pair path (the same bits): grouping heads
/// only shares the widening of each key and lets eight accumulator chains overlap.
#[cfg(target_arch = "x86_64")]
fn attend_group_avx512<const H: usize, const K: usize>(
    row: &BlockRow<'_>,
    part: &mut Partial<'_>,
    h0: usize,
    latents: &[&[half::bf16]],
    ropes: &[&[half::bf16]],
    (l, r): (usize, usize),
    scale: f32,
) {
    let isa = Isa::Avx512;
    let n = latents.len();
    let qa: [&[f32]; H] = std::array::from_fn(|j| &row.q_abs[(h0 + j) * l..(h0 + j + 1) * l]);
    let qp: [&[f32]; H] = std::array::from_fn(|j| &row.q_pe[(h0 + j) * r..(h0 + j + 1) * r]);
    let mut scores = [[0.0f32; TILE]; H];
    let mut i = 0;
    while i + K <= n {
        let latent: [&[half::bf16]; K] = std::array::from_fn(|k| latents[i + k]);
        let rope: [&[half::bf16]; K] = std::array::from_fn(|k| ropes[i + k]);
        // SAFETY: this function runs only where the CPU has AVX-512 (the caller's isa); every
        // key's latent and RoPE parts are as long as the queries'.
        let (d_latent, d_rope) =
            unsafe { (group_dots_avx512(qa, latent), group_dots_avx512(qp, rope)) };
        for (j, scores) in scores.iter_mut().enumerate() {
            for k in 0..K {
                scores[i + k] = (d_latent[j][k] + d_rope[j][k]) * scale;
            }
        }
        i += K;
    }
    for i in i..n {
        for (j, scores) in scores.iter_mut().enumerate() {
            scores[i] = (dot(qa[j], latents[i]) + dot(qp[j], ropes[i])) * scale;
        }
    }
    let mut probs = [[0.0f32; TILE]; H];
    let mut alpha = [0.0f32; H];
    for j in 0..H {
        let (m, sum) = (&mut part.m[h0 + j], &mut part.l[h0 + j]);
        alpha[j] = softmax_tile(isa, m, sum, &scores[j][..n], &mut probs[j]);
    }
    let mut accs = part.acc[h0 * l..(h0 + H) * l].chunks_exact_mut(l);
    let acc: [&mut [f32]; H] = std::array::from_fn(|_| accs.next().expect("H heads"));
    let probs: [&[f32]; H] = std::array::from_fn(|j| &probs[j][..n]);
    // SAFETY: as above.
    unsafe { accumulate_group_avx512(acc, alpha, probs, latents) };
}

/// [`accumulate_widened`] of `H` heads with AVX-512 intrinsics (the same operations in the same
/// order, so the same bits): the heads' accumulator chunks stay in `2 · H` zmm across the
/// tile's keys, each key's chunk widened once. Written out because the compiler, given the
/// generic loops at eight heads, vectorized across the keys with gathers and scatters.
///
/// # Safety
/// The CPU supports AVX-512F/BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn accumulate_group_avx512<const H: usize>(
    acc: [&mut [f32]; H],
    alpha: [f32; H],
    probs: [&[f32]; H],
    latent: &[&[half::bf16]],
) {
    use std::arch::x86_64::*;
    let l = acc[0].len();
    assert!(acc.iter().all(|a| a.len() == l) && latent.iter().all(|k| k.len() == l));
    assert!(probs.iter().all(|p| p.len() == latent.len()));
    let full = l / WIDENED_CHUNK * WIDENED_CHUNK;
    let mut acc = acc;
    rescale(&mut acc, alpha);
    let mut e0 = 0;
    while e0 < full {
        // SAFETY: e0 + 32 ≤ full ≤ l, the length of every accumulator.
        let mut a: [[__m512; 2]; H] = std::array::from_fn(|j| unsafe {
            let p = acc[j].as_ptr().add(e0);
            [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))]
        });
        for (i, key) in latent.iter().enumerate() {
            // SAFETY: 32 values inside the key (e0 + 32 ≤ full ≤ l); AVX-512F is this
            // function's.
            let (w0, w1) = unsafe {
                let k = key.as_ptr().add(e0);
                (widen16_bf16(k), widen16_bf16(k.add(16)))
            };
            for (a, probs) in a.iter_mut().zip(&probs) {
                // SAFETY: i < latent.len() = probs.len() (asserted).
                let p = _mm512_set1_ps(unsafe { *probs.get_unchecked(i) });
                a[0] = _mm512_add_ps(a[0], _mm512_mul_ps(p, w0));
                a[1] = _mm512_add_ps(a[1], _mm512_mul_ps(p, w1));
            }
        }
        for (a, acc) in a.iter().zip(acc.iter_mut()) {
            // SAFETY: as for the loads.
            unsafe {
                let p = acc.as_mut_ptr().add(e0);
                _mm512_storeu_ps(p, a[0]);
                _mm512_storeu_ps(p.add(16), a[1]);
            }
        }
        e0 += WIDENED_CHUNK;
    }
    accumulate_past(full, &mut acc, probs, latent);
}

/// [`attend_group_avx512`] at one group width: `(row, part, h0, latents, ropes, (latent
/// width, RoPE width), softmax scale)`.
#[cfg(target_arch = "x86_64")]
type GroupKernel = fn(
    &BlockRow<'_>,
    &mut Partial<'_>,
    usize,
    &[&[half::bf16]],
    &[&[half::bf16]],
    (usize, usize),
    f32,
);

/// Accumulators of [`group_dots_avx512`]: heads × keys.
#[cfg(target_arch = "x86_64")]
const GROUP_ACCUMULATORS: usize = 8;

/// `dot(a[j], b[k])` for `H` heads and `K` keys (`H · K` = [`GROUP_ACCUMULATORS`]), each in
/// [`dot`]'s order (the same bits): 16 lanes per head and key, every key's 16 elements widened
/// once for all heads, products and sums unfused, then [`lane_sums`] and the tail.
///
/// # Safety
/// The CPU supports AVX-512F/BW; every `a[j]` and `b[k]` is as long as `a[0]`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
fn group_dots_avx512<const H: usize, const K: usize>(
    a: [&[f32]; H],
    b: [&[half::bf16]; K],
) -> [[f32; K]; H] {
    use std::arch::x86_64::*;
    const { assert!(H * K == GROUP_ACCUMULATORS) };
    let len = a[0].len();
    assert!(a.iter().all(|a| a.len() == len) && b.iter().all(|b| b.len() == len));
    let full = len / 16 * 16;
    let mut acc = [[_mm512_setzero_ps(); K]; H];
    let mut c = 0;
    while c < full {
        let mut wide = [_mm512_setzero_ps(); K];
        for (w, b) in wide.iter_mut().zip(b) {
            // SAFETY: c + 16 ≤ full ≤ b.len(): 16 BF16 values; AVX-512F is this function's.
            *w = unsafe { widen16_bf16(b.as_ptr().add(c)) };
        }
        for (acc, a) in acc.iter_mut().zip(&a) {
            // SAFETY: c + 16 ≤ full ≤ a.len().
            let x = unsafe { _mm512_loadu_ps(a.as_ptr().add(c)) };
            for (v, w) in acc.iter_mut().zip(&wide) {
                *v = _mm512_add_ps(*v, _mm512_mul_ps(x, *w));
            }
        }
        c += 16;
    }
    let mut lanes = [[0.0f32; 16]; GROUP_ACCUMULATORS];
    for (lanes, acc) in lanes.iter_mut().zip(acc.iter().flatten()) {
        // SAFETY: 16 floats.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *acc) };
    }
    let sums = lane_sums(Isa::Avx512, &lanes);
    let mut out = [[0.0f32; K]; H];
    for (j, out) in out.iter_mut().enumerate() {
        for (k, out) in out.iter_mut().enumerate() {
            let tail: f32 = a[j][full..]
                .iter()
                .zip(&b[k][full..])
                .map(|(x, y)| x * y.widen())
                .sum();
            *out = sums[j * K + k] + tail;
        }
    }
    out
}

thread_local! {
    /// [`attend_block`]'s dequantized tile (latents, RoPE parts), reused across its calls.
    static TILE_BUFFERS: std::cell::Cell<(Vec<f32>, Vec<f32>)> = const {
        std::cell::Cell::new((Vec::new(), Vec::new()))
    };
}

/// Exact merge of chunk results: with `M = max m_i` and `L = Σ l_i e^{m_i - M}`,
/// `out = Σ acc_i e^{m_i - M} / L` and `lse = M + ln L` — the same numbers one chunk would give.
fn merge(parts: &[&Partial<'_>], heads: usize, l: usize, out: &mut [f32], lse: &mut [f32]) {
    for head in 0..heads {
        let m = parts
            .iter()
            .fold(f32::NEG_INFINITY, |m, p| m.max(p.m[head]));
        let total: f32 = parts
            .iter()
            .map(|p| p.l[head] * (p.m[head] - m).exp())
            .sum();
        let o = &mut out[head * l..(head + 1) * l];
        o.fill(0.0);
        for p in parts {
            let w = (p.m[head] - m).exp() / total;
            axpy(w, &p.acc[head * l..(head + 1) * l], o);
        }
        lse[head] = m + total.ln();
    }
}

/// Dot product over 16 independent accumulators (vectorizes; the tail is summed plainly).
#[inline(always)]
pub fn dot<E: KeyElement>(a: &[f32], b: &[E]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y.widen())
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i].widen();
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `$body`, an expression of the arguments, compiled for `$isa`: for AVX-512 or AVX2 and FMA
/// by functions with those target features (generic over `[$generics]`), plainly otherwise.
/// The loops are plain Rust; compiled for the CPU's ISA they run a zmm (or two ymm) per step.
macro_rules! compiled_for {
    ($isa:expr, [$($generics:tt)*] ($($arg:ident: $ty:ty),*) -> $ret:ty, $body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx512bw")]
            #[inline(never)]
            fn avx512<$($generics)*>($($arg: $ty),*) -> $ret {
                $body
            }
            #[target_feature(enable = "avx2,fma")]
            #[inline(never)]
            fn avx2<$($generics)*>($($arg: $ty),*) -> $ret {
                $body
            }
            match $isa {
                // SAFETY: the caller checked that the CPU supports `isa`.
                Isa::Avx512 => return unsafe { avx512($($arg),*) },
                // SAFETY: as above.
                Isa::Avx2Fma => return unsafe { avx2($($arg),*) },
                Isa::Scalar => {}
            }
        }
        $body
    }};
}

/// [`dots`] compiled for `isa`.
fn dots_with<E: KeyElement>(isa: Isa, a: [&[f32]; DOT_HEADS], b: [&[E]; DOT_KEYS]) -> HeadKeyDots {
    compiled_for!(
        isa,
        [E: KeyElement] (isa: Isa, a: [&[f32]; DOT_HEADS], b: [&[E]; DOT_KEYS]) -> HeadKeyDots,
        dots(isa, a, b)
    )
}

/// `probs[i] = e^(scores[i] − max)` ([`exp_nonpositive`]) compiled for `isa`: a tile's
/// exponentials side by side (libm's `expf`, one call per score, was a sixth of a decode's
/// attention time with the loop around it).
fn exps_below_with(isa: Isa, max: f32, scores: &[f32], probs: &mut [f32; TILE]) {
    compiled_for!(
        isa,
        [] (max: f32, scores: &[f32], probs: &mut [f32; TILE]) -> (),
        for (p, &s) in probs.iter_mut().zip(scores) {
            *p = exp_nonpositive(s - max);
        }
    )
}

/// [`accumulate_tile`] compiled for `isa`.
fn accumulate_tile_with(isa: Isa, acc: &mut [f32], alpha: f32, probs: &[f32], latent: &[f32]) {
    compiled_for!(
        isa,
        [] (acc: &mut [f32], alpha: f32, probs: &[f32], latent: &[f32]) -> (),
        accumulate_tile(acc, alpha, probs, latent)
    )
}

/// [`accumulate_widened`] compiled for `isa`.
fn accumulate_widened_with<const H: usize>(
    isa: Isa,
    acc: [&mut [f32]; H],
    alpha: [f32; H],
    probs: [&[f32]; H],
    latent: &[&[half::bf16]],
) {
    compiled_for!(
        isa,
        [const H: usize] (
            acc: [&mut [f32]; H],
            alpha: [f32; H],
            probs: [&[f32]; H],
            latent: &[&[half::bf16]]
        ) -> (),
        accumulate_widened(acc, alpha, probs, latent)
    )
}

/// Each head's accumulator scaled whole by its `alpha` first (unless 1): each element is still
/// scaled once and then takes the keys in order.
#[inline(always)]
fn rescale<const H: usize>(acc: &mut [&mut [f32]; H], alpha: [f32; H]) {
    for (acc, &alpha) in acc.iter_mut().zip(&alpha) {
        if alpha != 1.0 {
            acc.iter_mut().for_each(|v| *v *= alpha);
        }
    }
}

/// The keys' terms of each head's accumulator elements from `from` on, key by key in order:
/// the elements past the last whole [`WIDENED_CHUNK`].
#[inline(always)]
fn accumulate_past<const H: usize>(
    from: usize,
    acc: &mut [&mut [f32]; H],
    probs: [&[f32]; H],
    latent: &[&[half::bf16]],
) {
    for (acc, probs) in acc.iter_mut().zip(&probs) {
        for (&p, key) in probs.iter().zip(latent) {
            for (d, s) in acc[from..].iter_mut().zip(&key[from..]) {
                *d += p * s.widen();
            }
        }
    }
}

/// [`accumulate_tile`] of a pair of heads (or one) over keys read in place from a BF16 cache
/// (the same bits): each key's chunk is widened once for the heads, whose accumulator chunks
/// ([`WIDENED_CHUNK`] elements each) stay in registers across the tile's keys.
#[inline(always)]
fn accumulate_widened<const H: usize>(
    acc: [&mut [f32]; H],
    alpha: [f32; H],
    probs: [&[f32]; H],
    latent: &[&[half::bf16]],
) {
    let l = acc[0].len();
    let full = l / WIDENED_CHUNK * WIDENED_CHUNK;
    let mut acc = acc;
    rescale(&mut acc, alpha);
    for e0 in (0..full).step_by(WIDENED_CHUNK) {
        let mut a: [[f32; WIDENED_CHUNK]; H] =
            std::array::from_fn(|j| acc[j][e0..e0 + WIDENED_CHUNK].try_into().expect("a chunk"));
        for (i, key) in latent.iter().enumerate() {
            let mut wide = [0.0f32; WIDENED_CHUNK];
            for (w, &x) in wide.iter_mut().zip(&key[e0..e0 + WIDENED_CHUNK]) {
                *w = x.widen();
            }
            for (a, probs) in a.iter_mut().zip(&probs) {
                let p = probs[i];
                for (v, &x) in a.iter_mut().zip(&wide) {
                    *v += p * x;
                }
            }
        }
        for (a, acc) in a.iter().zip(acc.iter_mut()) {
            acc[e0..e0 + WIDENED_CHUNK].copy_from_slice(a);
        }
    }
    accumulate_past(full, &mut acc, probs, latent);
}

/// Elements of each head's accumulator [`accumulate_widened`] keeps in registers (two `zmm`
/// per head).
const WIDENED_CHUNK: usize = 32;

/// A cached key's element type, widened to `f32` exactly (a score is the same bits from a
/// dequantized f32 tile or from the BF16 cache itself).
pub trait KeyElement: Copy + Sync {
    fn widen(self) -> f32;
}

impl KeyElement for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl KeyElement for half::bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        widen_bf16(self)
    }
}

/// Keys whose scores [`dots`] computes together.
const DOT_KEYS: usize = 4;

/// Heads whose scores [`dots`] computes together.
const DOT_HEADS: usize = 2;

/// `[head][key]` dot products of [`dots`].
type HeadKeyDots = [[f32; DOT_KEYS]; DOT_HEADS];

/// `dot(a[j], b[k])` for two heads' queries and four keys, each in [`dot`]'s order (the same
/// bits), computed side by side: each key's vector is loaded once for both heads and the
/// eight accumulator chains overlap (four chains of dependent adds left the adder waiting).
#[inline(always)]
fn dots<E: KeyElement>(isa: Isa, a: [&[f32]; DOT_HEADS], b: [&[E]; DOT_KEYS]) -> HeadKeyDots {
    let full = a[0].len() / 16 * 16;
    let (xs, _) = a[0][..full].as_chunks::<16>();
    let (zs, _) = a[1][..full].as_chunks::<16>();
    let [y0, y1, y2, y3] = b.map(|b| b[..full].as_chunks::<16>().0);
    // Written out per head and key: as loops over them the compiler kept the accumulators
    // in memory and did not vectorize.
    let (mut z0, mut z1, mut z2, mut z3) = ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
    let (mut a0, mut a1, mut a2, mut a3) = ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
    for (((((x, z), y0), y1), y2), y3) in xs.iter().zip(zs).zip(y0).zip(y1).zip(y2).zip(y3) {
        for i in 0..16 {
            a0[i] += x[i] * y0[i].widen();
            a1[i] += x[i] * y1[i].widen();
            a2[i] += x[i] * y2[i].widen();
            a3[i] += x[i] * y3[i].widen();
            z0[i] += z[i] * y0[i].widen();
            z1[i] += z[i] * y1[i].widen();
            z2[i] += z[i] * y2[i].widen();
            z3[i] += z[i] * y3[i].widen();
        }
    }
    let sums = lane_sums(isa, &[a0, a1, a2, a3, z0, z1, z2, z3]);
    std::array::from_fn(|j| {
        std::array::from_fn(|k| {
            let tail: f32 = a[j][full..]
                .iter()
                .zip(&b[k][full..])
                .map(|(x, y)| x * y.widen())
                .sum();
            sums[j * DOT_KEYS + k] + tail
        })
    })
}

/// Each accumulator's 16 lanes summed in `dot`'s order (`Sum for f32` folds from −0.0, lane 0
/// first), the eight sums side by side: one after another was 16 dependent adds per key, a
/// sixth of a decode's attention time. Where the vectors allow it, as eight-lane adds of the
/// transposed lanes (the same adds in the same order): gathering each lane into scalars took
/// two fifths of the dots' time.
#[inline(always)]
fn lane_sums(isa: Isa, acc: &[[f32; 16]; 8]) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar {
        // SAFETY: every vector ISA includes AVX2 and FMA (AVX-512F implies them; the caller
        // checked the CPU supports `isa`).
        return unsafe { lane_sums_avx(acc) };
    }
    let _ = isa;
    let mut sums = [-0.0f32; 8];
    for i in 0..16 {
        for (s, a) in sums.iter_mut().zip(acc) {
            *s += a[i];
        }
    }
    sums
}

/// [`lane_sums`] by an 8 × 8 transpose of each half of the lanes
/// ([`transpose8`](crate::moe_gemm::cpu_int::transpose8)): `s += column i` for `i = 0..16`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
fn lane_sums_avx(acc: &[[f32; 16]; 8]) -> [f32; 8] {
    use std::arch::x86_64::*;
    let mut s = _mm256_set1_ps(-0.0);
    for half in 0..2 {
        // SAFETY: each accumulator holds 16 floats; this reads 8 of them from 8 · half.
        let r: [__m256; 8] =
            std::array::from_fn(|j| unsafe { _mm256_loadu_ps(acc[j].as_ptr().add(8 * half)) });
        for column in crate::moe_gemm::cpu_int::transpose8(r) {
            s = _mm256_add_ps(s, column);
        }
    }
    let mut out = [0.0f32; 8];
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// `acc = acc · alpha + Σ_i probs[i] · latent[i]`, the keys in order for every element (the
/// bits of scaling once and then one `axpy` per key), a [`ACC_CHUNK`] slice of `acc` at a time
/// held in registers across the tile's keys instead of loaded and stored once per key.
#[inline(always)]
fn accumulate_tile(acc: &mut [f32], alpha: f32, probs: &[f32], latent: &[f32]) {
    let l = acc.len();
    let full = l / ACC_CHUNK * ACC_CHUNK;
    for e0 in (0..full).step_by(ACC_CHUNK) {
        let mut a: [f32; ACC_CHUNK] = acc[e0..e0 + ACC_CHUNK].try_into().expect("a chunk");
        if alpha != 1.0 {
            a.iter_mut().for_each(|v| *v *= alpha);
        }
        for (i, &p) in probs.iter().enumerate() {
            let lat = &latent[i * l + e0..i * l + e0 + ACC_CHUNK];
            for (v, &x) in a.iter_mut().zip(lat) {
                *v += p * x;
            }
        }
        acc[e0..e0 + ACC_CHUNK].copy_from_slice(&a);
    }
    if full < l {
        let rest = &mut acc[full..];
        if alpha != 1.0 {
            rest.iter_mut().for_each(|v| *v *= alpha);
        }
        for (i, &p) in probs.iter().enumerate() {
            axpy(p, &latent[i * l + full..(i + 1) * l], rest);
        }
    }
}

/// Elements of the attention accumulator kept in registers over a tile (four `zmm`).
const ACC_CHUNK: usize = 64;

#[inline(always)]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (d, s) in y.iter_mut().zip(x) {
        *d += alpha * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows of a prefill (every position of a sequence, attended in blocks that share
    /// each cache tile) give the bits of each row attended alone.
    #[test]
    fn blocks_of_prefill_rows_give_each_rows_bits() {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 64,
            rope_dim: 16,
        };
        let (heads, l, r) = (3, 64, 16);
        for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let (cache, seqs) = filled_cache(shape, dtype, 0, &[45, 23]);
            // Every position of the first sequence, then the second one's last five.
            let queries: Vec<AttentionQuery> = (1..=45)
                .map(|context| AttentionQuery {
                    seq: seqs[0].seq,
                    context,
                })
                .chain((19..=23).map(|context| AttentionQuery {
                    seq: seqs[1].seq,
                    context,
                }))
                .collect();
            let rows = queries.len();
            let (q_abs, q_pe) = hashed_queries(rows, heads, l, r);
            // Chunks longer than any context: cut the same way for one row or all of them.
            let tactic = CpuTactic {
                mla_min_chunk: 1024,
                threads: 2,
                ..CpuTactic::DEFAULT
            };
            let pool = tactic.build_pool().unwrap();
            let attend = |queries: &[AttentionQuery], q_abs: &[f32], q_pe: &[f32]| {
                let problem = MlaProblem {
                    layer: 0,
                    heads,
                    queries,
                    q_abs,
                    q_pe,
                    softmax_scale: 0.2,
                };
                let n = queries.len();
                let (mut o, mut lse) = (vec![0.0; n * heads * l], vec![0.0; n * heads]);
                pool.install(|| mla_attention_tuned(&tactic, &cache, &problem, &mut o, &mut lse))
                    .unwrap();
                (o, lse)
            };
            let (all_o, all_lse) = attend(&queries, &q_abs, &q_pe);
            for (row, query) in queries.iter().enumerate() {
                let (o, lse) = attend(
                    std::slice::from_ref(query),
                    &q_abs[row * heads * l..(row + 1) * heads * l],
                    &q_pe[row * heads * r..(row + 1) * heads * r],
                );
                let together = all_o[row * heads * l..(row + 1) * heads * l]
                    .iter()
                    .chain(&all_lse[row * heads..(row + 1) * heads]);
                for (a, b) in together.zip(o.iter().chain(&lse)) {
                    assert_eq!(a.to_bits(), b.to_bits(), "{dtype:?} row {row}");
                }
            }
        }
    }

    /// A decode row whose context is shorter than one chunk is cut into head groups when more
    /// tasks are wanted; every head's result is the bits of the ungrouped run.
    #[test]
    fn head_groups_give_the_ungrouped_bits() {
        // Latent widths with a part-vector tail in the scores (72) and in the accumulation (80);
        // head counts that give the AVX-512 group kernels eight heads, four, four and a pair,
        // eight and four.
        for latent_dim in [64, 72, 80] {
            let shape = LatentCacheShape {
                layers: 1,
                latent_dim,
                rope_dim: 16,
            };
            for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
                for heads in [1, 3, 4, 6, 8, 12, 16] {
                    let lens = [37usize, 200];
                    let (cache, queries) = filled_cache(shape, dtype, 0, &lens);
                    let rows = lens.len();
                    let (q_abs, q_pe) = hashed_queries(rows, heads, latent_dim, 16);
                    let problem = MlaProblem {
                        layer: 0,
                        heads,
                        queries: &queries,
                        q_abs: &q_abs,
                        q_pe: &q_pe,
                        softmax_scale: 0.2,
                    };
                    let run = |tasks_per_thread: usize| {
                        let tactic = CpuTactic {
                            mla_tasks_per_thread: tasks_per_thread,
                            threads: 2,
                            ..CpuTactic::DEFAULT
                        };
                        let (mut o, mut lse) = (
                            vec![0.0; rows * heads * latent_dim],
                            vec![0.0; rows * heads],
                        );
                        tactic
                            .build_pool()
                            .unwrap()
                            .install(|| {
                                mla_attention_tuned(&tactic, &cache, &problem, &mut o, &mut lse)
                            })
                            .unwrap();
                        (o, lse)
                    };
                    // One task per thread and two rows: no groups. Sixteen: groups of two heads.
                    let (whole, grouped) = (run(1), run(16));
                    for (a, b) in whole
                        .0
                        .iter()
                        .zip(&grouped.0)
                        .chain(whole.1.iter().zip(&grouped.1))
                    {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{dtype:?}, latent {latent_dim}, {heads} heads"
                        );
                    }
                }
            }
        }
    }

    /// The softmax's exponential is within 1 ulp of `e^x` over its whole range (every 97th
    /// float from −87.3 to 0, and the ends), 0 below it and at −∞, NaN for NaN; every ISA
    /// gives the same bits.
    #[test]
    fn softmax_exponential_is_within_one_ulp() {
        let ulp_error = |x: f32| {
            let exact = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            let ulp = f64::from(f32::from_bits((exact as f32).to_bits() + 1)) - exact as f32 as f64;
            (got - exact).abs() / ulp
        };
        let (mut x, mut worst) = (-87.336_55f32, 0.0f64);
        while x < 0.0 {
            worst = worst.max(ulp_error(x));
            x = f32::from_bits(x.to_bits() - 97);
        }
        worst = worst.max(ulp_error(0.0)).max(ulp_error(-0.0));
        assert!(worst <= 1.0, "worst error {worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-88.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());

        let scores: Vec<f32> = (0..TILE).map(|i| -(i as f32) * 3.7 + 0.25).collect();
        let run = |isa| {
            let mut probs = [0.0f32; TILE];
            exps_below_with(isa, 0.25, &scores, &mut probs);
            probs.map(f32::to_bits)
        };
        let scalar = run(Isa::Scalar);
        for isa in [Isa::Avx2Fma, Isa::Avx512] {
            if isa.is_supported() {
                assert_eq!(run(isa), scalar, "{isa:?}");
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// Two heads' dot products with four keys side by side give each one's bits, on
        /// every ISA.
        #[test]
        fn dots_side_by_side_equal_each_dot(len in 0usize..700, seed in 0u64..1000) {
            let a: Vec<Vec<f32>> = (0..DOT_HEADS as u64)
                .map(|j| (0..len as u64).map(|i| hash(seed * 7919 + j * 999_983 + i)).collect())
                .collect();
            let b: Vec<Vec<f32>> = (0..DOT_KEYS as u64)
                .map(|k| (0..len as u64).map(|i| hash(seed * 104_729 + k * 1_000_003 + i)).collect())
                .collect();
            for isa in Isa::all_supported() {
                let got = dots_with(
                    isa,
                    std::array::from_fn(|j| a[j].as_slice()),
                    std::array::from_fn(|k| b[k].as_slice()),
                );
                for j in 0..DOT_HEADS {
                    for k in 0..DOT_KEYS {
                        proptest::prop_assert_eq!(got[j][k].to_bits(), dot(&a[j], &b[k]).to_bits(), "{:?}", isa);
                    }
                }
            }
        }
    }
    use crate::mla::cache::{KvCacheDtype, LatentCacheShape, SeqId};
    use crate::mla::reference::{AttentionQuery, mla_attention_reference};

    fn hash(i: u64) -> f32 {
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 32;
        (x % 2001) as f32 / 1000.0 - 1.0
    }

    /// A cache of `shape` whose `layer` holds one sequence per length of `lens` (hashed
    /// values), and the queries that attend to all of each.
    fn filled_cache(
        shape: LatentCacheShape,
        dtype: KvCacheDtype,
        layer: usize,
        lens: &[usize],
    ) -> (PagedLatentCache, Vec<AttentionQuery>) {
        filled_cache_of(shape, dtype, layer, lens, |v| v)
    }

    /// [`filled_cache`] of the hashed values passed through `value`.
    fn filled_cache_of(
        shape: LatentCacheShape,
        dtype: KvCacheDtype,
        layer: usize,
        lens: &[usize],
        value: fn(f32) -> f32,
    ) -> (PagedLatentCache, Vec<AttentionQuery>) {
        let (l, r) = (shape.latent_dim, shape.rope_dim);
        let mut cache = PagedLatentCache::new(shape, dtype, 64);
        let mut queries = Vec::new();
        for (i, &len) in lens.iter().enumerate() {
            let seq = cache.add_sequence();
            cache.reserve(seq, len).unwrap();
            for t in 0..len {
                let c: Vec<f32> = (0..l as u64)
                    .map(|j| value(hash((i * 7919 + t) as u64 * 97 + j)))
                    .collect();
                let k: Vec<f32> = (0..r as u64)
                    .map(|j| value(hash((i * 31 + t) as u64 * 89 + j + 5)))
                    .collect();
                cache.write(layer, seq, t, &c, &k).unwrap();
            }
            cache.commit(seq, len).unwrap();
            queries.push(AttentionQuery { seq, context: len });
        }
        (cache, queries)
    }

    /// Hashed `q_abs` and `q_pe` of `rows × heads` queries.
    fn hashed_queries(rows: usize, heads: usize, l: usize, r: usize) -> (Vec<f32>, Vec<f32>) {
        let q_abs = (0..rows * heads * l)
            .map(|i| 2.0 * hash(i as u64 + 11))
            .collect();
        let q_pe = (0..rows * heads * r).map(|i| hash(i as u64 + 13)).collect();
        (q_abs, q_pe)
    }

    /// The fast path's output and log-sum-exp against the reference's, within 1e-5 relative,
    /// for `queries` of `heads` heads over `layer` of `cache` (latent 64, RoPE 16).
    fn assert_matches_reference(
        what: &str,
        cache: &PagedLatentCache,
        layer: usize,
        queries: &[AttentionQuery],
        heads: usize,
    ) {
        let rows = queries.len();
        let (q_abs, q_pe) = hashed_queries(rows, heads, 64, 16);
        let problem = MlaProblem {
            layer,
            heads,
            queries,
            q_abs: &q_abs,
            q_pe: &q_pe,
            softmax_scale: 0.2,
        };
        let (mut o_ref, mut lse_ref) = (vec![0.0; rows * heads * 64], vec![0.0; rows * heads]);
        let (mut o, mut lse) = (vec![1.0; rows * heads * 64], vec![1.0; rows * heads]);
        mla_attention_reference(cache, &problem, &mut o_ref, &mut lse_ref).unwrap();
        mla_attention(cache, &problem, &mut o, &mut lse).unwrap();
        for (i, (a, b)) in o.iter().zip(&o_ref).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{what} row {}: {a} vs {b}",
                i / (heads * 64)
            );
        }
        for (a, b) in lse.iter().zip(&lse_ref) {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{what} lse: {a} vs {b}"
            );
        }
    }

    /// Every position of a sequence attended in one call (rows in blocks that share each
    /// cache tile) gives the reference's values.
    #[test]
    fn prefill_rows_match_the_reference() {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 64,
            rope_dim: 16,
        };
        for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let (cache, seqs) = filled_cache(shape, dtype, 0, &[45]);
            let queries: Vec<AttentionQuery> = (1..=45)
                .map(|context| AttentionQuery {
                    seq: seqs[0].seq,
                    context,
                })
                .collect();
            assert_matches_reference(&format!("{dtype:?}"), &cache, 0, &queries, 4);
        }
    }

    #[test]
    fn matches_the_reference_for_every_dtype_batch_and_length() {
        let shape = LatentCacheShape {
            layers: 2,
            latent_dim: 64,
            rope_dim: 16,
        };
        let lens = [1usize, 63, 64, 65, 700, 1500];
        for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let (cache, queries) = filled_cache(shape, dtype, 1, &lens);
            assert_matches_reference(&format!("{dtype:?}"), &cache, 1, &queries, 3);
        }
    }

    /// The bits of the outputs and log-sum-exps of `problem` under the default tactic.
    fn attended_bits(isa: Isa, cache: &PagedLatentCache, problem: &MlaProblem<'_>) -> Vec<u32> {
        let rows = problem.queries.len() * problem.heads;
        let l = cache.shape().latent_dim;
        let (mut o, mut lse) = (vec![0.0; rows * l], vec![0.0; rows]);
        mla_attention_compiled_for(isa, &CpuTactic::DEFAULT, cache, problem, &mut o, &mut lse)
            .unwrap();
        o.into_iter().chain(lse).map(f32::to_bits).collect()
    }

    /// Decode tasks of one row and at most two heads read a BF16 cache in place
    /// ([`attend_row_in_place`]); an F32 cache of the same values goes through the dequantized
    /// tile. Every head count (pairs and a last single head), context (whole tiles, partial
    /// ones, fewer keys than one group of four, several chunks), ISA and pool size gives the
    /// tile's bits.
    #[test]
    fn a_bf16_cache_read_in_place_gives_the_tile_bits() {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 80,
            rope_dim: 16,
        };
        let to_bf16 = |v: f32| half::bf16::from_f32(v).to_f32();
        for len in [1usize, 3, 32, 70, 333] {
            let (bf16, queries) = filled_cache_of(shape, KvCacheDtype::Bf16, 0, &[len], to_bf16);
            let (f32_cache, _) = filled_cache_of(shape, KvCacheDtype::F32, 0, &[len], to_bf16);
            for heads in [1, 2, 3, 8] {
                let (q_abs, q_pe) = hashed_queries(1, heads, 80, 16);
                let problem = MlaProblem {
                    layer: 0,
                    heads,
                    queries: &queries,
                    q_abs: &q_abs,
                    q_pe: &q_pe,
                    softmax_scale: 0.3,
                };
                // One thread groups the heads as the tactic plans (the tile where a task has
                // more than two); more threads take a pair of heads per task, in place.
                for (isa, threads) in Isa::all_supported()
                    .into_iter()
                    .flat_map(|isa| [1, 3].map(|threads| (isa, threads)))
                {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let run = |cache| pool.install(|| attended_bits(isa, cache, &problem));
                    assert!(
                        run(&bf16) == run(&f32_cache),
                        "{len} keys, {heads} heads, {isa:?}, {threads} threads: in place \
                         differs from the tile"
                    );
                }
            }
        }
    }

    #[test]
    fn every_isa_gives_the_same_bits() {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 48,
            rope_dim: 16,
        };
        let lens = [1usize, 70, 333];
        for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let (cache, queries) = filled_cache(shape, dtype, 0, &lens);
            let (heads, rows) = (3, lens.len());
            let (q_abs, q_pe) = hashed_queries(rows, heads, 48, 16);
            let problem = MlaProblem {
                layer: 0,
                heads,
                queries: &queries,
                q_abs: &q_abs,
                q_pe: &q_pe,
                softmax_scale: 0.3,
            };
            let run = |isa| attended_bits(isa, &cache, &problem);
            let want = run(Isa::Scalar);
            for isa in Isa::all_supported() {
                assert!(
                    run(isa) == want,
                    "{dtype:?}: {isa:?} differs from the SSE2 build"
                );
            }
        }
    }

    #[test]
    fn unknown_sequences_are_errors_not_panics() {
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: 16,
            rope_dim: 4,
        };
        let cache = PagedLatentCache::new(shape, KvCacheDtype::Bf16, 1);
        let queries = [AttentionQuery {
            seq: SeqId(7),
            context: 1,
        }];
        let problem = MlaProblem {
            layer: 0,
            heads: 1,
            queries: &queries,
            q_abs: &[0.0; 16],
            q_pe: &[0.0; 4],
            softmax_scale: 1.0,
        };
        let err = mla_attention(&cache, &problem, &mut [0.0; 16], &mut [0.0; 1]);
        assert!(matches!(err, Err(CacheError::UnknownSequence(_))));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]
        /// Any valid tactic agrees with the default within the bound the default keeps against
        /// the reference (the chunk cuts only reorder the softmax sums).
        #[test]
        fn every_tactic_agrees_with_the_default(
            chunk in 1usize..80,
            tasks in 1usize..16,
            threads in 1usize..4,
            dtype in proptest::sample::select(vec![KvCacheDtype::F32, KvCacheDtype::Fp8E4m3]),
        ) {
            let tactic = CpuTactic {
                mla_min_chunk: chunk * TILE,
                mla_tasks_per_thread: tasks,
                threads,
                ..CpuTactic::DEFAULT
            };
            let shape = LatentCacheShape { layers: 1, latent_dim: 32, rope_dim: 16 };
            let lens = [1usize, 300, 1100];
            let (cache, queries) = filled_cache(shape, dtype, 0, &lens);
            let (heads, rows) = (2, lens.len());
            let (q_abs, q_pe) = hashed_queries(rows, heads, 32, 16);
            let problem = MlaProblem {
                layer: 0,
                heads,
                queries: &queries,
                q_abs: &q_abs,
                q_pe: &q_pe,
                softmax_scale: 0.2,
            };
            let (mut o_def, mut lse_def) = (vec![0.0; rows * heads * 32], vec![0.0; rows * heads]);
            let (mut o, mut lse) = (vec![1.0; rows * heads * 32], vec![1.0; rows * heads]);
            mla_attention(&cache, &problem, &mut o_def, &mut lse_def).unwrap();
            tactic
                .build_pool()
                .unwrap()
                .install(|| mla_attention_tuned(&tactic, &cache, &problem, &mut o, &mut lse))
                .unwrap();
            for (a, b) in o.iter().zip(&o_def).chain(lse.iter().zip(&lse_def)) {
                proptest::prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{tactic}: {a} vs {b}");
            }
        }
    }
}
