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
//!
//! It sits above the kernel families because a timed device runs any of them, the all-reduce's
//! rank groups included; the figures it returns are [`tactic::timing`](crate::tactic::timing)'s.

use std::fmt;
use std::path::Path;

use crate::allreduce::tactic::AllReduceTactic;
use crate::arch::Sm;
use crate::device::{Device, DeviceError, Result};
use crate::tactic::timing::{DeviceIdentity, Samples};

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

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::{CudaSlice, DevicePtrMut};

    use super::{RankGroup, TimedDevice};
    use crate::allreduce::AllReduceError;
    use crate::allreduce::cuda::{CudaIpcCommunicator, CudaIpcConfig};
    use crate::allreduce::tactic::AllReduceTactic;
    use crate::cuda::GpuContext;
    use crate::device::{DeviceError, Result};
    use crate::tactic::timing::{
        DeviceIdentity, Samples, cuda_version_string, nvidia_driver_version,
    };

    impl TimedDevice for GpuContext {
        fn identity(&self) -> DeviceIdentity {
            let info = self.info();
            DeviceIdentity {
                name: info.name.clone(),
                sm: info.sm.unwrap_or(crate::arch::Sm::Sm120),
                multiprocessors: info.multiprocessors,
                l2_bytes: info.l2_bytes,
                driver_version: nvidia_driver_version(),
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
