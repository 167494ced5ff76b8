//! The probe kernels of `probes/ptx_probe.cu` — one PTX instruction each, on operands read from
//! device memory — launched on any [`Device`]. The host tests (`tests/ptx_semantics.rs`) run
//! them on the host layer against references; `ptx-probe-check` runs the same inputs on a GPU
//! and on the host layer and compares, which checks the host layer's instruction semantics
//! against the hardware.

use kernels::device::{Device, DeviceExt, DeviceMemory, KernelParams, LaunchConfig, Result};
use kernels::moe_gemm::mma_sm120::LaneOperands;

pub const FAMILY: &str = "ptx_probe";
pub const TACTIC: &str = "default";

fn one_warp(shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// `struct MmaOperands` of the probe: six device pointers.
#[repr(C)]
#[derive(Clone, Copy)]
struct MmaOperands {
    a: u64,
    b: u64,
    c: u64,
    sfa: u64,
    sfb: u64,
    d: u64,
}

/// Runs one MMA probe (`probe_mma_bf16`, `probe_mma_e4m3`, `probe_mma_nvf4`) on per-lane
/// registers; returns every lane's D.
pub fn mma<D: Device>(dev: &D, kernel: &str, lanes: &[LaneOperands; 32]) -> Result<[[f32; 4]; 32]> {
    let a: Vec<u32> = lanes.iter().flat_map(|l| l.a).collect();
    let b: Vec<u32> = lanes.iter().flat_map(|l| l.b).collect();
    let c: Vec<f32> = lanes.iter().flat_map(|l| l.c).collect();
    let sfa: Vec<u32> = lanes.iter().map(|l| l.sfa).collect();
    let sfb: Vec<u32> = lanes.iter().map(|l| l.sfb).collect();
    let bufs = [
        dev.upload(&a)?,
        dev.upload(&b)?,
        dev.upload(&c)?,
        dev.upload(&sfa)?,
        dev.upload(&sfb)?,
    ];
    let mut d = dev.alloc_zeroed(32 * 4 * 4)?;
    dev.fill(&mut d, 0xFF)?;
    let ops = MmaOperands {
        a: bufs[0].device_ptr(),
        b: bufs[1].device_ptr(),
        c: bufs[2].device_ptr(),
        sfa: bufs[3].device_ptr(),
        sfb: bufs[4].device_ptr(),
        d: d.device_ptr(),
    };
    let k = dev.load_kernel(FAMILY, TACTIC, kernel, 0)?;
    let mut params = KernelParams::new();
    params.arg(&ops);
    // SAFETY: every pointer is a live buffer of the sizes the probe reads and writes.
    unsafe { dev.launch(&k, one_warp(0), &params) }?;
    let v: Vec<f32> = dev.download(&d)?;
    let mut out = [[0f32; 4]; 32];
    for (lane, o) in out.iter_mut().enumerate() {
        o.copy_from_slice(&v[4 * lane..4 * lane + 4]);
    }
    Ok(out)
}

/// ldmatrix `.x{num}` (`trans` 0/1) over four 8×8 b16 matrices `tile` (row-major, 256
/// values): each lane's four registers (unused ones 0).
pub fn ldmatrix<D: Device>(dev: &D, tile: &[u16], num: i32, trans: i32) -> Result<Vec<u32>> {
    let t = dev.upload(tile)?;
    let out = dev.alloc_zeroed(32 * 4 * 4)?;
    let (tp, op) = (t.device_ptr(), out.device_ptr());
    // 32 staged rows × 48 bytes.
    let shared = 32 * 48;
    let k = dev.load_kernel(FAMILY, TACTIC, "probe_ldmatrix", shared)?;
    let mut params = KernelParams::new();
    params.arg(&tp).arg(&op).arg(&num).arg(&trans);
    // SAFETY: live buffers of the sizes the probe uses.
    unsafe { dev.launch(&k, one_warp(shared as u32), &params) }?;
    dev.download(&out)
}

/// What `probe_cp_async` saw: shared memory before any wait, after `wait_group 1` and after
/// `wait_group 0` (each `2 · 16 · threads` bytes; the first only the first group's half).
pub struct CpAsyncView {
    pub early: Vec<u8>,
    pub middle: Vec<u8>,
    pub late: Vec<u8>,
}

pub fn cp_async<D: Device>(
    dev: &D,
    src: &[u8],
    threads: u32,
    zero_fill_from: i32,
) -> Result<CpAsyncView> {
    let n = 2 * 16 * threads as usize;
    assert_eq!(src.len(), n, "cp_async: src must hold 32 bytes per thread");
    let s = dev.upload(src)?;
    let outs = [
        dev.alloc_zeroed(n)?,
        dev.alloc_zeroed(n)?,
        dev.alloc_zeroed(n)?,
    ];
    let p: Vec<u64> = std::iter::once(s.device_ptr())
        .chain(outs.iter().map(DeviceMemory::device_ptr))
        .collect();
    let k = dev.load_kernel(FAMILY, TACTIC, "probe_cp_async", n)?;
    let mut params = KernelParams::new();
    params
        .arg(&p[0])
        .arg(&p[1])
        .arg(&p[2])
        .arg(&p[3])
        .arg(&zero_fill_from);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: n as u32,
    };
    // SAFETY: live buffers of n bytes; the probe touches bytes [0, n).
    unsafe { dev.launch(&k, cfg, &params) }?;
    Ok(CpAsyncView {
        early: dev.download_bytes(&outs[0])?,
        middle: dev.download_bytes(&outs[1])?,
        late: dev.download_bytes(&outs[2])?,
    })
}

/// `probe_warp`: per lane, shuffles (idx, up 3, down 5, xor 9, idx within 8, xor 1 within 4),
/// ballot of bit 0, any (> 1000), all (≥ 0): 9 values per lane.
pub fn warp<D: Device>(dev: &D, input: &[i32; 32]) -> Result<Vec<i32>> {
    let i = dev.upload(input)?;
    let out = dev.alloc_zeroed(32 * 9 * 4)?;
    let (ip, op) = (i.device_ptr(), out.device_ptr());
    let k = dev.load_kernel(FAMILY, TACTIC, "probe_warp", 0)?;
    let mut params = KernelParams::new();
    params.arg(&ip).arg(&op);
    // SAFETY: live buffers of the probe's sizes.
    unsafe { dev.launch(&k, one_warp(0), &params) }?;
    dev.download(&out)
}

/// The conversions of `probe_convert` for each input value.
pub struct Conversions {
    pub bf16: Vec<u16>,
    pub e4m3_satfinite: Vec<u8>,
    pub e4m3_nosat: Vec<u8>,
    pub e5m2_satfinite: Vec<u8>,
    /// BF16(x) squared with `__hmul`.
    pub bf16_square: Vec<u16>,
}

pub fn convert<D: Device>(dev: &D, values: &[f32]) -> Result<Conversions> {
    let n = values.len();
    let input = dev.upload(values)?;
    let outs = [
        dev.alloc_zeroed(2 * n)?,
        dev.alloc_zeroed(n)?,
        dev.alloc_zeroed(n)?,
        dev.alloc_zeroed(n)?,
        dev.alloc_zeroed(2 * n)?,
    ];
    let ptrs: Vec<u64> = std::iter::once(input.device_ptr())
        .chain(outs.iter().map(DeviceMemory::device_ptr))
        .collect();
    let count = n as i32;
    let k = dev.load_kernel(FAMILY, TACTIC, "probe_convert", 0)?;
    let mut params = KernelParams::new();
    for p in &ptrs {
        params.arg(p);
    }
    params.arg(&count);
    let cfg = LaunchConfig {
        grid_dim: (8, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: every buffer holds n elements of its type.
    unsafe { dev.launch(&k, cfg, &params) }?;
    Ok(Conversions {
        bf16: dev.download(&outs[0])?,
        e4m3_satfinite: dev.download_bytes(&outs[1])?,
        e4m3_nosat: dev.download_bytes(&outs[2])?,
        e5m2_satfinite: dev.download_bytes(&outs[3])?,
        bf16_square: dev.download(&outs[4])?,
    })
}

/// Test inputs both the host tests and the GPU comparison use.
pub mod inputs {
    use kernels::moe_gemm::mma_sm120::{
        self, LaneOperands, MMA_K, MMA_M, MMA_N, MmaTile, SF_PER_K, ScaleSelector,
    };
    use kernels::rng::Rng;

    /// Element i of a lane's fragment in the PTX ISA's m16n8k16 (BF16) and m16n8k32 (E4M3)
    /// layouts: `(row, col)` of A, `(k, n)` of B, `(row, col)` of C/D.
    pub fn a_pos_16816(lane: usize, i: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        let row = if i < 2 || (4..6).contains(&i) {
            g
        } else {
            g + 8
        };
        (row, 2 * t + (i & 1) + if i >= 4 { 8 } else { 0 })
    }
    pub fn b_pos_16816(lane: usize, i: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        (2 * t + (i & 1) + if i >= 2 { 8 } else { 0 }, g)
    }
    pub fn a_pos_16832(lane: usize, i: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        let row = if i < 4 || (8..12).contains(&i) {
            g
        } else {
            g + 8
        };
        (row, 4 * t + (i & 3) + if i >= 8 { 16 } else { 0 })
    }
    pub fn b_pos_16832(lane: usize, i: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        (4 * t + (i & 3) + if i >= 4 { 16 } else { 0 }, g)
    }
    pub fn c_pos(lane: usize, i: usize) -> (usize, usize) {
        let (g, t) = (lane / 4, lane % 4);
        (if i < 2 { g } else { g + 8 }, 2 * t + (i & 1))
    }

    /// A random m16n8k16 BF16 problem: `(A [16][16], B [16][8] as BF16 bits, C, lanes)`.
    #[allow(clippy::type_complexity)]
    pub fn bf16_problem(
        rng: &mut Rng,
    ) -> (
        Vec<Vec<u16>>,
        Vec<Vec<u16>>,
        Vec<Vec<f32>>,
        [LaneOperands; 32],
    ) {
        let bf = |rng: &mut Rng| half::bf16::from_f32(rng.sym() * 8.0).to_bits();
        let a: Vec<Vec<u16>> = (0..16)
            .map(|_| (0..16).map(|_| bf(rng)).collect())
            .collect();
        let b: Vec<Vec<u16>> = (0..16).map(|_| (0..8).map(|_| bf(rng)).collect()).collect();
        let c: Vec<Vec<f32>> = (0..16)
            .map(|_| (0..8).map(|_| rng.sym()).collect())
            .collect();
        let mut lanes = [LaneOperands::default(); 32];
        for (lane, l) in lanes.iter_mut().enumerate() {
            for i in 0..8 {
                let (r, k) = a_pos_16816(lane, i);
                l.a[i / 2] |= u32::from(a[r][k]) << (16 * (i % 2));
            }
            for i in 0..4 {
                let (k, n) = b_pos_16816(lane, i);
                l.b[i / 2] |= u32::from(b[k][n]) << (16 * (i % 2));
            }
            for i in 0..4 {
                let (r, n) = c_pos(lane, i);
                l.c[i] = c[r][n];
            }
        }
        (a, b, c, lanes)
    }

    /// A random m16n8k32 E4M3 problem (no NaN codes): `(A [16][32], B [32][8] codes, C, lanes)`.
    #[allow(clippy::type_complexity)]
    pub fn e4m3_problem(
        rng: &mut Rng,
    ) -> (
        Vec<Vec<u8>>,
        Vec<Vec<u8>>,
        Vec<Vec<f32>>,
        [LaneOperands; 32],
    ) {
        let code = |rng: &mut Rng| loop {
            let c = rng.below(256) as u8;
            if c & 0x7F != 0x7F {
                break c;
            }
        };
        let a: Vec<Vec<u8>> = (0..16)
            .map(|_| (0..32).map(|_| code(rng)).collect())
            .collect();
        let b: Vec<Vec<u8>> = (0..32)
            .map(|_| (0..8).map(|_| code(rng)).collect())
            .collect();
        let c: Vec<Vec<f32>> = (0..16)
            .map(|_| (0..8).map(|_| rng.sym()).collect())
            .collect();
        let mut lanes = [LaneOperands::default(); 32];
        for (lane, l) in lanes.iter_mut().enumerate() {
            for i in 0..16 {
                let (r, k) = a_pos_16832(lane, i);
                l.a[i / 4] |= u32::from(a[r][k]) << (8 * (i % 4));
            }
            for i in 0..8 {
                let (k, n) = b_pos_16832(lane, i);
                l.b[i / 4] |= u32::from(b[k][n]) << (8 * (i % 4));
            }
            for i in 0..4 {
                let (r, n) = c_pos(lane, i);
                l.c[i] = c[r][n];
            }
        }
        (a, b, c, lanes)
    }

    /// A random block-scaled FP4 tile (finite UE4M3 scales over the whole exponent range) and
    /// its lanes for selectors `{0, 0}`; lanes the selectors do not read hold garbage scales.
    pub fn nvf4_problem(rng: &mut Rng) -> (MmaTile, [LaneOperands; 32]) {
        let mut t = MmaTile {
            a: [[0; MMA_K]; MMA_M],
            b_t: [[0; MMA_K]; MMA_N],
            sfa: [[0; SF_PER_K]; MMA_M],
            sfb: [[0; SF_PER_K]; MMA_N],
            c: [[0.0; MMA_N]; MMA_M],
        };
        for v in t.a.iter_mut().flatten().chain(t.b_t.iter_mut().flatten()) {
            *v = rng.below(16) as u8;
        }
        for s in t.sfa.iter_mut().flatten().chain(t.sfb.iter_mut().flatten()) {
            *s = rng.below(0x7F) as u8;
        }
        for c in t.c.iter_mut().flatten() {
            *c = rng.sym() * 100.0;
        }
        let sel = ScaleSelector::default();
        let lanes = mma_sm120::tile_to_lanes(&t, sel, sel, 0x7F7F_7F7F).expect("valid selectors");
        (t, lanes)
    }

    /// Four 8×8 matrices of distinct b16 values: matrix m, row r, column c → 0x1000·m + 8r + c.
    pub fn ldmatrix_tile() -> Vec<u16> {
        (0..4 * 64)
            .map(|i| (0x1000 * (i / 64) + i % 64) as u16)
            .collect()
    }

    pub fn warp_input() -> [i32; 32] {
        std::array::from_fn(|l| ((l * 37 + 11) % 100 + if l == 7 { 2000 } else { 0 }) as i32)
    }

    /// Edge cases of the narrow formats, then `random` values spread over exponents −24..20.
    pub fn conversion_values(rng: &mut Rng, random: usize) -> Vec<f32> {
        let mut values: Vec<f32> = vec![
            0.0,
            -0.0,
            448.0,
            -448.0,
            464.0,
            463.99,
            464.01,
            480.0,
            1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            2f32.powi(-9),
            2f32.powi(-10),
            3.0 * 2f32.powi(-11),
            2f32.powi(-6),
            2f32.powi(-7) * 1.9375,
            57344.0,
            61440.0,
            1.0e-45,
            1.0e-38,
        ];
        for _ in 0..random {
            let bits = (rng.next_u64() as u32 & 0x807F_FFFF) | ((rng.below(45) as u32 + 103) << 23);
            values.push(f32::from_bits(bits));
        }
        values
    }
}
