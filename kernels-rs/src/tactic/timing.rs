//! The figures of timed runs and the device that took them: what the tuning lab's timed stage
//! (`autotune`) and the CUDA sweeps record, and what the tactic cache keeps ([`Samples`],
//! [`DeviceIdentity`]), with the driver's version as the cache's provenance names it and where
//! the kernel images are looked for.
//!
//! Taking the measurements needs a device with a clock and the families' kernels: that is
//! `timed_device`, above the families.

use std::path::{Path, PathBuf};

use crate::arch::Sm;

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
    let version = std::path::Path::new("/proc/driver/nvidia/version");
    if let Some(v) = crate::files::read_text_bounded(version, crate::files::TEXT_FILE_LIMIT)
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
}
