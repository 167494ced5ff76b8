//! Dense products `y = x · Wᵀ` with BF16 or NVFP4 weights: the CPU path of every linear
//! layer that is not a routed expert (attention projections, shared experts, the dense MLP,
//! the router, `lm_head`).

use rayon::prelude::*;

use crate::cpu_tactic::CpuTactic;
use crate::isa::Isa;
use crate::matrix::MatrixView;
use crate::scratch::sized;

pub mod bf16_panel;
pub mod bf16_tile;

thread_local! {
    /// A pool thread's f32 panel of widened weight rows, kept between products (a prefill
    /// makes hundreds of them).
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out[t, j] = Σ_i x[t, i] · w[j, i]` for `x: [tokens, cols]`, `w: [rows, cols]`,
/// `out: [tokens, rows]`. Each weight row is read once for all tokens, since at decode the
/// weights are the traffic.
pub fn matmul_transposed(x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
    matmul_transposed_tuned(&CpuTactic::DEFAULT, x, tokens, w, out);
}

/// [`matmul_transposed`] under a tactic: BF16 products below
/// [`dense_parallel_min_bytes`](CpuTactic::dense_parallel_min_bytes) of weights run on the
/// calling thread (waking the pool costs tens of microseconds, more than reading a few hundred
/// KB takes). Larger ones over at most four tokens (decode) let the pool's threads claim their
/// rows in shrinking chunks of at least [`dense_rows_per_task`](CpuTactic::dense_rows_per_task)
/// rows ([`guided`](crate::guided)), so that the threads end together; over more tokens they
/// run in tasks of that many rows (each task's rows stay in L2 while its token tiles pass).
/// Every valid tactic gives bit-identical results.
///
/// # Panics
/// If shapes disagree or the tactic is invalid.
pub fn matmul_transposed_tuned(
    tactic: &CpuTactic,
    x: &[f32],
    tokens: usize,
    w: MatrixView<'_>,
    out: &mut [f32],
) {
    if let Err(e) = tactic.validate() {
        panic!("{e}");
    }
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(
        x.len(),
        tokens * cols,
        "matmul: x is not [{tokens}, {cols}]"
    );
    assert_eq!(
        out.len(),
        tokens * rows,
        "matmul: out is not [{tokens}, {rows}]"
    );
    if tokens == 0 || rows == 0 {
        return;
    }
    if let MatrixView::Bf16 { data, .. } = w
        && tokens >= tactic.dense_panel_min_tokens
        && bf16_panel::has_panel_kernel(Isa::detect())
    {
        panel_products(tactic, x, tokens, data, cols, out);
        return;
    }
    // Row-major in weight rows (`[rows, tokens]`) so that threads own disjoint chunks; at one
    // token that is `out` itself.
    if tokens == 1 {
        products_by_row(tactic, x, tokens, w, out);
        return;
    }
    // Kept per thread: at decode the heads of a per-head product ask for it at once on every
    // thread, and allocating it made them queue on the allocator's lock.
    let mut buffer = TRANSPOSED.take();
    let transposed = sized(&mut buffer, rows * tokens);
    products_by_row(tactic, x, tokens, w, transposed);
    // Back to `[tokens, rows]`, a block of tokens per task: each weight row's values for the
    // block are contiguous in `transposed`, and the block's output rows fill line by line
    // (element by element over all tokens, a prefill's transpose was a twentieth of it).
    const TRANSPOSE_TOKENS: usize = 16;
    let scatter = |(block, out_block): (usize, &mut [f32])| {
        let (t0, n) = (block * TRANSPOSE_TOKENS, out_block.len() / rows);
        for (j, column) in transposed.chunks_exact(tokens).enumerate() {
            for (k, &v) in column[t0..t0 + n].iter().enumerate() {
                out_block[k * rows + j] = v;
            }
        }
    };
    if tokens <= TRANSPOSE_TOKENS {
        scatter((0, out));
    } else {
        out.par_chunks_mut(TRANSPOSE_TOKENS * rows)
            .enumerate()
            .for_each(scatter);
    }
    if buffer.len() * size_of::<f32>() <= KEEP_TRANSPOSED_BYTES {
        TRANSPOSED.set(buffer);
    }
}

thread_local! {
    /// [`matmul_transposed_tuned`]'s `[rows, tokens]` products, reused across its calls.
    static TRANSPOSED: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// The largest products buffer a thread keeps for its next call (a few tokens' worth).
const KEEP_TRANSPOSED_BYTES: usize = 1 << 20;

/// `out = x · wᵀ` (`[tokens, rows]`) for many tokens (prefill): each task of
/// [`dense_rows_per_task`](CpuTactic::dense_rows_per_task) weight rows widens them once into an
/// f32 panel that every token tile then reads ([`bf16_panel`]; the bits of the register tiles),
/// and writes its rows' columns of `out` directly.
fn panel_products(
    tactic: &CpuTactic,
    x: &[f32],
    tokens: usize,
    data: &[half::bf16],
    cols: usize,
    out: &mut [f32],
) {
    let isa = Isa::detect();
    let rows = out.len() / tokens;
    let rows_per_task = tactic.dense_rows_per_task;
    let full = bf16_panel::panel_cols(cols);
    let xp = bf16_panel::reorder_activations(isa, x, tokens, cols);
    let (panel_rows, tile_tokens) = (bf16_panel::panel_rows(cols), bf16_panel::tile_tokens(isa));
    let out = SharedOut(out.as_mut_ptr());
    let task = |task: usize| {
        let first_row = task * rows_per_task;
        let task_rows = rows_per_task.min(rows - first_row);
        PANEL.with_borrow_mut(|panel| {
            panel.resize(panel.len().max(panel_rows.min(task_rows) * full), 0.0);
            for r0 in (0..task_rows).step_by(panel_rows) {
                let n = panel_rows.min(task_rows - r0);
                let row0 = first_row + r0;
                let w = &data[row0 * cols..(row0 + n) * cols];
                bf16_panel::widen_rows(isa, w, cols, &mut panel[..n * full]);
                for t0 in (0..tokens).step_by(tile_tokens) {
                    let tile_tokens = tile_tokens.min(tokens - t0);
                    for r in (0..n).step_by(bf16_panel::TILE_ROWS) {
                        let tile_rows = bf16_panel::TILE_ROWS.min(n - r);
                        let sums = bf16_panel::compute_panel_tile(
                            isa,
                            bf16_panel::PanelTile {
                                panel: &panel[r * full..(r + tile_rows) * full],
                                xp: &xp[t0 * full..(t0 + tile_tokens) * full],
                                w: &w[r * cols..(r + tile_rows) * cols],
                                x: &x[t0 * cols..(t0 + tile_tokens) * cols],
                                cols,
                                rows: tile_rows,
                                tokens: tile_tokens,
                            },
                        );
                        for (i, sums_r) in sums.iter().enumerate().take(tile_rows) {
                            for (k, &v) in sums_r.iter().enumerate().take(tile_tokens) {
                                // SAFETY: (t0 + k, row0 + r + i) lies inside `out`
                                // (`[tokens, rows]`), and this task alone writes its rows.
                                unsafe { out.write((t0 + k) * rows + row0 + r + i, v) };
                            }
                        }
                    }
                }
            }
        });
    };
    let tasks = rows.div_ceil(rows_per_task);
    // The work is the weights times the tokens that read them.
    if rows * cols * 2 * tokens < tactic.dense_parallel_min_bytes {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// `out` of a product whose tasks write disjoint columns (their weight rows) of `[tokens,
/// rows]`, which no split of the slice expresses.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);

// SAFETY: the tasks that share it write disjoint elements, and the product waits for all of
// them before `out` is used again.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    /// `i` lies inside the slice, and no other thread reads or writes element `i` meanwhile.
    unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.add(i).write(v) };
    }
}

/// `transposed[j, t] = x[t] · w[j]` (`[rows, tokens]`), the weight rows split into tasks as
/// [`matmul_transposed_tuned`] documents.
fn products_by_row(
    tactic: &CpuTactic,
    x: &[f32],
    tokens: usize,
    w: MatrixView<'_>,
    transposed: &mut [f32],
) {
    let (parallel_min_bytes, rows_per_task) =
        (tactic.dense_parallel_min_bytes, tactic.dense_rows_per_task);
    let cols = w.cols();
    match w {
        // BF16 rows are read straight from the mapping and widened in registers (a shift),
        // a tile of rows × tokens at a time: each widened weight vector serves every token of
        // the tile. Inside a task the token tiles are the outer loop, so the task's rows stay
        // in L2 while each token tile's activations stay in L1.
        MatrixView::Bf16 { data, .. } => {
            let isa = Isa::detect();
            let task = |(task, chunk): (usize, &mut [f32])| {
                register_tiles(isa, x, tokens, data, cols, task * rows_per_task, chunk);
            };
            if w.bytes() < parallel_min_bytes {
                transposed
                    .chunks_mut(rows_per_task * tokens)
                    .enumerate()
                    .for_each(task);
            } else if tokens <= bf16_tile::MAX_TILE_TOKENS {
                let block = RowBlock {
                    data,
                    cols,
                    rows: w.rows(),
                    x,
                    out: SharedOut(transposed.as_mut_ptr()),
                };
                guided_register_tiles(isa, tokens, rows_per_task, &[block]);
            } else {
                transposed
                    .par_chunks_mut(rows_per_task * tokens)
                    .enumerate()
                    .for_each(task);
            }
        }
        MatrixView::Nvfp4(_) => {
            transposed
                .par_chunks_mut(rows_per_task * tokens)
                .enumerate()
                .for_each(|(task, chunk)| {
                    let mut row_values = vec![0.0f32; cols];
                    for (i, out_row) in chunk.chunks_exact_mut(tokens).enumerate() {
                        w.row_into(task * rows_per_task + i, &mut row_values);
                        for (t, o) in out_row.iter_mut().enumerate() {
                            *o = dot(&x[t * cols..(t + 1) * cols], &row_values);
                        }
                    }
                });
        }
    }
    // Back to `[tokens, rows]`, a block of tokens per task: each weight row's values for the
    // block are contiguous in `transposed`, and the block's output rows fill line by line
    // (element by element over all tokens, a prefill's transpose was a twentieth of it).
}

/// One BF16 matrix of a product whose rows the pool's threads claim in guided chunks (or one
/// thread computes, below the parallel threshold): its rows, the activations they multiply
/// (`[tokens, cols]`) and where their products go (`[rows, tokens]`).
#[derive(Clone, Copy)]
struct RowBlock<'a> {
    data: &'a [half::bf16],
    cols: usize,
    rows: usize,
    x: &'a [f32],
    out: SharedOut,
}

impl<'a> RowBlock<'a> {
    /// The rows of `w` against one token's activations `x`, into `out`.
    ///
    /// # Panics
    /// If `w` is not BF16 or the shapes disagree (`what` names the product).
    fn one_token(w: &MatrixView<'a>, x: &'a [f32], out: &mut [f32], what: &str) -> Self {
        let MatrixView::Bf16 { rows, cols, data } = *w else {
            panic!("{what}: a guided product of BF16 matrices got another kind")
        };
        assert_eq!(x.len(), cols, "{what}: x is not [1, {cols}]");
        assert_eq!(out.len(), rows, "{what}: out is not [1, {rows}]");
        Self {
            data,
            cols,
            rows,
            x,
            out: SharedOut(out.as_mut_ptr()),
        }
    }

    /// [`register_tiles`] of `rows` of this block, into their part of its output. The caller
    /// gives each row to one call only, and the block's output outlives the calls.
    fn products(self, isa: Isa, tokens: usize, rows: std::ops::Range<usize>) {
        assert!(rows.end <= self.rows);
        // SAFETY: `rows` lie inside the block, so their `[rows, tokens]` output lies inside
        // its output; no other call writes these rows (the caller's contract above).
        let chunk = unsafe {
            std::slice::from_raw_parts_mut(self.out.0.add(rows.start * tokens), rows.len() * tokens)
        };
        register_tiles(isa, self.x, tokens, self.data, self.cols, rows.start, chunk);
    }
}

/// [`register_tiles`] over the rows of every block, one after another, claimed by the pool's
/// threads in shrinking chunks of at least `min_rows` rows ([`guided`](crate::guided)) instead
/// of tasks of a fixed size. For at most [`MAX_TILE_TOKENS`](bf16_tile::MAX_TILE_TOKENS)
/// tokens, where every ISA takes all of them in one token tile: a chunk's rows stream once,
/// however many there are, so a long chunk does not need to stay in L2. A row's sums do not
/// depend on its chunk (the same bits).
fn guided_register_tiles(isa: Isa, tokens: usize, min_rows: usize, blocks: &[RowBlock<'_>]) {
    debug_assert!(tokens <= bf16_tile::MAX_TILE_TOKENS);
    let lens: Vec<usize> = blocks.iter().map(|b| b.rows).collect();
    // Claims are disjoint: every row goes to one call.
    crate::guided::for_each_block_chunk(&lens, min_rows, |i, rows| {
        blocks[i].products(isa, tokens, rows)
    });
}

/// `chunk[r, t] = x[t] · w[first_row + r]` (`[rows, tokens]`) for BF16 rows `data` of `cols`
/// elements, by [`bf16_tile`]'s register tiles. Inside the chunk the token tiles are the outer
/// loop, so its rows stay in L2 while each token tile's activations stay in L1.
fn register_tiles(
    isa: Isa,
    x: &[f32],
    tokens: usize,
    data: &[half::bf16],
    cols: usize,
    first_row: usize,
    chunk: &mut [f32],
) {
    let task_rows = chunk.len() / tokens;
    let mut t0 = 0;
    while t0 < tokens {
        let (tile_rows, tile_tokens) = bf16_tile::tile(isa, tokens - t0);
        // Rows first_row + r.. (n of them) against this token tile.
        let tile = |r: usize, n: usize| bf16_tile::Tile {
            x: &x[t0 * cols..(t0 + tile_tokens) * cols],
            w: &data[(first_row + r) * cols..(first_row + r + n) * cols],
            cols,
            rows: n,
            tokens: tile_tokens,
        };
        if tile_rows == 1 {
            let rows = tile(0, task_rows);
            bf16_tile::compute_one_row_tiles(isa, rows, &mut chunk[t0..], tokens);
        } else {
            for r in (0..task_rows).step_by(tile_rows) {
                let n = tile_rows.min(task_rows - r);
                bf16_tile::compute_tile(isa, tile(r, n), &mut chunk[r * tokens + t0..], tokens);
            }
        }
        t0 += tile_tokens;
    }
}

/// `outs[m] = x · ws[m]ᵀ` for several weight matrices that read the same activations (the
/// query and compressed-KV projections; the router and the shared expert's gate and up),
/// bit-identical to one [`matmul_transposed_tuned`] each. At one token (decode) the rows of
/// all of them are claimed in one parallel call (guided chunks, as in
/// [`matmul_transposed_tuned`]): a product of a few hundred KB is over in microseconds, and
/// each parallel call ends waiting for the slowest thread.
///
/// # Panics
/// If shapes disagree or the tactic is invalid.
pub fn matmul_transposed_many_tuned(
    tactic: &CpuTactic,
    x: &[f32],
    tokens: usize,
    ws: &[MatrixView<'_>],
    outs: &mut [&mut [f32]],
) {
    assert_eq!(
        ws.len(),
        outs.len(),
        "matmul_many: {} weights, {} outputs",
        ws.len(),
        outs.len()
    );
    let all_bf16 = ws.iter().all(|w| matches!(w, MatrixView::Bf16 { .. }));
    if tokens != 1 || !all_bf16 {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            matmul_transposed_tuned(tactic, x, tokens, *w, out);
        }
        return;
    }
    if let Err(e) = tactic.validate() {
        panic!("{e}");
    }
    let isa = Isa::detect();
    let blocks: Vec<RowBlock<'_>> = ws
        .iter()
        .zip(outs.iter_mut())
        .map(|(w, out)| RowBlock::one_token(w, x, out, "matmul_many"))
        .collect();
    let bytes: usize = ws.iter().map(MatrixView::bytes).sum();
    if bytes < tactic.dense_parallel_min_bytes {
        for b in &blocks {
            b.products(isa, 1, 0..b.rows);
        }
    } else {
        guided_register_tiles(isa, 1, tactic.dense_rows_per_task, &blocks);
    }
}

/// `out[h] = x[h] · w[h]ᵀ` for every head `h` of `w`, with `x: [heads, tokens, cols]` and
/// `out: [heads, tokens, rows]`: the absorbed attention's per-head products (W_UK, W_UV),
/// in parallel unless all heads together are below
/// [`dense_parallel_min_bytes`](CpuTactic::dense_parallel_min_bytes). At one token the rows
/// of all heads, one head after another, are claimed in guided chunks as in
/// [`matmul_transposed_tuned`] (a head's 128 KB at Kimi's dimensions is a chunk or two); over
/// more tokens each head is a task. Bit-identical to one [`matmul_transposed_tuned`] per head.
///
/// # Panics
/// If shapes disagree, the heads' shapes differ, or the tactic is invalid.
pub fn matmul_per_head_tuned(
    tactic: &CpuTactic,
    x: &[f32],
    tokens: usize,
    w: &[MatrixView<'_>],
    out: &mut [f32],
) {
    let Some(first) = w.first() else {
        return;
    };
    let (rows, cols) = (first.rows(), first.cols());
    assert!(
        w.iter().all(|h| h.rows() == rows && h.cols() == cols),
        "matmul_per_head: heads of different shapes"
    );
    assert_eq!(
        x.len(),
        w.len() * tokens * cols,
        "matmul_per_head: x is not [heads, {tokens}, {cols}]"
    );
    assert_eq!(
        out.len(),
        w.len() * tokens * rows,
        "matmul_per_head: out is not [heads, {tokens}, {rows}]"
    );
    if tokens == 0 || rows == 0 {
        return;
    }
    let total: usize = w.iter().map(MatrixView::bytes).sum();
    let all_bf16 = w.iter().all(|h| matches!(h, MatrixView::Bf16 { .. }));
    if tokens == 1 && all_bf16 && total >= tactic.dense_parallel_min_bytes {
        let blocks: Vec<RowBlock<'_>> = w
            .iter()
            .zip(x.chunks_exact(cols).zip(out.chunks_exact_mut(rows)))
            .map(|(h, (x, out))| RowBlock::one_token(h, x, out, "matmul_per_head"))
            .collect();
        guided_register_tiles(Isa::detect(), 1, tactic.dense_rows_per_task, &blocks);
        return;
    }
    let head = |(h, (x, out)): (usize, (&[f32], &mut [f32]))| {
        matmul_transposed_tuned(tactic, x, tokens, w[h], out);
    };
    let pairs = x
        .chunks_exact(tokens * cols)
        .zip(out.chunks_exact_mut(tokens * rows));
    if total < tactic.dense_parallel_min_bytes {
        pairs.enumerate().for_each(head);
    } else {
        pairs
            .collect::<Vec<_>>()
            .into_par_iter()
            .enumerate()
            .for_each(head);
    }
}

/// Dot product with 8 independent accumulators, so the compiler can vectorize it without
/// reassociating floating-point sums itself.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for (ca, cb) in a[..chunks * 8]
        .chunks_exact(8)
        .zip(b[..chunks * 8].chunks_exact(8))
    {
        for k in 0..8 {
            acc[k] += ca[k] * cb[k];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in a[chunks * 8..].iter().zip(&b[chunks * 8..]) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::nvfp4::Nvfp4Matrix;
    use half::bf16;

    #[test]
    fn bf16_and_nvfp4_products_match_a_naive_loop() {
        let (tokens, rows, cols) = (3, 37, 80);
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0)
            .collect();
        let w_bf16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let q = Nvfp4Matrix::quantize_weight(&w, rows, cols).unwrap();
        let deq = q.dequantize();
        for (view, values) in [
            (
                MatrixView::Bf16 {
                    rows,
                    cols,
                    data: &w_bf16,
                },
                w_bf16.iter().map(|v| v.to_f32()).collect::<Vec<_>>(),
            ),
            (MatrixView::Nvfp4(q.view()), deq),
        ] {
            let mut out = vec![0.0; tokens * rows];
            matmul_transposed(&x, tokens, view, &mut out);
            for t in 0..tokens {
                for j in 0..rows {
                    let expected: f32 = (0..cols)
                        .map(|i| x[t * cols + i] * values[j * cols + i])
                        .sum();
                    assert!((out[t * rows + j] - expected).abs() < 1e-4, "t{t} j{j}");
                }
            }
        }
    }

    /// A product over many tokens (the panel path) gives, for every token, the bits of the
    /// same token's product alone (the register tiles), serial and parallel.
    #[test]
    fn many_token_products_equal_each_token_alone() {
        for (tokens, rows, cols) in [(8, 37, 80), (19, 70, 448), (9, 5, 130), (32, 130, 1024)] {
            let x: Vec<f32> = (0..tokens * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0 + 1e-3 * (i % 11) as f32)
                .collect();
            let w: Vec<bf16> = (0..rows * cols)
                .map(|i| bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 40.0))
                .collect();
            let view = MatrixView::Bf16 {
                rows,
                cols,
                data: &w,
            };
            let mut want = vec![0.0; tokens * rows];
            for (xt, out) in x.chunks_exact(cols).zip(want.chunks_exact_mut(rows)) {
                matmul_transposed(xt, 1, view, out);
            }
            for (min_bytes, rows_per_task) in [(0, 64), (1 << 30, 64), (0, 7)] {
                let tactic = CpuTactic {
                    dense_parallel_min_bytes: min_bytes,
                    dense_rows_per_task: rows_per_task,
                    ..CpuTactic::DEFAULT
                };
                let mut got = vec![f32::NAN; tokens * rows];
                matmul_transposed_tuned(&tactic, &x, tokens, view, &mut got);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{tokens}x{rows}x{cols} {tactic}"
                );
            }
        }
    }

    /// BF16 matrices of `shapes[m]` rows of `cols`, each with values of its own.
    fn test_weights(shapes: &[usize], cols: usize) -> Vec<Vec<bf16>> {
        shapes
            .iter()
            .enumerate()
            .map(|(m, &rows)| {
                (0..rows * cols)
                    .map(|i| bf16::from_f32((((i + 7 * m) * 53 % 97) as f32 - 48.0) / 40.0))
                    .collect()
            })
            .collect()
    }

    fn bf16_views<'a>(shapes: &[usize], cols: usize, w: &'a [Vec<bf16>]) -> Vec<MatrixView<'a>> {
        shapes
            .iter()
            .zip(w)
            .map(|(&rows, data)| MatrixView::Bf16 { rows, cols, data })
            .collect()
    }

    /// Several products of the same activations in one call give each product's bits, at one
    /// token (one parallel call over all their rows) and at several.
    #[test]
    fn many_products_equal_each_alone() {
        let cols = 192;
        let shapes = [37usize, 130, 5];
        let w = test_weights(&shapes, cols);
        let views = bf16_views(&shapes, cols, &w);
        for tokens in [1, 3, 9] {
            let x: Vec<f32> = (0..tokens * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            for min_bytes in [0, 1 << 30] {
                let tactic = CpuTactic {
                    dense_parallel_min_bytes: min_bytes,
                    dense_rows_per_task: 16,
                    ..CpuTactic::DEFAULT
                };
                let mut got: Vec<Vec<f32>> =
                    shapes.iter().map(|r| vec![f32::NAN; tokens * r]).collect();
                let mut outs: Vec<&mut [f32]> = got.iter_mut().map(Vec::as_mut_slice).collect();
                matmul_transposed_many_tuned(&tactic, &x, tokens, &views, &mut outs);
                for (view, got) in views.iter().zip(&got) {
                    let mut want = vec![0.0; got.len()];
                    matmul_transposed(&x, tokens, *view, &mut want);
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "tokens {tokens}, min bytes {min_bytes}"
                    );
                }
            }
        }
    }

    /// Products over at most four tokens whose rows the threads claim in guided chunks (one
    /// matrix, several, per head) give the bits of the same products on one thread, whatever
    /// the fewest rows a claim takes.
    #[test]
    fn guided_claims_give_the_serial_bits() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .expect("a pool");
        let cols = 192;
        let shapes = [301usize, 37, 130];
        let w = test_weights(&shapes, cols);
        let views = bf16_views(&shapes, cols, &w);
        let serial = CpuTactic {
            dense_parallel_min_bytes: 1 << 30,
            ..CpuTactic::DEFAULT
        };
        let same = |got: &[f32], want: &[f32]| {
            got.len() == want.len()
                && got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits())
        };
        for rows_per_task in [1, 7, 64] {
            let guided = CpuTactic {
                dense_parallel_min_bytes: 0,
                dense_rows_per_task: rows_per_task,
                ..CpuTactic::DEFAULT
            };
            for tokens in 1..=4 {
                let x: Vec<f32> = (0..tokens * cols)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0 + 1e-3 * (i % 7) as f32)
                    .collect();
                for view in &views {
                    let mut want = vec![0.0; tokens * view.rows()];
                    matmul_transposed_tuned(&serial, &x, tokens, *view, &mut want);
                    let mut got = vec![f32::NAN; want.len()];
                    pool.install(|| matmul_transposed_tuned(&guided, &x, tokens, *view, &mut got));
                    assert!(
                        same(&got, &want),
                        "{}x{} tokens {tokens} rows {rows_per_task}",
                        view.rows(),
                        view.cols()
                    );
                }
            }
            let x1: Vec<f32> = (0..cols).map(|i| (i as f32 - 96.0) / 50.0).collect();
            let mut got: Vec<Vec<f32>> = shapes.iter().map(|&r| vec![f32::NAN; r]).collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(Vec::as_mut_slice).collect();
            pool.install(|| matmul_transposed_many_tuned(&guided, &x1, 1, &views, &mut outs));
            for (view, got) in views.iter().zip(&got) {
                let mut want = vec![0.0; got.len()];
                matmul_transposed_tuned(&serial, &x1, 1, *view, &mut want);
                assert!(
                    same(got, &want),
                    "many: {} rows, rows {rows_per_task}",
                    view.rows()
                );
            }
            // Heads of one shape: the first matrix's rows cut into five heads.
            let (heads, head_rows) = (5, 60);
            let head_views: Vec<MatrixView<'_>> = w[0]
                .chunks_exact(head_rows * cols)
                .take(heads)
                .map(|data| MatrixView::Bf16 {
                    rows: head_rows,
                    cols,
                    data,
                })
                .collect();
            let xh: Vec<f32> = (0..heads * cols)
                .map(|i| ((i * 29 % 89) as f32 - 44.0) / 30.0)
                .collect();
            let mut want = vec![0.0; heads * head_rows];
            matmul_per_head_tuned(&serial, &xh, 1, &head_views, &mut want);
            let mut got = vec![f32::NAN; want.len()];
            pool.install(|| matmul_per_head_tuned(&guided, &xh, 1, &head_views, &mut got));
            assert!(same(&got, &want), "per head, rows {rows_per_task}");
        }
    }

    #[test]
    fn per_head_products_equal_one_product_per_head_serial_or_parallel() {
        let (heads, tokens, rows, cols) = (5, 3, 24, 48);
        let x: Vec<f32> = (0..heads * tokens * cols)
            .map(|i| ((i * 29 % 89) as f32 - 44.0) / 30.0)
            .collect();
        let w: Vec<bf16> = (0..heads * rows * cols)
            .map(|i| bf16::from_f32(((i * 61 % 103) as f32 - 51.0) / 50.0))
            .collect();
        let views: Vec<MatrixView<'_>> = w
            .chunks_exact(rows * cols)
            .map(|data| MatrixView::Bf16 { rows, cols, data })
            .collect();
        let mut want = vec![0.0; heads * tokens * rows];
        for (h, view) in views.iter().enumerate() {
            matmul_transposed(
                &x[h * tokens * cols..(h + 1) * tokens * cols],
                tokens,
                *view,
                &mut want[h * tokens * rows..(h + 1) * tokens * rows],
            );
        }
        for min_bytes in [0, 1 << 30] {
            let tactic = CpuTactic {
                dense_parallel_min_bytes: min_bytes,
                ..CpuTactic::DEFAULT
            };
            let mut got = vec![f32::NAN; heads * tokens * rows];
            matmul_per_head_tuned(&tactic, &x, tokens, &views, &mut got);
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "parallel threshold {min_bytes}"
            );
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(32))]
        /// The split is only who computes which row: any valid tactic is bit-identical to the
        /// default, serial or parallel, for BF16 and NVFP4 weights.
        #[test]
        fn every_tactic_is_bit_identical_to_the_default(
            min_kib in 0usize..64,
            rows_per_task in 1usize..100,
            threads in 1usize..4,
            tokens in 1usize..6,
            rows in 1usize..300,
            blocks in 1usize..12,
        ) {
            let tactic = CpuTactic {
                dense_parallel_min_bytes: min_kib << 10,
                dense_rows_per_task: rows_per_task,
                threads,
                ..CpuTactic::DEFAULT
            };
            let cols = 16 * blocks;
            let x: Vec<f32> = (0..tokens * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
            let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) / 40.0).collect();
            let w_bf16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let q = Nvfp4Matrix::quantize_weight(&w, rows, cols).unwrap();
            let pool = tactic.build_pool().unwrap();
            for view in [MatrixView::Bf16 { rows, cols, data: &w_bf16 }, MatrixView::Nvfp4(q.view())] {
                let mut want = vec![0.0; tokens * rows];
                matmul_transposed(&x, tokens, view, &mut want);
                let mut got = vec![f32::NAN; tokens * rows];
                pool.install(|| matmul_transposed_tuned(&tactic, &x, tokens, view, &mut got));
                proptest::prop_assert!(
                    got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{tactic}"
                );
            }
        }
    }
}
