//! A lane-level CPU model of `mla_decode.cu`, for checking the kernel's index math without a
//! GPU: the same shared-memory layout (from [`MlaTactic::smem`]), the same `ldmatrix`
//! addresses, the documented PTX fragment layouts of `ldmatrix` (plain and `.trans`) and of
//! `mma.sync` m16n8k16 (BF16) / m16n8k32 (E4M3), the E4M3 → BF16 widening trick, the per-head
//! E4M3 quantization of q, the split-KV chunking and the combine.
//!
//! What it does not model: cp.async timing (each tile is loaded whole), `__expf`'s
//! approximation and the MMA's internal accumulation order. A permutation or offset mistake in
//! the kernel shows up here as a wrong answer; the GPU check (`gpu_check.md`) covers the rest.

use half::bf16;

use super::tactic::{MlaKind, MlaTactic};
use crate::formats::e4m3::{Overflow, e4m3_to_f32, f32_to_e4m3};

const PAGE: usize = 64;
const PAD: usize = 16;

/// The cache in the kernel's global layout (that of `PagedLatentCache`'s storage), for the
/// tactic's widths L (latent) and R (RoPE).
pub enum GpuCache<'a> {
    /// `kv[slot][L + R]` BF16 bits.
    Bf16 { kv: &'a [u16] },
    /// `codes[slot][L]`, `scale[slot]`, `rope[slot][R]` BF16 bits.
    Fp8 {
        codes: &'a [u8],
        scale: &'a [f32],
        rope: &'a [u16],
    },
}

/// Inputs of one launch (BF16 queries as bits).
pub struct Launch<'a> {
    pub q_abs: &'a [u16],
    pub q_pe: &'a [u16],
    pub cache: GpuCache<'a>,
    pub block_table: &'a [u32],
    pub max_pages: usize,
    pub seq_lens: &'a [usize],
    pub heads: usize,
    pub softmax_scale: f32,
    pub splits: usize,
}

type Frag4 = [[u32; 4]; 32];

struct Smem(Vec<u8>);

impl Smem {
    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.0[at], self.0[at + 1]])
    }
    fn u32(&self, at: usize) -> u32 {
        u32::from_le_bytes(self.0[at..at + 4].try_into().unwrap())
    }
    fn f32(&self, at: usize) -> f32 {
        f32::from_bits(self.u32(at))
    }
    fn put(&mut self, at: usize, bytes: &[u8]) {
        self.0[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

/// `ldmatrix.x4` (b16): lanes 8i..8i+7 give the row addresses of matrix i. Plain: lane l gets
/// row l/4, elements 2(l%4), 2(l%4)+1. `.trans`: elements (row 2(l%4), col l/4) and
/// (row 2(l%4)+1, col l/4).
fn ldsm_x4(s: &Smem, addr: impl Fn(usize) -> usize, trans: bool) -> Frag4 {
    let mut out = [[0u32; 4]; 32];
    for (lane, regs) in out.iter_mut().enumerate() {
        let (g, c) = (lane / 4, lane % 4);
        for (m, reg) in regs.iter_mut().enumerate() {
            let elem = |row: usize, col: usize| u32::from(s.u16(addr(8 * m + row) + 2 * col));
            *reg = if trans {
                elem(2 * c, g) | elem(2 * c + 1, g) << 16
            } else {
                elem(g, 2 * c) | elem(g, 2 * c + 1) << 16
            };
        }
    }
    out
}

fn bf16_bits(x: u32) -> f32 {
    bf16::from_bits(x as u16).to_f32()
}

/// `mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32`, from per-lane fragments.
fn mma_bf16(d: &mut [[f32; 4]; 32], a: &Frag4, b: &[[u32; 2]; 32]) {
    let mut am = [[0f32; 16]; 16];
    let mut bm = [[0f32; 8]; 16];
    for lane in 0..32 {
        let (g, c) = (lane / 4, lane % 4);
        for (r, (row, k)) in [
            (g, 2 * c),
            (g + 8, 2 * c),
            (g, 2 * c + 8),
            (g + 8, 2 * c + 8),
        ]
        .into_iter()
        .enumerate()
        {
            am[row][k] = bf16_bits(a[lane][r]);
            am[row][k + 1] = bf16_bits(a[lane][r] >> 16);
        }
        for (r, k) in [2 * c, 2 * c + 8].into_iter().enumerate() {
            bm[k][g] = bf16_bits(b[lane][r]);
            bm[k + 1][g] = bf16_bits(b[lane][r] >> 16);
        }
    }
    accumulate(d, &am, &bm);
}

/// `mma.sync.m16n8k32.row.col.f32.e4m3.e4m3.f32`, from per-lane fragments.
fn mma_e4m3(d: &mut [[f32; 4]; 32], a: &Frag4, b: &[[u32; 2]; 32]) {
    let mut am = [[0f32; 32]; 16];
    let mut bm = [[0f32; 8]; 32];
    for lane in 0..32 {
        let (g, c) = (lane / 4, lane % 4);
        for (r, (row, k)) in [
            (g, 4 * c),
            (g + 8, 4 * c),
            (g, 4 * c + 16),
            (g + 8, 4 * c + 16),
        ]
        .into_iter()
        .enumerate()
        {
            for i in 0..4 {
                am[row][k + i] = e4m3_to_f32((a[lane][r] >> (8 * i)) as u8);
            }
        }
        for (r, k) in [4 * c, 4 * c + 16].into_iter().enumerate() {
            for i in 0..4 {
                bm[k + i][g] = e4m3_to_f32((b[lane][r] >> (8 * i)) as u8);
            }
        }
    }
    accumulate(d, &am, &bm);
}

fn accumulate<const K: usize>(d: &mut [[f32; 4]; 32], a: &[[f32; K]; 16], b: &[[f32; 8]; K]) {
    for (lane, regs) in d.iter_mut().enumerate() {
        let (g, c) = (lane / 4, lane % 4);
        let cells = [
            (g, 2 * c),
            (g, 2 * c + 1),
            (g + 8, 2 * c),
            (g + 8, 2 * c + 1),
        ];
        for (reg, (row, col)) in regs.iter_mut().zip(cells) {
            *reg += (0..K).map(|k| a[row][k] * b[k][col]).sum::<f32>();
        }
    }
}

/// CUDA's `__byte_perm(x, 0, sel)`.
fn byte_perm(x: u32, sel: u32) -> u32 {
    let bytes = (x as u64).to_le_bytes();
    (0..4).fold(0u32, |acc, i| {
        let s = (sel >> (4 * i)) & 7;
        let v = if s < 4 { bytes[s as usize] } else { 0 };
        acc | u32::from(v) << (8 * i)
    })
}

/// The kernel's `e4m3x2_to_bf16x2`: bit placement, then a BF16 multiply by 2^120 (exact).
pub fn e4m3x2_to_bf16x2(x: u32) -> u32 {
    let bits = ((x & 0x0080_0080) << 8) | ((x & 0x007f_007f) << 4);
    let two120 = 2f32.powi(120);
    let lo = bf16::from_f32(bf16_bits(bits) * two120);
    let hi = bf16::from_f32(bf16_bits(bits >> 16) * two120);
    u32::from(lo.to_bits()) | u32::from(hi.to_bits()) << 16
}

/// Runs the modeled kernel (and the combine when `splits > 1`): `out [B][H][L]`, `lse [B][H]`.
#[allow(non_snake_case)]
pub fn run(t: &MlaTactic, launch: &Launch<'_>) -> (Vec<f32>, Vec<f32>) {
    // The kernel's constants of the same names: the tactic's latent, RoPE and row widths.
    let L = t.dims.latent;
    let (b_count, h) = (launch.seq_lens.len(), launch.heads);
    let splits = launch.splits;
    let mut part = vec![0f32; b_count * h * splits * L];
    let mut part_lse = vec![f32::NEG_INFINITY; b_count * h * splits];
    let groups = h.div_ceil(t.heads_per_block as usize);
    for b in 0..b_count {
        for group in 0..groups {
            for split in 0..splits {
                cta(t, launch, b, group, split, &mut part, &mut part_lse);
            }
        }
    }
    let mut out = vec![0f32; b_count * h * L];
    let mut lse = vec![f32::NEG_INFINITY; b_count * h];
    for bh in 0..b_count * h {
        let pl = &part_lse[bh * splits..(bh + 1) * splits];
        let m = pl.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        if m == f32::NEG_INFINITY {
            continue;
        }
        let total: f32 = pl.iter().map(|&v| (v - m).exp()).sum();
        let l = m + total.ln();
        for (s, &v) in pl.iter().enumerate() {
            let w = (v - l).exp();
            for d in 0..L {
                out[bh * L + d] += w * part[(bh * splits + s) * L + d];
            }
        }
        lse[bh] = l;
    }
    (out, lse)
}

#[allow(non_snake_case)]
fn cta(
    t: &MlaTactic,
    a: &Launch<'_>,
    b: usize,
    group: usize,
    split: usize,
    part: &mut [f32],
    part_lse: &mut [f32],
) {
    // The kernel's constants of the same names: the tactic's latent, RoPE and row widths.
    let (L, R) = (t.dims.latent, t.dims.rope);
    let D = L + R;
    let kind = t.kind;
    let fp8 = kind.is_fp8();
    let (hpb, tile, warps) = (
        t.heads_per_block as usize,
        t.tile_tokens as usize,
        t.warps as usize,
    );
    let mt_count = hpb / 16;
    let cpw = L / warps;
    let nt_count = cpw / 8;
    let lay = t.smem();
    let (q_row, qc_row, qpe_row) = (2 * D + PAD, L + PAD, 2 * R + PAD);
    let (kv_row, c_row, pe_row) = (2 * D + PAD, L + PAD, 2 * R + PAD);
    let s_row = 4 * tile + PAD;
    let p_row = 2 * tile + PAD;
    let off_stage = lay.q;
    let off_scores = off_stage + t.stages as usize * lay.stage;
    let off_probs = off_scores + lay.scores;
    let mut s = Smem(vec![0u8; lay.total]);

    let (h0, splits, hh) = (group * hpb, a.splits, a.heads);
    let len = a.seq_lens[b];
    let chunk = len.div_ceil(splits).div_ceil(tile) * tile;
    let start = split * chunk;
    let end = len.min(start + chunk);
    if start >= end {
        return; // partial stays 0 with LSE −∞
    }

    // ---- queries
    if kind != MlaKind::Fp8QkMma {
        for r in 0..hpb {
            let hq = h0 + r;
            if hq >= hh {
                continue;
            }
            let bh = b * hh + hq;
            for j in 0..L {
                s.put(r * q_row + 2 * j, &a.q_abs[bh * L + j].to_le_bytes());
            }
            for j in 0..R {
                s.put(r * q_row + 2 * (L + j), &a.q_pe[bh * R + j].to_le_bytes());
            }
        }
    } else {
        let qscale_at = hpb * qc_row + hpb * qpe_row;
        for r in 0..hpb {
            let hq = h0 + r;
            let bh = b * hh + hq.min(hh - 1);
            let v: Vec<f32> = (0..L)
                .map(|j| {
                    if hq < hh {
                        bf16_bits(u32::from(a.q_abs[bh * L + j]))
                    } else {
                        0.0
                    }
                })
                .collect();
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            for (j, x) in v.iter().enumerate() {
                s.0[r * qc_row + j] = f32_to_e4m3(x / scale, Overflow::Saturate);
            }
            for j in 0..R {
                let pe = if hq < hh { a.q_pe[bh * R + j] } else { 0 };
                s.put(hpb * qc_row + r * qpe_row + 2 * j, &pe.to_le_bytes());
            }
            s.put(qscale_at + 4 * r, &scale.to_le_bytes());
        }
    }
    let mut m_run = vec![f32::NEG_INFINITY; hpb];
    let mut l_run = vec![0f32; hpb];
    let mut o = vec![[[0f32; 4]; 32]; warps * mt_count * nt_count];
    let o_idx = |w: usize, mt: usize, n: usize| (w * mt_count + mt) * nt_count + n;

    let tiles = (end - start).div_ceil(tile);
    for it in 0..tiles {
        let st = off_stage + (it % t.stages as usize) * lay.stage;
        let t0 = start + it * tile;
        // ---- load_tile
        for tok in 0..tile {
            let pos = t0 + tok;
            let valid = pos < end;
            let slot = if valid {
                a.block_table[b * a.max_pages + pos / PAGE] as usize * PAGE + pos % PAGE
            } else {
                0
            };
            match a.cache {
                GpuCache::Bf16 { kv } => {
                    for j in 0..D {
                        let v = if valid { kv[slot * D + j] } else { 0 };
                        s.put(st + tok * kv_row + 2 * j, &v.to_le_bytes());
                    }
                }
                GpuCache::Fp8 { codes, scale, rope } => {
                    for j in 0..L {
                        s.0[st + tok * c_row + j] = if valid { codes[slot * L + j] } else { 0 };
                    }
                    for j in 0..R {
                        let v = if valid { rope[slot * R + j] } else { 0 };
                        s.put(st + tile * c_row + tok * pe_row + 2 * j, &v.to_le_bytes());
                    }
                    let sc = if valid { scale[slot] } else { 0.0 };
                    s.put(st + tile * (c_row + pe_row) + 4 * tok, &sc.to_le_bytes());
                }
            }
        }
        let kscale_at = st + tile * (c_row + pe_row);

        // ---- scores
        for w in 0..warps {
            let mut st_tile = w;
            while st_tile < mt_count * (tile / 8) {
                let (mt, nt) = (st_tile / (tile / 8), st_tile % (tile / 8));
                let acc = score_tile(&s, t, mt, nt, st, kscale_at);
                for (lane, regs) in acc.iter().enumerate() {
                    let (g, c) = (lane / 4, lane % 4);
                    for (i, v) in regs.iter().enumerate() {
                        let row = mt * 16 + g + 8 * (i >> 1);
                        let col = nt * 8 + 2 * c + (i & 1);
                        let val = if t0 + col < end {
                            v * a.softmax_scale
                        } else {
                            f32::NEG_INFINITY
                        };
                        s.put(off_scores + row * s_row + 4 * col, &val.to_le_bytes());
                    }
                }
                st_tile += warps;
            }
        }
        // ---- softmax
        let mut alpha = vec![0f32; hpb];
        for row in 0..hpb {
            let sc: Vec<f32> = (0..tile)
                .map(|j| s.f32(off_scores + row * s_row + 4 * j))
                .collect();
            let m_new = sc.iter().fold(m_run[row], |m, &v| m.max(v));
            let mut sum = 0f32;
            for (j, &v) in sc.iter().enumerate() {
                let p = bf16::from_f32((v - m_new).exp()).to_f32();
                sum += p;
                let folded = if fp8 { p * s.f32(kscale_at + 4 * j) } else { p };
                s.put(
                    off_probs + row * p_row + 2 * j,
                    &bf16::from_f32(folded).to_bits().to_le_bytes(),
                );
            }
            alpha[row] = (m_run[row] - m_new).exp();
            l_run[row] = l_run[row] * alpha[row] + sum;
            m_run[row] = m_new;
        }
        // ---- O = O·alpha + P·C
        for w in 0..warps {
            for mt in 0..mt_count {
                for n in 0..nt_count {
                    for (lane, regs) in o[o_idx(w, mt, n)].iter_mut().enumerate() {
                        let g = lane / 4;
                        regs[0] *= alpha[mt * 16 + g];
                        regs[1] *= alpha[mt * 16 + g];
                        regs[2] *= alpha[mt * 16 + g + 8];
                        regs[3] *= alpha[mt * 16 + g + 8];
                    }
                }
            }
            for kk in 0..tile / 16 {
                let pa: Vec<Frag4> = (0..mt_count)
                    .map(|mt| {
                        ldsm_x4(
                            &s,
                            |l| {
                                off_probs
                                    + (mt * 16 + (l & 7) + 8 * ((l >> 3) & 1)) * p_row
                                    + 2 * (kk * 16 + 8 * (l >> 4))
                            },
                            false,
                        )
                    })
                    .collect();
                let tok = |l: usize| kk * 16 + (l & 7) + 8 * ((l >> 3) & 1);
                let step = if fp8 { 4 } else { 2 };
                for n in (0..nt_count).step_by(step) {
                    let frags: Vec<[[u32; 2]; 32]> = if !fp8 {
                        let bt = ldsm_x4(
                            &s,
                            |l| st + tok(l) * kv_row + 2 * (w * cpw + n * 8 + 8 * (l >> 4)),
                            true,
                        );
                        vec![pick(&bt, 0, 1, |x| x), pick(&bt, 2, 3, |x| x)]
                    } else {
                        let bt = ldsm_x4(
                            &s,
                            |l| st + tok(l) * c_row + w * cpw + (n / 4) * 32 + 16 * (l >> 4),
                            true,
                        );
                        let ev = |x| e4m3x2_to_bf16x2(byte_perm(x, 0x4240));
                        let od = |x| e4m3x2_to_bf16x2(byte_perm(x, 0x4341));
                        vec![
                            pick(&bt, 0, 1, ev),
                            pick(&bt, 0, 1, od),
                            pick(&bt, 2, 3, ev),
                            pick(&bt, 2, 3, od),
                        ]
                    };
                    for (mt, pa) in pa.iter().enumerate() {
                        for (i, f) in frags.iter().enumerate() {
                            mma_bf16(&mut o[o_idx(w, mt, n + i)], pa, f);
                        }
                    }
                }
            }
        }
    }
    // ---- epilogue
    for w in 0..warps {
        for mt in 0..mt_count {
            for n in 0..nt_count {
                for (lane, regs) in o[o_idx(w, mt, n)].iter().enumerate() {
                    let (g, c) = (lane / 4, lane % 4);
                    for half in 0..2 {
                        let row = mt * 16 + g + 8 * half;
                        if h0 + row >= hh {
                            continue;
                        }
                        let bh = b * hh + h0 + row;
                        for j in 0..2 {
                            let col = out_col(fp8, cpw, w, n, 2 * c + j);
                            part[(bh * splits + split) * L + col] = regs[2 * half + j] / l_run[row];
                        }
                    }
                }
            }
        }
    }
    for row in 0..hpb {
        if h0 + row < hh {
            let bh = b * hh + h0 + row;
            part_lse[bh * splits + split] = m_run[row] + l_run[row].ln();
        }
    }
}

fn pick(bt: &Frag4, r0: usize, r1: usize, f: impl Fn(u32) -> u32) -> [[u32; 2]; 32] {
    std::array::from_fn(|l| [f(bt[l][r0]), f(bt[l][r1])])
}

fn out_col(fp8: bool, cpw: usize, warp: usize, n: usize, j: usize) -> usize {
    let base = warp * cpw;
    if !fp8 {
        return base + n * 8 + j;
    }
    let (grp, e) = (n / 4, n % 4);
    base + grp * 32 + if e >= 2 { 16 } else { 0 } + 2 * j + (e & 1)
}

#[allow(non_snake_case)]
fn score_tile(
    s: &Smem,
    t: &MlaTactic,
    mt: usize,
    nt: usize,
    st: usize,
    kscale_at: usize,
) -> [[f32; 4]; 32] {
    // The kernel's constants of the same names: the tactic's latent, RoPE and row widths.
    let (L, R) = (t.dims.latent, t.dims.rope);
    let D = L + R;
    let (kind, hpb, tile) = (t.kind, t.heads_per_block as usize, t.tile_tokens as usize);
    let (q_row, qc_row, qpe_row) = (2 * D + PAD, L + PAD, 2 * R + PAD);
    let (kv_row, c_row, pe_row) = (2 * D + PAD, L + PAD, 2 * R + PAD);
    let a_row = |l: usize| mt * 16 + (l & 7) + 8 * ((l >> 3) & 1);
    let a_col = |l: usize| 8 * (l >> 4);
    let b_row = |l: usize| nt * 8 + (l & 7);
    let b_col = |l: usize| 8 * (l >> 3);
    let mut lat = [[0f32; 4]; 32];
    let mut pe = [[0f32; 4]; 32];
    let bf = |b: &Frag4, i: usize, j: usize| -> [[u32; 2]; 32] { pick(b, i, j, |x| x) };
    // The RoPE part (kinds 1 and 2): q_pe at `q_at(row) + 2·col`, k_pe from the stage.
    let rope_part = |pe: &mut [[f32; 4]; 32], q_base: usize, q_stride: usize, q_off: usize| {
        for ks in (0..R / 16 - (R / 16) % 2).step_by(2) {
            let a0 = ldsm_x4(
                s,
                |l| q_base + a_row(l) * q_stride + 2 * (q_off + ks * 16 + a_col(l)),
                false,
            );
            let a1 = ldsm_x4(
                s,
                |l| q_base + a_row(l) * q_stride + 2 * (q_off + (ks + 1) * 16 + a_col(l)),
                false,
            );
            let b = ldsm_x4(
                s,
                |l| st + tile * c_row + b_row(l) * pe_row + 2 * (ks * 16 + b_col(l)),
                false,
            );
            mma_bf16(pe, &a0, &bf(&b, 0, 1));
            mma_bf16(pe, &a1, &bf(&b, 2, 3));
        }
        if (R / 16) % 2 != 0 {
            let ks = R / 16 - 1;
            let a = ldsm_x4(
                s,
                |l| q_base + a_row(l) * q_stride + 2 * (q_off + ks * 16 + a_col(l)),
                false,
            );
            let b = ldsm_x4(
                s,
                |l| st + tile * c_row + b_row(l) * pe_row + 2 * (ks * 16 + (b_col(l) & 8)),
                false,
            );
            mma_bf16(pe, &a, &bf(&b, 0, 1));
        }
    };
    match kind {
        MlaKind::Bf16 => {
            for ks in (0..D / 16 - (D / 16) % 2).step_by(2) {
                let a0 = ldsm_x4(s, |l| a_row(l) * q_row + 2 * (ks * 16 + a_col(l)), false);
                let a1 = ldsm_x4(
                    s,
                    |l| a_row(l) * q_row + 2 * ((ks + 1) * 16 + a_col(l)),
                    false,
                );
                let b = ldsm_x4(
                    s,
                    |l| st + b_row(l) * kv_row + 2 * (ks * 16 + b_col(l)),
                    false,
                );
                mma_bf16(&mut lat, &a0, &bf(&b, 0, 1));
                mma_bf16(&mut lat, &a1, &bf(&b, 2, 3));
            }
            if (D / 16) % 2 != 0 {
                // The odd last k16 step alone (`score_k16_tail`): an x2 load of the cache rows.
                let ks = D / 16 - 1;
                let a = ldsm_x4(s, |l| a_row(l) * q_row + 2 * (ks * 16 + a_col(l)), false);
                let b = ldsm_x4(
                    s,
                    |l| st + b_row(l) * kv_row + 2 * (ks * 16 + (b_col(l) & 8)),
                    false,
                );
                mma_bf16(&mut lat, &a, &bf(&b, 0, 1));
            }
        }
        MlaKind::Fp8 => {
            for kb in (0..L).step_by(64) {
                let b = ldsm_x4(s, |l| st + b_row(l) * c_row + kb + 16 * (l >> 3), false);
                for j in 0..4 {
                    let a: Frag4 = std::array::from_fn(|l| {
                        let (g, c) = (l / 4, l % 4);
                        let k = kb + 16 * j + 4 * c;
                        let lo = (mt * 16 + g) * q_row + 2 * k;
                        let hi = (mt * 16 + g + 8) * q_row + 2 * k;
                        [s.u32(lo), s.u32(hi), s.u32(lo + 4), s.u32(hi + 4)]
                    });
                    let bj = pick(&b, j, j, |x| x);
                    let frag: [[u32; 2]; 32] = std::array::from_fn(|l| {
                        [
                            e4m3x2_to_bf16x2(byte_perm(bj[l][0], 0x4140)),
                            e4m3x2_to_bf16x2(byte_perm(bj[l][0], 0x4342)),
                        ]
                    });
                    mma_bf16(&mut lat, &a, &frag);
                }
            }
            rope_part(&mut pe, 0, q_row, L);
        }
        MlaKind::Fp8QkMma => {
            for kb in (0..L).step_by(64) {
                let b = ldsm_x4(s, |l| st + b_row(l) * c_row + kb + 16 * (l >> 3), false);
                for j in 0..2 {
                    let a: Frag4 = std::array::from_fn(|l| {
                        let (g, c) = (l / 4, l % 4);
                        let k = kb + 32 * j + 4 * c;
                        let r0 = (mt * 16 + g) * qc_row;
                        let r1 = (mt * 16 + g + 8) * qc_row;
                        [
                            s.u32(r0 + k),
                            s.u32(r1 + k),
                            s.u32(r0 + k + 16),
                            s.u32(r1 + k + 16),
                        ]
                    });
                    mma_e4m3(&mut lat, &a, &bf(&b, 2 * j, 2 * j + 1));
                }
            }
            let qscale_at = hpb * qc_row + hpb * qpe_row;
            for (lane, regs) in lat.iter_mut().enumerate() {
                let g = lane / 4;
                let (s0, s1) = (
                    s.f32(qscale_at + 4 * (mt * 16 + g)),
                    s.f32(qscale_at + 4 * (mt * 16 + g + 8)),
                );
                regs[0] *= s0;
                regs[1] *= s0;
                regs[2] *= s1;
                regs[3] *= s1;
            }
            rope_part(&mut pe, hpb * qc_row, qpe_row, 0);
        }
    }
    if kind.is_fp8() {
        for (lane, regs) in lat.iter_mut().enumerate() {
            let c = lane % 4;
            let (k0, k1) = (
                s.f32(kscale_at + 4 * (nt * 8 + 2 * c)),
                s.f32(kscale_at + 4 * (nt * 8 + 2 * c + 1)),
            );
            regs[0] *= k0;
            regs[1] *= k1;
            regs[2] *= k0;
            regs[3] *= k1;
        }
    }
    std::array::from_fn(|l| std::array::from_fn(|i| lat[l][i] + pe[l][i]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::Sm;
    use crate::mla::cache::{KvCacheDtype, LatentCacheShape, PagedLatentCache, fp8_token_scale};
    use crate::mla::reference::{AttentionQuery, MlaProblem, mla_attention_reference};
    use crate::mla::tactic::MlaDims;

    #[test]
    fn e4m3_to_bf16_widening_is_exact_for_every_code() {
        for code in 0u32..256 {
            if code & 0x7f == 0x7f {
                continue; // NaN: never stored (the encoder saturates)
            }
            for other in [0u32, 0x38, 0xb9] {
                let pair = e4m3x2_to_bf16x2(code | other << 16);
                assert_eq!(bf16_bits(pair), e4m3_to_f32(code as u8), "code {code:#x}");
                assert_eq!(bf16_bits(pair >> 16), e4m3_to_f32(other as u8));
            }
        }
    }

    fn hash(i: u64) -> f32 {
        let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^= x >> 32;
        (x % 2001) as f32 / 500.0 - 2.0
    }

    /// Every gated tactic, modeled lane by lane, against the reference over the same cache.
    #[test]
    fn modeled_kernel_matches_the_reference_for_every_tactic() {
        let mut tactics: Vec<MlaTactic> =
            Sm::ALL.into_iter().flat_map(MlaTactic::enumerate).collect();
        tactics.sort();
        tactics.dedup();
        for dims in MlaDims::BUILT {
            let of_dims: Vec<MlaTactic> =
                tactics.iter().copied().filter(|t| t.dims == dims).collect();
            assert!(!of_dims.is_empty(), "no tactic for {dims}");
            // Not a multiple of 16: padded head rows are exercised; fewer heads than one block
            // for the small widths (their models have 2–8 per rank).
            let heads = if dims == MlaDims::KIMI { 20 } else { 6 };
            model_against_reference(dims, heads, &of_dims);
        }
    }

    #[allow(non_snake_case)]
    fn model_against_reference(dims: MlaDims, heads: usize, tactics: &[MlaTactic]) {
        let (L, R) = (dims.latent, dims.rope);
        let D = L + R;
        let lens = [1usize, 40, 130];
        let shape = LatentCacheShape {
            layers: 1,
            latent_dim: L,
            rope_dim: R,
        };
        for dtype in [KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let pages: usize = lens.iter().map(|n| n.div_ceil(PAGE)).sum();
            let slots = (pages + 1) * PAGE;
            let mut cache = PagedLatentCache::new(shape, dtype, pages + 1);
            // The kernel's global arrays, filled with exactly what the cache stores.
            let mut kv = vec![0u16; slots * D];
            let mut codes = vec![0u8; slots * L];
            let mut scales = vec![0f32; slots];
            let mut rope_g = vec![0u16; slots * R];
            let _pad = cache.add_sequence();
            cache.reserve(_pad, 1).unwrap(); // page 0 belongs to someone else
            let mut queries = Vec::new();
            let max_pages = 3;
            let mut table = vec![0u32; lens.len() * max_pages];
            for (i, &n) in lens.iter().enumerate() {
                let seq = cache.add_sequence();
                cache.reserve(seq, n).unwrap();
                for t in 0..n {
                    let lat: Vec<f32> = (0..L)
                        .map(|j| {
                            hash((i * 1000 + t) as u64 * 4096 + j as u64) * (1.0 + (t % 3) as f32)
                        })
                        .collect();
                    let rp: Vec<f32> = (0..R)
                        .map(|j| hash((i * 1000 + t) as u64 * 4096 + 600 + j as u64))
                        .collect();
                    cache.write(0, seq, t, &lat, &rp).unwrap();
                    let slot = cache.slots(seq, t + 1).unwrap()[t];
                    for j in 0..L {
                        kv[slot * D + j] = bf16::from_f32(lat[j]).to_bits();
                    }
                    for j in 0..R {
                        kv[slot * D + L + j] = bf16::from_f32(rp[j]).to_bits();
                        rope_g[slot * R + j] = bf16::from_f32(rp[j]).to_bits();
                    }
                    let sc = fp8_token_scale(&lat);
                    scales[slot] = sc;
                    for j in 0..L {
                        codes[slot * L + j] = f32_to_e4m3(lat[j] / sc, Overflow::Saturate);
                    }
                }
                cache.commit(seq, n).unwrap();
                for (p, &page) in cache.block_table(seq).unwrap().iter().enumerate() {
                    table[i * max_pages + p] = page;
                }
                queries.push(AttentionQuery { seq, context: n });
            }
            let rows = lens.len() * heads;
            let q_abs: Vec<u16> = (0..rows * L)
                .map(|i| bf16::from_f32(0.3 * hash(i as u64 + 7)).to_bits())
                .collect();
            let q_pe: Vec<u16> = (0..rows * R)
                .map(|i| bf16::from_f32(0.3 * hash(i as u64 + 99)).to_bits())
                .collect();
            let widen = |v: &[u16]| {
                v.iter()
                    .map(|&x| bf16::from_bits(x).to_f32())
                    .collect::<Vec<f32>>()
            };
            let (qa, qp) = (widen(&q_abs), widen(&q_pe));
            let problem = MlaProblem {
                layer: 0,
                heads,
                queries: &queries,
                q_abs: &qa,
                q_pe: &qp,
                softmax_scale: 0.1,
            };
            let (mut want, mut want_lse) = (vec![0.0; rows * L], vec![0.0; rows]);
            mla_attention_reference(&cache, &problem, &mut want, &mut want_lse).unwrap();
            // fp8qk multiplies an E4M3 copy of q_abs (per-head amax/448 scale): the reference
            // gets the same dequantized q, so only the kernel's own roundings remain.
            let qa8: Vec<f32> = qa
                .chunks(L)
                .flat_map(|head| {
                    let amax = head.iter().fold(0f32, |m, x| m.max(x.abs()));
                    let sc = if amax > 0.0 { amax / 448.0 } else { 1.0 };
                    head.iter()
                        .map(move |x| e4m3_to_f32(f32_to_e4m3(x / sc, Overflow::Saturate)) * sc)
                })
                .collect();
            let problem8 = MlaProblem {
                q_abs: &qa8,
                ..problem
            };
            let (mut want8, mut want8_lse) = (vec![0.0; rows * L], vec![0.0; rows]);
            mla_attention_reference(&cache, &problem8, &mut want8, &mut want8_lse).unwrap();

            for t in tactics
                .iter()
                .filter(|t| t.kind.is_fp8() == (dtype == KvCacheDtype::Fp8E4m3))
            {
                for splits in [1, 3] {
                    let launch = Launch {
                        q_abs: &q_abs,
                        q_pe: &q_pe,
                        cache: if t.kind.is_fp8() {
                            GpuCache::Fp8 {
                                codes: &codes,
                                scale: &scales,
                                rope: &rope_g,
                            }
                        } else {
                            GpuCache::Bf16 { kv: &kv }
                        },
                        block_table: &table,
                        max_pages,
                        seq_lens: &lens,
                        heads,
                        softmax_scale: 0.1,
                        splits,
                    };
                    let (out, lse) = run(t, &launch);
                    // BF16 P (and E4M3 q for fp8qk) are the kernel's only roundings.
                    let (want, want_lse) = if t.kind == MlaKind::Fp8QkMma {
                        (&want8, &want8_lse)
                    } else {
                        (&want, &want_lse)
                    };
                    let (tol, lse_tol) = (1e-2, 2e-3);
                    let (mut worst, mut worst_lse) = (0f32, 0f32);
                    for row in 0..rows {
                        let (o, w) = (&out[row * L..(row + 1) * L], &want[row * L..(row + 1) * L]);
                        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let err = o.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        worst = worst.max(err / scale);
                        worst_lse = worst_lse.max((lse[row] - want_lse[row]).abs());
                    }
                    println!("{t} splits {splits}: rel err {worst:.2e}, lse err {worst_lse:.2e}");
                    assert!(worst <= tol, "{t} splits {splits}: rel err {worst}");
                    assert!(
                        worst_lse <= lse_tol,
                        "{t} splits {splits}: lse err {worst_lse}"
                    );
                }
            }
        }
    }
}
