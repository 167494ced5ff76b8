//! The host semantics of every PTX helper, run through the probe kernels of
//! `probes/ptx_probe.cu`, against references written here from the PTX ISA, against
//! `kernels::moe_gemm::mma_sm120` (an independent register model of the block-scaled MMA),
//! and the runtime's reports of kernels that break the programming model.

// Index loops mirror the matrix formulas being checked.
#![allow(clippy::needless_range_loop)]

use std::time::Duration;

use cuda_host::probes::{self, inputs};
use cuda_host::{
    DeviceBuffer, Function, HostDevice, HostError, KernelParams, LaunchConfig, LaunchOptions,
    Module, Schedule, launch,
};
use kernels::arch::Sm;
use kernels::formats::{e2m1_to_f32, e4m3_to_f32, ue4m3_to_f32};
use kernels::moe_gemm::mma_sm120::{self, LaneOperands, MMA_K, MMA_M, MMA_N, ScaleSelector};
use kernels::rng::Rng;

fn probe(name: &str) -> Function {
    Module::find("ptx_probe", "default")
        .unwrap()
        .function(name)
        .unwrap()
}

fn one_warp(shared: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: shared,
    }
}

/// A host device emulating SM120 with the given schedule.
fn host(schedule: Schedule) -> HostDevice {
    let dev = HostDevice::new(Sm::Sm120);
    dev.set_schedule(schedule);
    dev
}

/// Runs one probe MMA on the host layer; checks it was one warp-collective MMA.
fn run_mma(kernel: &str, lanes: &[LaneOperands; 32], schedule: Schedule) -> [[f32; 4]; 32] {
    let dev = host(schedule);
    let d = probes::mma(&dev, kernel, lanes).unwrap();
    let mma: u64 = dev.take_history().iter().map(|h| h.stats.mma).sum();
    assert_eq!(mma, 1, "{kernel}: one warp-collective MMA");
    d
}

#[test]
fn block_scaled_fp4_mma_agrees_with_the_register_model_and_the_dequantized_product() {
    let mut rng = Rng(11);
    let sel = ScaleSelector::default();
    for case in 0..40 {
        // Lanes the selectors do not read hold garbage scales: they must be ignored.
        let (tile, lanes) = inputs::nvf4_problem(&mut rng);
        let schedule = if case % 2 == 0 {
            Schedule::Forward
        } else {
            Schedule::Shuffled(case)
        };
        let host = run_mma("probe_mma_nvf4", &lanes, schedule);
        let model = mma_sm120::mma_m16n8k64_nvf4(&lanes, sel, sel).unwrap();
        for lane in 0..32 {
            for r in 0..4 {
                assert_eq!(
                    host[lane][r].to_bits(),
                    model[lane][r].to_bits(),
                    "case {case}: lane {lane} d[{r}]: host {} vs register model {}",
                    host[lane][r],
                    model[lane][r]
                );
            }
        }
        // And the plain definition D = C + (A·sA)(B·sB), summed exactly.
        let d = mma_sm120::lanes_to_d(&host);
        for i in 0..MMA_M {
            for j in 0..MMA_N {
                let dot: f64 = (0..MMA_K)
                    .map(|k| {
                        f64::from(e2m1_to_f32(tile.a[i][k]))
                            * f64::from(ue4m3_to_f32(tile.sfa[i][k / 16]))
                            * f64::from(e2m1_to_f32(tile.b_t[j][k]))
                            * f64::from(ue4m3_to_f32(tile.sfb[j][k / 16]))
                    })
                    .sum();
                let want = (dot + f64::from(tile.c[i][j])) as f32;
                assert_eq!(d[i][j].to_bits(), want.to_bits(), "case {case} ({i},{j})");
            }
        }
    }
}

#[test]
fn bf16_mma_computes_the_product_in_the_isa_fragment_layout() {
    let mut rng = Rng(5);
    for case in 0..20 {
        let (a, b, c, lanes) = inputs::bf16_problem(&mut rng);
        let d = run_mma("probe_mma_bf16", &lanes, Schedule::Shuffled(case));
        let f = |h: u16| f64::from(half::bf16::from_bits(h).to_f32());
        for (lane, regs) in d.iter().enumerate() {
            for (i, &got) in regs.iter().enumerate() {
                let (r, n) = inputs::c_pos(lane, i);
                let dot: f64 = (0..16).map(|k| f(a[r][k]) * f(b[k][n])).sum();
                let want = (dot + f64::from(c[r][n])) as f32;
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "case {case} lane {lane} d[{i}]"
                );
            }
        }
    }
}

#[test]
fn e4m3_mma_computes_the_product_in_the_isa_fragment_layout() {
    let mut rng = Rng(6);
    for case in 0..20 {
        let (a, b, c, lanes) = inputs::e4m3_problem(&mut rng);
        let d = run_mma("probe_mma_e4m3", &lanes, Schedule::Reverse);
        for (lane, regs) in d.iter().enumerate() {
            for (i, &got) in regs.iter().enumerate() {
                let (r, n) = inputs::c_pos(lane, i);
                let dot: f64 = (0..32)
                    .map(|k| f64::from(e4m3_to_f32(a[r][k])) * f64::from(e4m3_to_f32(b[k][n])))
                    .sum();
                let want = (dot + f64::from(c[r][n])) as f32;
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "case {case} lane {lane} d[{i}]"
                );
            }
        }
    }
}

#[test]
fn ldmatrix_gives_each_lane_its_row_pair_plain_and_transposed() {
    let tile = inputs::ldmatrix_tile();
    let dev = host(Schedule::Forward);
    for num in [1i32, 2, 4] {
        for trans in [0i32, 1] {
            let regs = probes::ldmatrix(&dev, &tile, num, trans).unwrap();
            for lane in 0..32usize {
                for m in 0..4usize {
                    let got = regs[4 * lane + m];
                    let want = if m < num as usize {
                        let (r, c) = (lane / 4, 2 * (lane % 4));
                        let at = |row: usize, col: usize| u32::from(tile[64 * m + 8 * row + col]);
                        if trans == 1 {
                            at(c, r) | (at(c + 1, r) << 16)
                        } else {
                            at(r, c) | (at(r, c + 1) << 16)
                        }
                    } else {
                        0
                    };
                    assert_eq!(got, want, "x{num} trans {trans}: lane {lane} reg {m}");
                }
            }
        }
    }
}

#[test]
fn cp_async_lands_only_at_the_wait_that_covers_its_group() {
    let threads = 64u32;
    let n = 2 * 16 * threads as usize;
    let src: Vec<u8> = (0..n).map(|i| (i * 7 + 1) as u8 | 1).collect();
    let zero_fill_from = 48i32;
    let view = probes::cp_async(&host(Schedule::Forward), &src, threads, zero_fill_from).unwrap();
    let half = n / 2;
    let expect = |i: usize| {
        let thread = (i % half) / 16;
        if thread < zero_fill_from as usize {
            src[i]
        } else {
            0
        }
    };
    for i in 0..half {
        assert_eq!(view.early[i], 0xFF, "byte {i} visible before any wait");
    }
    for i in 0..n {
        let first_group = i < half;
        let want_middle = if first_group { expect(i) } else { 0xFF };
        assert_eq!(view.middle[i], want_middle, "after wait_group 1, byte {i}");
        assert_eq!(view.late[i], expect(i), "after wait_group 0, byte {i}");
    }
}

#[test]
fn shuffles_and_votes_follow_the_segment_rules() {
    let input = inputs::warp_input();
    for schedule in [Schedule::Forward, Schedule::Reverse, Schedule::Shuffled(3)] {
        let got = probes::warp(&host(schedule), &input).unwrap();
        let ballot = input
            .iter()
            .enumerate()
            .fold(0u32, |m, (l, v)| m | (((v & 1) as u32) << l));
        for l in 0..32usize {
            let up = if l >= 3 { input[l - 3] } else { input[l] };
            let down = if l + 5 < 32 { input[l + 5] } else { input[l] };
            let want = [
                input[(l * 7 + 3) & 31],
                up,
                down,
                input[l ^ 9],
                input[(l & !7) + 2],
                input[l ^ 1],
                ballot as i32,
                1,
                1,
            ];
            assert_eq!(&got[9 * l..9 * l + 9], &want, "{schedule:?} lane {l}");
        }
    }
}

#[test]
fn acquire_release_flags_between_co_resident_blocks() {
    for schedule in [Schedule::Forward, Schedule::Reverse] {
        let flag = DeviceBuffer::zeroed(8).unwrap();
        let data = DeviceBuffer::zeroed(8).unwrap();
        let seen = DeviceBuffer::zeroed(8).unwrap();
        let (f, d, s) = (flag.ptr(), data.ptr(), seen.ptr());
        let timeout: u64 = 5_000_000_000;
        let mut args = KernelParams::new();
        args.arg(&f).arg(&d).arg(&s).arg(&timeout);
        let cfg = LaunchConfig {
            grid_dim: (2, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        let opts = LaunchOptions {
            co_resident: true,
            schedule,
            ..LaunchOptions::default()
        };
        // SAFETY: three live 8-byte buffers.
        unsafe { launch(&probe("probe_flags"), cfg, &args, &opts) }.unwrap();
        assert_eq!(
            seen.to_vec::<u64>()[0],
            0x1234_5678_90ab_cdef,
            "{schedule:?}"
        );
    }
}

fn launch_error(
    kernel: &str,
    cfg: LaunchConfig,
    args: &KernelParams<'_>,
    opts: &LaunchOptions,
) -> String {
    // SAFETY: the probes only touch the buffers passed (or fault, which is the point).
    match unsafe { launch(&probe(kernel), cfg, args, opts) } {
        Ok(_) => panic!("{kernel} must fail"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn misuse_is_reported_with_the_kernel_block_and_thread() {
    let out = DeviceBuffer::zeroed(4 * 128).unwrap();
    let o = out.ptr();
    let mut args = KernelParams::new();
    args.arg(&o);
    let block = |threads| LaunchConfig {
        grid_dim: (2, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let opts = LaunchOptions::default();
    let e = launch_error("probe_barrier_divergence", block(128), &args, &opts);
    assert!(
        e.contains("barrier divergence") && e.contains("probe_barrier_divergence"),
        "{e}"
    );
    let e = launch_error("probe_shuffle_divergence", block(64), &args, &opts);
    assert!(e.contains("warp divergence") && e.contains("lane 5"), "{e}");

    // 12 floats: a whole number of 16-byte granules, so x[12] is on the guard page.
    let x = DeviceBuffer::from_slice(&[1.0f32; 12]).unwrap();
    let y = DeviceBuffer::zeroed(4).unwrap();
    let (xp, yp, n) = (x.ptr(), y.ptr(), 12i32);
    let mut args = KernelParams::new();
    args.arg(&xp).arg(&yp).arg(&n);
    let e = launch_error("probe_out_of_bounds", block(32), &args, &opts);
    assert!(
        e.contains("illegal memory access") && e.contains("thread (0,0,0)"),
        "{e}"
    );

    let n = 256i32;
    let mut args = KernelParams::new();
    args.arg(&n);
    let cfg = LaunchConfig {
        shared_mem_bytes: 256,
        ..block(32)
    };
    let e = launch_error("probe_shared_overflow", cfg, &args, &opts);
    assert!(e.contains("shared memory overflow"), "{e}");

    let src = DeviceBuffer::zeroed(64).unwrap();
    let s = src.ptr();
    let mut args = KernelParams::new();
    args.arg(&s);
    let cfg = LaunchConfig {
        shared_mem_bytes: 64,
        ..block(32)
    };
    let e = launch_error("probe_misaligned_cp_async", cfg, &args, &opts);
    assert!(e.contains("not 16-byte aligned"), "{e}");

    let flag = DeviceBuffer::zeroed(4).unwrap();
    let f = flag.ptr();
    let mut args = KernelParams::new();
    args.arg(&f);
    let quick = LaunchOptions {
        timeout: Some(Duration::from_millis(200)),
        ..LaunchOptions::default()
    };
    let e = launch_error("probe_spin_forever", block(32), &args, &quick);
    assert!(e.contains("time limit"), "{e}");
}

#[test]
fn arguments_and_configurations_are_checked_before_running() {
    let x = 0u64;
    let mut args = KernelParams::new();
    args.arg(&x).arg(&x); // probe_warp takes two pointers: right count…
    let one = 1i32;
    let mut wrong = KernelParams::new();
    wrong.arg(&x).arg(&one); // …this one passes an int where a pointer goes
    // SAFETY: rejected before anything runs.
    let e = unsafe {
        launch(
            &probe("probe_warp"),
            one_warp(0),
            &wrong,
            &LaunchOptions::default(),
        )
    }
    .unwrap_err();
    assert!(matches!(e, HostError::Arguments { .. }), "{e}");
    assert!(e.to_string().contains("[8, 8]"), "{e}");

    let too_big = LaunchConfig {
        shared_mem_bytes: 101_377,
        ..one_warp(0)
    };
    let sm120 = LaunchOptions {
        max_dynamic_shared: 101_376,
        ..LaunchOptions::default()
    };
    // SAFETY: rejected before anything runs.
    let e = unsafe { launch(&probe("probe_warp"), too_big, &args, &sm120) }.unwrap_err();
    assert!(e.to_string().contains("101376"), "{e}");
    let no_threads = LaunchConfig {
        block_dim: (0, 1, 1),
        ..one_warp(0)
    };
    // SAFETY: rejected before anything runs.
    let e = unsafe {
        launch(
            &probe("probe_warp"),
            no_threads,
            &args,
            &LaunchOptions::default(),
        )
    }
    .unwrap_err();
    assert!(e.to_string().contains("invalid configuration"), "{e}");
}

#[test]
fn every_family_has_its_tactics_compiled() {
    let count = |f: &str| Module::family(f).len();
    let moe: std::collections::BTreeSet<String> = kernels::arch::Sm::ALL
        .iter()
        .flat_map(|&sm| kernels::moe_gemm::MoeGemmTactic::enumerate(sm))
        .map(|t| t.id())
        .collect();
    assert_eq!(count("moe_gemm"), moe.len());
    for id in &moe {
        let m = Module::find("moe_gemm", id).unwrap();
        m.function("moe_gate_up").unwrap();
        m.function("moe_down").unwrap();
        // The parameter is MoeArgs by value: 136 bytes.
        assert_eq!(m.function("moe_down").unwrap().param_sizes(), &[136]);
    }
    assert!(count("mla") >= 6);
    assert_eq!(
        count("allreduce"),
        kernels::allreduce::tactic::AllReduceTactic::images().len()
    );
}

/// E5M2 (3 significant bits, bias 15, max 57344) written here from its definition: the exact
/// value rounded to nearest even in f64, for comparing the host header's conversion.
fn e5m2_saturating(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = f64::from(x.abs()).min(57344.0);
    if a == 0.0 {
        return sign;
    }
    let e = a.log2().floor().max(-14.0) as i32; // the binade, subnormals share 2^-14's ulp
    let ulp = 2f64.powi(e - 2);
    let q = (a / ulp).round_ties_even() * ulp;
    let q = q.min(57344.0);
    if q < 2f64.powi(-14) {
        return sign | (q / 2f64.powi(-16)) as u8;
    }
    let e = q.log2().floor() as i32;
    let frac = ((q / 2f64.powi(e) - 1.0) * 4.0) as u8;
    sign | (((e + 15) as u8) << 2) | frac
}

#[test]
fn number_conversions_of_the_host_cuda_headers_round_like_the_references() {
    use kernels::formats::e4m3::{Overflow, f32_to_e4m3};
    let values = inputs::conversion_values(&mut Rng(99), 200_000);
    let out = probes::convert(&host(Schedule::Forward), &values).unwrap();
    for (i, &x) in values.iter().enumerate() {
        let want = half::bf16::from_f32(x);
        if x.is_nan() {
            assert_eq!(out.bf16[i], 0x7FFF, "NaN → canonical BF16 NaN");
        } else {
            assert_eq!(out.bf16[i], want.to_bits(), "bf16({x:e})");
        }
        assert_eq!(
            out.e4m3_satfinite[i],
            f32_to_e4m3(x, Overflow::Saturate),
            "e4m3 satfinite({x:e})"
        );
        assert_eq!(
            out.e4m3_nosat[i],
            f32_to_e4m3(x, Overflow::Nan),
            "e4m3 nosat({x:e})"
        );
        assert_eq!(
            out.e5m2_satfinite[i],
            e5m2_saturating(x),
            "e5m2 satfinite({x:e})"
        );
        // Squares of BF16 values are exact in f32 away from its subnormals and overflow.
        let b = want.to_f32();
        if b.is_finite() && b.abs() > 1e-18 && b.abs() < 1e18 {
            let sq = half::bf16::from_f32(b * b).to_bits();
            assert_eq!(out.bf16_square[i], sq, "bf16 {b:e} squared");
        }
    }
}
