//! Timing tactics on a device: the seam the tuning lab's timed stage (`autotune`) and the CUDA
//! sweeps (`cargo bench -p bench --bench gpu_tactics`) measure through.
//!
//! A [`TimedDevice`] is a [`Device`] with a clock of its own: each timed run sits between two
//! device timestamps (CUDA events on a GPU), so host launch overhead and synchronisation stay
//! outside the figure. The measuring code is written once, generic over the trait, and is
//! type-checked in every build; [`with_timed_device`] hands it a GPU when the binary was built
//! with the `cuda` feature and a device of the requested SM is present, and otherwise says why
//! not ([`Unavailable`]): nothing is measured then, and the caller falls back to the cost
//! model's predictions, labelled as such.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::allreduce::tactic::AllReduceTactic;
use crate::arch::Sm;
use crate::device::{Device, DeviceError, Result};
use crate::moe_gemm::launch::MoeWeightsHost;
use crate::rng::Rng;

/// Environment variable that overrides where kernel images are looked for.
pub const PTX_DIR_ENV: &str = "KIMI_PTX_DIR";

/// Where kernel images are looked for: `$KIMI_PTX_DIR`, else `./ptx` if it exists, else the
/// `ptx/` of the source tree this crate was built from.
pub fn default_ptx_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os(PTX_DIR_ENV) {
        return PathBuf::from(dir);
    }
    let local = PathBuf::from("ptx");
    if local.is_dir() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../ptx")
}

/// Which device took the measurements: a cache's provenance.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceIdentity {
    pub name: String,
    pub sm: Sm,
    pub multiprocessors: usize,
    pub l2_bytes: usize,
    /// The NVIDIA driver (`580.65.06`), or `unknown` where the system does not say.
    pub driver_version: String,
    /// The CUDA version the driver implements (`13.0`).
    pub cuda_version: String,
}

/// Timed runs of one piece of work, µs each.
#[derive(Clone, Debug, PartialEq)]
pub struct Samples {
    pub us: Vec<f64>,
}

impl Samples {
    /// The median (the mean of the middle two for an even count); NaN when empty.
    pub fn median(&self) -> f64 {
        let mut v = self.us.clone();
        v.sort_by(f64::total_cmp);
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
        }
    }

    /// Max − min.
    pub fn spread(&self) -> f64 {
        let (lo, hi) = self
            .us
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            });
        if self.us.is_empty() { 0.0 } else { hi - lo }
    }

    pub fn n(&self) -> usize {
        self.us.len()
    }
}

/// A device that can time work on its own clock.
pub trait TimedDevice: Device {
    fn identity(&self) -> DeviceIdentity;

    /// Runs `work` `warmup` times, then `reps` times each between two device timestamps, with
    /// `between` before every run outside the timestamps (flushing the L2, resetting an
    /// accumulator). Returns µs per timed run.
    fn time_runs(
        &self,
        warmup: usize,
        reps: usize,
        between: &mut dyn FnMut() -> Result<()>,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Samples>;

    /// `world` all-reduce ranks as concurrent streams of this one device (peers addressed
    /// directly, as `allreduce-gpu-check` runs them), for the images of `threads` threads and
    /// messages up to `capacity_bytes`. On one GPU the "links" are its own memory, so what
    /// the group times is the kernels' own cost (launch, flags, phases), not PCIe.
    fn allreduce_ranks(
        &self,
        world: usize,
        threads: u32,
        capacity_bytes: usize,
    ) -> Result<Box<dyn RankGroup + '_>> {
        let _ = (world, threads, capacity_bytes);
        Err(DeviceError::Invalid(format!(
            "{}: cannot run all-reduce ranks",
            self.describe()
        )))
    }
}

/// All-reduce ranks of one device, kept alive between timings.
pub trait RankGroup {
    /// `rounds` samples after one warm-up round; each the mean µs of `calls` back-to-back
    /// calls of `tactic` on `bytes` (every rank launching; no host synchronisation between
    /// calls). A failed call leaves the group usable for the next tactic.
    fn time(
        &mut self,
        tactic: AllReduceTactic,
        bytes: usize,
        rounds: usize,
        calls: usize,
    ) -> Result<Samples>;
}

/// Why no device measurement can be taken.
#[derive(Clone, Debug, PartialEq)]
pub enum Unavailable {
    /// The binary was built without the `cuda` feature.
    NotBuilt,
    /// No driver library, no device, or a device nothing is built for.
    NoDevice(String),
    /// A device is present, of another SM than the one asked for.
    OtherSm { found: String, wanted: Sm },
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::NotBuilt => f.write_str(
                "this binary was built without the `cuda` feature (rebuild with --features cuda)",
            ),
            Unavailable::NoDevice(why) => write!(f, "no GPU: {why}"),
            Unavailable::OtherSm { found, wanted } => {
                write!(f, "the GPU present is {found}, not {wanted}")
            }
        }
    }
}

/// Work to do with a timed device, generic over the device type (so it is compiled in every
/// build and instantiated for a GPU only where there can be one).
pub trait WithTimedDevice {
    type Output;
    fn run<D: TimedDevice>(self, dev: &D) -> Self::Output;
}

/// Opens GPU `ordinal` (kernel images from `ptx_dir`) and hands it to `work` if kernels are
/// built for it and it is an `sm` device (any, for `None`); otherwise says why not.
pub fn with_timed_device<W: WithTimedDevice>(
    ordinal: usize,
    ptx_dir: &Path,
    sm: Option<Sm>,
    work: W,
) -> std::result::Result<W::Output, Unavailable> {
    #[cfg(feature = "cuda")]
    {
        let gpu = crate::cuda::GpuContext::new(ordinal, ptx_dir)
            .map_err(|e| Unavailable::NoDevice(e.to_string()))?;
        let found = gpu.sm().map_err(|e| Unavailable::NoDevice(e.to_string()))?;
        if let Some(wanted) = sm.filter(|&s| s != found) {
            return Err(Unavailable::OtherSm {
                found: format!("{} ({found})", gpu.info().name),
                wanted,
            });
        }
        Ok(work.run(&gpu))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (ordinal, ptx_dir, sm, work);
        Err(Unavailable::NotBuilt)
    }
}

/// One layer's routed experts with random NVFP4 codes and valid scales: timing needs
/// real-looking bytes (no zeros, no NaN scales), not meaningful values.
pub fn random_moe_weights(
    seed: u64,
    experts: usize,
    hidden: usize,
    inter: usize,
) -> MoeWeightsHost {
    let mut rng = Rng(seed);
    let mut w = MoeWeightsHost {
        experts,
        hidden,
        inter,
        w13: vec![0; experts * 2 * inter * hidden / 2],
        w13_sf: vec![0; experts * 2 * inter * hidden / 16],
        w2: vec![0; experts * hidden * inter / 2],
        w2_sf: vec![0; experts * hidden * inter / 16],
        w13_gs: vec![1e-3; experts],
        a13_gs: vec![1e-3; experts],
        w2_gs: vec![1e-3; experts],
        a2_gs: vec![1e-3; experts],
    };
    rng.fill_bytes(&mut w.w13);
    rng.fill_bytes(&mut w.w2);
    // UE4M3 codes 0x28..0x47: 2^-2 .. 2^1, far from NaN (0x7F) and subnormals.
    for b in w.w13_sf.iter_mut().chain(w.w2_sf.iter_mut()) {
        *b = 0x28 + (rng.next_u64() % 32) as u8;
    }
    w
}

/// The NVIDIA driver version in the first line of `/proc/driver/nvidia/version`
/// (`NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 …`).
pub fn parse_nvrm_version(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    let rest = line.split("Kernel Module").nth(1).unwrap_or(line);
    rest.split_whitespace()
        .find(|w| {
            w.split('.').count() >= 2
                && w.split('.')
                    .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_string)
}

/// `cuDriverGetVersion`'s integer (`13000`) as `13.0`.
pub fn cuda_version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

/// The installed NVIDIA driver's version: `/proc/driver/nvidia/version`, else `nvidia-smi`,
/// else `unknown`.
pub fn nvidia_driver_version() -> String {
    if let Some(v) = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| parse_nvrm_version(&t))
    {
        return v;
    }
    std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=driver_version", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(|l| l.trim().to_string())
        })
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::{CudaSlice, DevicePtrMut};

    use super::{DeviceIdentity, RankGroup, Samples, TimedDevice, cuda_version_string};
    use crate::allreduce::AllReduceError;
    use crate::allreduce::cuda::{CudaIpcCommunicator, CudaIpcConfig};
    use crate::allreduce::tactic::AllReduceTactic;
    use crate::cuda::GpuContext;
    use crate::device::{DeviceError, Result};

    impl TimedDevice for GpuContext {
        fn identity(&self) -> DeviceIdentity {
            let info = self.info();
            DeviceIdentity {
                name: info.name.clone(),
                sm: info.sm.unwrap_or(crate::arch::Sm::Sm120),
                multiprocessors: info.multiprocessors,
                l2_bytes: info.l2_bytes,
                driver_version: super::nvidia_driver_version(),
                cuda_version: cuda_version_string(info.driver_version),
            }
        }

        fn time_runs(
            &self,
            warmup: usize,
            reps: usize,
            between: &mut dyn FnMut() -> Result<()>,
            work: &mut dyn FnMut() -> Result<()>,
        ) -> Result<Samples> {
            for _ in 0..warmup {
                between()?;
                work()?;
            }
            let mut events = Vec::with_capacity(2 * reps);
            for _ in 0..2 * reps {
                events.push(self.timing_event()?);
            }
            for pair in events.chunks(2) {
                between()?;
                self.record(&pair[0])?;
                work()?;
                self.record(&pair[1])?;
            }
            self.synchronize()?;
            let us = events
                .chunks(2)
                .map(|p| {
                    p[0].elapsed_ms(&p[1])
                        .map(|ms| f64::from(ms) * 1e3)
                        .map_err(|e| DeviceError::Driver {
                            what: "cuEventElapsedTime".into(),
                            detail: e.to_string(),
                        })
                })
                .collect::<Result<Vec<f64>>>()?;
            Ok(Samples { us })
        }

        fn allreduce_ranks(
            &self,
            world: usize,
            threads: u32,
            capacity_bytes: usize,
        ) -> Result<Box<dyn RankGroup + '_>> {
            let config = CudaIpcConfig {
                device: self.info().ordinal,
                ptx_dir: self.ptx_dir().to_path_buf(),
                capacity_bytes: capacity_bytes.max(16),
                islands: Some(crate::allreduce::cpu::default_islands(world)),
                threads,
                ..CudaIpcConfig::default()
            };
            let comms = CudaIpcCommunicator::in_process_group(world, config.clone())
                .map_err(|e| DeviceError::Invalid(e.to_string()))?;
            Ok(Box::new(GpuRanks {
                world,
                config,
                comms,
            }))
        }
    }

    struct GpuRanks {
        world: usize,
        config: CudaIpcConfig,
        comms: Vec<CudaIpcCommunicator>,
    }

    impl RankGroup for GpuRanks {
        fn time(
            &mut self,
            tactic: AllReduceTactic,
            bytes: usize,
            rounds: usize,
            calls: usize,
        ) -> Result<Samples> {
            if tactic.threads != self.config.threads {
                return Err(DeviceError::Invalid(format!(
                    "{tactic}: the group runs the {}-thread images",
                    self.config.threads
                )));
            }
            match time_in_process(&mut self.comms, tactic, bytes, rounds, calls) {
                Ok(us) => Ok(Samples { us }),
                Err(e) => {
                    // A failed call poisons the group: rebuild it for the next tactic.
                    if let Ok(c) =
                        CudaIpcCommunicator::in_process_group(self.world, self.config.clone())
                    {
                        self.comms = c;
                    }
                    Err(DeviceError::Invalid(format!("{tactic} on {bytes} B: {e}")))
                }
            }
        }
    }

    /// µs per call of `tactic` on `bytes`, every rank launching `calls` calls back to back (no
    /// host synchronisation in between: the generation advances on the device), one sample
    /// per round after one warm-up round; rank 0's events.
    pub fn time_in_process(
        comms: &mut [CudaIpcCommunicator],
        tactic: AllReduceTactic,
        bytes: usize,
        rounds: usize,
        calls: usize,
    ) -> std::result::Result<Vec<f64>, AllReduceError> {
        let len = bytes / tactic.dtype.size();
        let calls = calls.max(1);
        let dev = |e: cudarc::driver::DriverError| AllReduceError::Device(e.to_string());
        let results: Vec<std::result::Result<Option<Vec<f64>>, AllReduceError>> =
            std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .iter_mut()
                    .enumerate()
                    .map(|(rank, comm)| {
                        s.spawn(move || {
                            let stream = comm.stream().clone();
                            let mut buf: CudaSlice<u8> =
                                stream.alloc_zeros(bytes.max(16)).map_err(dev)?;
                            let start = comm
                                .gpu()
                                .timing_event()
                                .map_err(|e| AllReduceError::Device(e.to_string()))?;
                            let end = comm
                                .gpu()
                                .timing_event()
                                .map_err(|e| AllReduceError::Device(e.to_string()))?;
                            let mut samples = Vec::new();
                            for round in 0..=rounds {
                                start.record(&stream).map_err(dev)?;
                                for _ in 0..calls {
                                    let (ptr, _g) = buf.device_ptr_mut(&stream);
                                    // SAFETY: `buf` holds `len` elements and outlives the
                                    // launches (the stream is synchronised by `check` below
                                    // before it drops).
                                    unsafe { comm.launch_raw(tactic, len, ptr, None)? };
                                }
                                end.record(&stream).map_err(dev)?;
                                comm.check()?;
                                if round > 0 {
                                    let ms = start.elapsed_ms(&end).map_err(dev)?;
                                    samples.push(f64::from(ms) * 1e3 / calls as f64);
                                }
                            }
                            Ok((rank == 0).then_some(samples))
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("rank thread panicked"))
                    .collect()
            });
        let mut us = Vec::new();
        for r in results {
            if let Some(v) = r? {
                us = v;
            }
        }
        Ok(us)
    }
}

#[cfg(feature = "cuda")]
pub use gpu::time_in_process;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_give_median_spread_and_count() {
        let s = Samples {
            us: vec![3.0, 1.0, 2.0, 10.0],
        };
        assert_eq!(s.median(), 2.5);
        assert_eq!(s.spread(), 9.0);
        assert_eq!(s.n(), 4);
        let odd = Samples {
            us: vec![5.0, 1.0, 3.0],
        };
        assert_eq!(odd.median(), 3.0);
        let none = Samples { us: vec![] };
        assert!(none.median().is_nan());
        assert_eq!(none.spread(), 0.0);
    }

    #[test]
    fn timing_weights_have_valid_scales() {
        let w = random_moe_weights(1, 2, 256, 128);
        w.check().unwrap();
        assert!(w.w13_sf.iter().all(|&b| (0x28..0x48).contains(&b)));
    }

    #[test]
    fn driver_and_cuda_versions_parse() {
        let proc = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 \
                    07:09:59 UTC 2025\nGCC version:  gcc version 12.3.0\n";
        assert_eq!(parse_nvrm_version(proc).as_deref(), Some("580.65.06"));
        let open = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  \
                    Release Build\n";
        assert_eq!(parse_nvrm_version(open).as_deref(), Some("570.133.20"));
        assert_eq!(parse_nvrm_version("garbage"), None);
        assert_eq!(parse_nvrm_version(""), None);
        assert_eq!(cuda_version_string(13000), "13.0");
        assert_eq!(cuda_version_string(12080), "12.8");
    }

    #[test]
    fn without_a_device_nothing_is_measured_and_the_reason_is_given() {
        struct Never;
        impl WithTimedDevice for Never {
            type Output = ();
            fn run<D: TimedDevice>(self, _: &D) {
                panic!("no timed device may exist here");
            }
        }
        // In CI there is neither the feature nor a GPU; on a GPU machine this test is not the
        // place to open it (the ordinal is out of range on purpose).
        let r = with_timed_device(9999, Path::new("ptx"), Some(Sm::Sm120), Never);
        let why = r.expect_err("device 9999 does not exist").to_string();
        assert!(
            why.contains("cuda") || why.contains("no GPU"),
            "unexpected reason: {why}"
        );
    }
}
