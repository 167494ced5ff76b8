//! GPU check of the CUDA all-reduce on one machine (feature `cuda`).
//!
//! 1. **In-process** (`world` ranks as concurrent streams on one GPU, peers addressed
//!    directly): every algorithm × dtype × residual × length, twice in a row (both buffer
//!    parities), compared bit for bit with `reference_reduce`; then timing with CUDA events:
//!    latency at 14,336 B (bf16 × 7168) per algorithm and block count, and bus bandwidth
//!    `bytes · 2(N−1)/N / time` over 16 B – 8 MiB. On one GPU the "links" are HBM, so the
//!    numbers are the kernels' own overhead (launch, flags, phases), not PCIe.
//! 2. **IPC** (`--ipc-worlds`, default 2,4): the binary starts `world` copies of itself, each
//!    a rank that opens the others' regions with `cuIpcOpenMemHandle` (which works between
//!    processes on one device) and checks every algorithm bit for bit. Separate processes
//!    time-slice one GPU, so nothing is timed there.
//!
//! NCCL is not compared: it needs one GPU per rank, and this check runs on one.
//!
//! Results: `$OUT/allreduce-gpu-check.{json,txt}` (or `--out`). Exit status: 0 all passed,
//! 1 a check failed, 2 nothing could run (no driver or device, bad arguments).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use half::bf16;
use kernels::allreduce::cost::Choice;
use kernels::allreduce::cuda::{CudaIpcCommunicator, CudaIpcConfig, is_no_device};
use kernels::allreduce::shm::unique_segment_name;
use kernels::allreduce::tactic::{AllReduceTactic, BLOCKS, ChoicePolicy};
use kernels::allreduce::testing::{rank_input, residual_input};
use kernels::allreduce::{Algorithm, AllReduceError, DType, Element, Islands, reference_reduce};
use kernels::cuda::{default_ptx_dir, median};
use kernels::timed_device::time_in_process;
use serde_json::{Value, json};

const USAGE: &str = "usage: allreduce-gpu-check [--out DIR] [--ptx-dir DIR] [--device N] [--seed N]
    [--worlds 2,4,8] [--ipc-worlds 2,4] [--iters N] [--no-timing]
GPU check of the CUDA all-reduce on one GPU: in-process ranks bit for bit and timed, then
IPC ranks. Results: DIR/allreduce-gpu-check.{json,txt} (default: $OUT, else
bench/results/gpu). Exit status: 0 all passed, 1 a check failed, 2 nothing could run.";

const CAPACITY: usize = 8 << 20;
const LENS: [usize; 9] = [1, 3, 8, 13, 100, 1000, 7168, 3 * 7168 + 5, 65_536 + 3];

struct Opts {
    out: PathBuf,
    ptx_dir: PathBuf,
    device: usize,
    seed: u64,
    worlds: Vec<usize>,
    ipc_worlds: Vec<usize>,
    iters: usize,
    timing: bool,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        out: std::env::var_os("OUT")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("bench/results/gpu")),
        ptx_dir: default_ptx_dir(),
        device: 0,
        seed: 0xa11_5ed,
        worlds: vec![2, 4, 8],
        ipc_worlds: vec![2, 4],
        iters: 200,
        timing: true,
    };
    let mut args = std::env::args().skip(1);
    let list = |s: String| -> Result<Vec<usize>, String> {
        if s.is_empty() {
            return Ok(Vec::new());
        }
        s.split(',')
            .map(|x| x.parse().map_err(|e| format!("{x}: {e}")))
            .collect()
    };
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--out" => o.out = PathBuf::from(val()?),
            "--ptx-dir" => o.ptx_dir = PathBuf::from(val()?),
            "--device" => o.device = val()?.parse().map_err(|e| format!("--device: {e}"))?,
            "--seed" => o.seed = val()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--worlds" => o.worlds = list(val()?)?,
            "--ipc-worlds" => o.ipc_worlds = list(val()?)?,
            "--iters" => o.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--no-timing" => o.timing = false,
            "--ipc-rank" => return Err("--ipc-rank must come first".into()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(o)
}

fn config(o: &Opts, islands: Islands) -> CudaIpcConfig {
    CudaIpcConfig {
        device: o.device,
        ptx_dir: o.ptx_dir.clone(),
        timeout: Duration::from_secs(20),
        capacity_bytes: CAPACITY,
        enable_push: true,
        islands: Some(islands),
        policy: ChoicePolicy::fixed(Choice::Custom(Algorithm::OneShot(
            kernels::allreduce::Transfer::Pull,
        ))),
        threads: 512,
        blocks: None,
    }
}

/// Island layouts checked per world: the default halves, plus an uneven one (a 3 + 1 split
/// makes the exchange phase cut ranges at different places in each island).
fn island_sets(world: usize) -> Vec<Islands> {
    let mut v = vec![kernels::allreduce::cpu::default_islands(world)];
    if world >= 4 {
        v.push(Islands::new(vec![(0..world - 1).collect(), vec![world - 1]]).expect("partition"));
    }
    v
}

/// One case on every rank: returns the mismatch description, if any.
fn check_case<T: Element>(
    comms: &mut [CudaIpcCommunicator],
    algorithm: Algorithm,
    len: usize,
    residual: bool,
    seed: u64,
    islands: &Islands,
) -> Result<Option<String>, AllReduceError> {
    let world = comms.len();
    let inputs: Vec<Vec<T>> = (0..world).map(|r| rank_input(seed, r, len)).collect();
    let res: Option<Vec<T>> = residual.then(|| residual_input(seed, len));
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let expected = reference_reduce(algorithm, &refs, res.as_deref(), islands);
    let outs: Vec<Result<Vec<T>, AllReduceError>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter_mut()
            .zip(&inputs)
            .map(|(comm, input)| {
                let res = res.as_deref();
                s.spawn(move || {
                    let mut data = input.clone();
                    comm.all_reduce_with(algorithm, &mut data, res)?;
                    Ok(data)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    for (rank, out) in outs.into_iter().enumerate() {
        let out = out?;
        if let Some(i) = (0..len).find(|&i| out[i] != expected[i]) {
            return Ok(Some(format!(
                "rank {rank}: element {i} is {:?}, reference {:?}",
                out[i], expected[i]
            )));
        }
    }
    Ok(None)
}

fn in_process(o: &Opts, report: &mut Vec<Value>, text: &mut String) -> Result<usize, String> {
    let mut failures = 0;
    for &world in &o.worlds {
        for islands in island_sets(world) {
            let mut comms = match CudaIpcCommunicator::in_process_group(
                world,
                config(o, islands.clone()),
            ) {
                Ok(c) => c,
                Err(e) if is_no_device(&e) => return Err(e.to_string()),
                Err(e) => {
                    failures += 1;
                    writeln!(
                        text,
                        "FAIL world {world} islands {}: setup: {e}",
                        islands.to_spec()
                    )
                    .ok();
                    report.push(json!({"mode": "in-process", "world": world, "islands": islands.to_spec(), "error": e.to_string()}));
                    continue;
                }
            };
            for algorithm in Algorithm::ALL {
                // The flat algorithms do not depend on islands: check them once per world.
                if islands != island_sets(world)[0]
                    && !matches!(algorithm, Algorithm::IslandHierarchical(_))
                {
                    continue;
                }
                for dtype in [DType::Bf16, DType::F32] {
                    for residual in [false, true] {
                        let mut bad = Vec::new();
                        for (k, &len) in LENS.iter().enumerate() {
                            // Twice per length: the second call runs on the other parity.
                            for rep in 0..2 {
                                let seed = o.seed ^ ((k as u64) << 8) ^ rep;
                                let r = match dtype {
                                    DType::Bf16 => check_case::<bf16>(
                                        &mut comms, algorithm, len, residual, seed, &islands,
                                    ),
                                    DType::F32 => check_case::<f32>(
                                        &mut comms, algorithm, len, residual, seed, &islands,
                                    ),
                                };
                                match r {
                                    Ok(None) => {}
                                    Ok(Some(m)) => bad.push(format!("len {len}: {m}")),
                                    Err(e) => {
                                        bad.push(format!("len {len}: {e}"));
                                        break;
                                    }
                                }
                            }
                            if bad.iter().any(|b| b.contains("communicator is unusable")) {
                                break;
                            }
                        }
                        let ok = bad.is_empty();
                        failures += usize::from(!ok);
                        writeln!(
                            text,
                            "{} in-process world {world} islands {:<10} {:<26} {:<4} residual={:<5} {}",
                            if ok { "ok  " } else { "FAIL" },
                            islands.to_spec(),
                            algorithm.id(),
                            dtype.id(),
                            residual,
                            bad.first().cloned().unwrap_or_default()
                        )
                        .ok();
                        report.push(json!({
                            "mode": "in-process", "world": world, "islands": islands.to_spec(),
                            "algorithm": algorithm.id(), "dtype": dtype.id(), "residual": residual,
                            "lens": LENS, "ok": ok, "errors": bad,
                        }));
                        if !ok {
                            // A failed call poisons the group: rebuild it for the next case.
                            match CudaIpcCommunicator::in_process_group(
                                world,
                                config(o, islands.clone()),
                            ) {
                                Ok(c) => comms = c,
                                Err(e) => return Err(format!("rebuilding after a failure: {e}")),
                            }
                        }
                    }
                }
            }
            if o.timing && islands == island_sets(world)[0] {
                timing(o, world, &mut comms, report, text);
            }
        }
    }
    Ok(failures)
}

/// Median µs per call of `tactic` on `bytes`, all ranks launching `iters` calls back to back
/// (no host synchronization in between: the generation advances on the device), 5 rounds.
fn time_tactic(
    comms: &mut [CudaIpcCommunicator],
    tactic: AllReduceTactic,
    bytes: usize,
    iters: usize,
) -> Result<f64, AllReduceError> {
    time_in_process(comms, tactic, bytes, 5, iters).map(|mut us| median(&mut us))
}

fn timing(
    o: &Opts,
    world: usize,
    comms: &mut [CudaIpcCommunicator],
    report: &mut Vec<Value>,
    text: &mut String,
) {
    writeln!(
        text,
        "timing world {world} (one GPU: HBM, not PCIe; µs per call, median)"
    )
    .ok();
    // Latency at the decode size, every algorithm and block count.
    for algorithm in Algorithm::ALL {
        for blocks in BLOCKS {
            let t = AllReduceTactic {
                algorithm,
                dtype: DType::Bf16,
                threads: 512,
                blocks,
            };
            match time_tactic(comms, t, 14_336, o.iters) {
                Ok(us) => {
                    writeln!(text, "  latency 14336 B {:<36} {us:8.2} us", t.id()).ok();
                    report.push(json!({"mode": "timing", "world": world, "tactic": t.id(), "bytes": 14336, "us": us}));
                }
                Err(e) => {
                    writeln!(text, "  latency 14336 B {:<36} error: {e}", t.id()).ok();
                    report.push(json!({"mode": "timing", "world": world, "tactic": t.id(), "bytes": 14336, "error": e.to_string()}));
                    return;
                }
            }
        }
    }
    // Bus bandwidth over sizes, 8 blocks (bandwidth-bound) and 1 block (latency-bound).
    let mut bytes = 16;
    while bytes <= CAPACITY {
        for algorithm in Algorithm::ALL {
            for blocks in [1, 8] {
                let t = AllReduceTactic {
                    algorithm,
                    dtype: DType::Bf16,
                    threads: 512,
                    blocks,
                };
                let iters = if bytes >= 1 << 20 { 20 } else { o.iters / 2 };
                match time_tactic(comms, t, bytes, iters) {
                    Ok(us) => {
                        let bus_gbps =
                            bytes as f64 * 2.0 * (world as f64 - 1.0) / world as f64 / (us * 1e3);
                        writeln!(
                            text,
                            "  busbw {bytes:>8} B {:<36} {us:9.2} us {bus_gbps:8.2} GB/s",
                            t.id()
                        )
                        .ok();
                        report.push(json!({"mode": "busbw", "world": world, "tactic": t.id(), "bytes": bytes, "us": us, "bus_gbps": bus_gbps}));
                    }
                    Err(e) => {
                        writeln!(text, "  busbw {bytes:>8} B {:<36} error: {e}", t.id()).ok();
                        return;
                    }
                }
            }
        }
        bytes *= 4;
    }
}

/// A rank process of the IPC check: `--ipc-rank R --world N --name SEG --seed S --ptx-dir D
/// --device K`. Prints one line per case (`ok ...` or `FAIL ...`), exits 0 or 1.
fn ipc_rank(args: &[String]) -> ExitCode {
    let get = |k: &str| {
        args.iter()
            .position(|a| a == k)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_default()
    };
    let (rank, world): (usize, usize) = (
        get("--ipc-rank").parse().unwrap_or(0),
        get("--world").parse().unwrap_or(0),
    );
    let seed: u64 = get("--seed").parse().unwrap_or(1);
    let o = Opts {
        out: PathBuf::new(),
        ptx_dir: PathBuf::from(get("--ptx-dir")),
        device: get("--device").parse().unwrap_or(0),
        seed,
        worlds: vec![],
        ipc_worlds: vec![],
        iters: 0,
        timing: false,
    };
    let islands = kernels::allreduce::cpu::default_islands(world);
    let mut comm =
        match CudaIpcCommunicator::new(&get("--name"), rank, world, config(&o, islands.clone())) {
            Ok(c) => c,
            Err(e) => {
                println!("FAIL rank {rank}: setup: {e}");
                return ExitCode::from(1);
            }
        };
    let mut failed = false;
    for algorithm in Algorithm::ALL {
        for dtype in [DType::Bf16, DType::F32] {
            for (k, &len) in LENS.iter().enumerate() {
                let s = seed ^ ((k as u64) << 8);
                let r = match dtype {
                    DType::Bf16 => one_rank::<bf16>(&mut comm, algorithm, len, s, &islands),
                    DType::F32 => one_rank::<f32>(&mut comm, algorithm, len, s, &islands),
                };
                if let Err(m) = r {
                    println!(
                        "FAIL rank {rank} {} {} len {len}: {m}",
                        algorithm.id(),
                        dtype.id()
                    );
                    failed = true;
                    if m.contains("unusable") || m.contains("timed out") {
                        return ExitCode::from(1);
                    }
                }
            }
            println!("ok rank {rank} {} {}", algorithm.id(), dtype.id());
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn one_rank<T: Element>(
    comm: &mut CudaIpcCommunicator,
    algorithm: Algorithm,
    len: usize,
    seed: u64,
    islands: &Islands,
) -> Result<(), String> {
    let world = kernels::allreduce::AllReduce::world_size(comm);
    let rank = kernels::allreduce::AllReduce::rank(comm);
    let inputs: Vec<Vec<T>> = (0..world).map(|r| rank_input(seed, r, len)).collect();
    let res: Vec<T> = residual_input(seed, len);
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let expected = reference_reduce(algorithm, &refs, Some(&res), islands);
    let mut data = inputs[rank].clone();
    comm.all_reduce_with(algorithm, &mut data, Some(&res))
        .map_err(|e| e.to_string())?;
    match (0..len).find(|&i| data[i] != expected[i]) {
        None => Ok(()),
        Some(i) => Err(format!(
            "element {i} is {:?}, reference {:?}",
            data[i], expected[i]
        )),
    }
}

fn ipc(o: &Opts, report: &mut Vec<Value>, text: &mut String) -> usize {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            writeln!(text, "FAIL ipc: cannot find own executable: {e}").ok();
            return 1;
        }
    };
    let mut failures = 0;
    for &world in &o.ipc_worlds {
        let name = unique_segment_name("gpu-check");
        let start = Instant::now();
        // All ranks must be running at once for the rendezvous: spawn, then wait.
        let spawned: Vec<_> = (0..world)
            .map(|rank| {
                Command::new(&exe)
                    .args([
                        "--ipc-rank",
                        &rank.to_string(),
                        "--world",
                        &world.to_string(),
                    ])
                    .args(["--name", &name, "--seed", &o.seed.to_string()])
                    .args(["--device", &o.device.to_string()])
                    .arg("--ptx-dir")
                    .arg(&o.ptx_dir)
                    .stdout(std::process::Stdio::piped())
                    .spawn()
            })
            .collect();
        let mut lines = Vec::new();
        let mut ok = true;
        for (rank, child) in spawned.into_iter().enumerate() {
            match child.and_then(|c| c.wait_with_output()) {
                Ok(out) => {
                    ok &= out.status.success();
                    lines.extend(
                        String::from_utf8_lossy(&out.stdout)
                            .lines()
                            .filter(|l| l.starts_with("FAIL"))
                            .map(String::from),
                    );
                    if !out.status.success() && lines.is_empty() {
                        lines.push(format!("rank {rank} exited with {}", out.status));
                    }
                }
                Err(e) => {
                    ok = false;
                    lines.push(format!("rank {rank}: {e}"));
                }
            }
        }
        let _ = kernels::allreduce::shm::remove_segment(&name);
        failures += usize::from(!ok);
        writeln!(
            text,
            "{} ipc world {world}: every algorithm x dtype x {} lengths, residual, bit-identical ({:.1} s){}",
            if ok { "ok  " } else { "FAIL" },
            LENS.len(),
            start.elapsed().as_secs_f64(),
            lines.first().map(|l| format!(": {l}")).unwrap_or_default()
        )
        .ok();
        report.push(json!({"mode": "ipc", "world": world, "ok": ok, "errors": lines}));
    }
    failures
}

fn main() -> ExitCode {
    // Asking for help runs nothing.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    // In-process ranks are streams whose kernels spin until their peers' kernels run: two
    // streams sharing one hardware work queue would deadlock (until the timeout). The default
    // is 8 queues, exactly the largest world here; ask for more before the driver starts.
    if std::env::var_os("CUDA_DEVICE_MAX_CONNECTIONS").is_none() {
        // SAFETY: first thing in main, before any other thread exists.
        unsafe { std::env::set_var("CUDA_DEVICE_MAX_CONNECTIONS", "32") };
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "--ipc-rank") {
        return ipc_rank(&args);
    }
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("allreduce-gpu-check: {e}");
            return ExitCode::from(2);
        }
    };
    let mut report = Vec::new();
    let mut text = String::new();
    let in_proc = in_process(&o, &mut report, &mut text);
    let failures = match in_proc {
        Ok(f) => f + ipc(&o, &mut report, &mut text),
        Err(e) => {
            println!("allreduce-gpu-check: skipped: no GPU ({e})");
            return ExitCode::from(2);
        }
    };
    writeln!(
        text,
        "nccl: not compared (needs one GPU per rank; this check runs on one)"
    )
    .ok();
    let passed = report.iter().filter(|r| r["ok"] == json!(true)).count();
    writeln!(text, "{passed} passed, {failures} failed").ok();
    print!("{text}");
    if std::fs::create_dir_all(&o.out).is_ok() {
        let _ = std::fs::write(o.out.join("allreduce-gpu-check.txt"), &text);
        let _ = std::fs::write(
            o.out.join("allreduce-gpu-check.json"),
            serde_json::to_string_pretty(&json!({"seed": o.seed, "results": report}))
                .unwrap_or_default(),
        );
    }
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
