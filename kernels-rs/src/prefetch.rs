//! How far ahead of their loads the CPU kernels that stream weights ask for cache lines.
//!
//! The best reach depends on the CPU's vendor and core, not on the kernel, so it is detected
//! once per process (CPUID's vendor string and family/model) and shared by every family's
//! streaming kernels; [`PREFETCH_ENV`] or [`PrefetchReach::set`] override it.

use crate::isa::Isa;

/// The environment variable that forces how far ahead the streaming kernels prefetch
/// (`near`, `far`, `off` or `far-l2`, [`PrefetchReach`]); unset, the CPU's vendor decides.
pub const PREFETCH_ENV: &str = "KIMI_CPU_PREFETCH";

/// How far ahead of their loads the kernels that stream weight rows at decode ask for lines.
/// Far pays on AMD cores and lost on an Intel Xeon (see the dense one-row tiles,
/// [`bf16_tile`](crate::dense::bf16_tile)); on Zen 4 the dense rows read faster with no
/// software prefetch than with Far's, and faster still with Far's distances into L2 only.
/// So the default follows the vendor and the core;
/// [`PREFETCH_ENV`] or [`PrefetchReach::set`] (benchmarks comparing them in one process)
/// override it. Results are the same bits either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PrefetchReach {
    /// The distances measured on the Xeon: about one row, at least 4 KB for short rows.
    Near,
    /// At least 8 KB ahead.
    Far,
    /// No software prefetch in the dense BF16 one-row tiles of one token: the hardware
    /// prefetcher alone streams them. Tiles of more tokens and the NVFP4 kernels, whose
    /// arithmetic leaves their loads behind, keep Far's distances. Decode steps alternating
    /// in one `model run` (`mini`, 2 vCPUs of a Zen 4 EPYC, weights on 2 MiB pages) took 0.92
    /// of Far's time with AVX-512 (Far 8.19 ms, Off 7.52 ms, medians of 200 steps each) and
    /// 0.99 with the AVX2 kernels (twice the instructions per byte, so less bound by the
    /// loads); without the NVFP4 kernels' prefetch too it was 0.5-1 % slower again.
    Off,
    /// Far's distances, but the AVX-512 streaming decode kernels (the dense one-row tiles and
    /// the VNNI NVFP4 kernels) prefetch into L2 only ([`PrefetchHint::L2`]): the lines still
    /// arrive ahead, without holding L1's miss buffers, which the demand loads and L1's own
    /// prefetcher then have to themselves. The AVX2 kernels follow `Off` under it
    /// ([`PrefetchReach::for_isa`]). Zen 4's default: on 2 vCPUs of a Zen 4 EPYC the
    /// one-token BF16 products took 0.73–0.79 of Off's time at 1024–32768 rows of 1024 or
    /// 2816 columns in rounds that were mostly at 54–62 GB/s (`examples/dense_speed`),
    /// `lm_head` then reading 0.88–0.97 of the read bandwidth where Off read 0.62–0.75, and
    /// whole decode steps 0.91 of Off's time (`examples/decode_prefetch`; every figure in
    /// `bench/results/zen4-prefetch-l2.txt`).
    FarL2,
}

/// The cache level a kernel's software prefetch fills.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PrefetchHint {
    /// `prefetcht0`: every level, L1 included.
    L1,
    /// `prefetcht1`: L2 and below, not L1.
    L2,
}

impl PrefetchHint {
    /// Asks for the cache line holding `p` (a prefetch never faults, whatever the address).
    #[inline(always)]
    pub fn line<T>(self, p: *const T) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
            // SAFETY: SSE is part of x86_64's baseline, and a prefetch reads nothing.
            unsafe {
                match self {
                    Self::L1 => _mm_prefetch::<_MM_HINT_T0>(p.cast()),
                    Self::L2 => _mm_prefetch::<_MM_HINT_T1>(p.cast()),
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (self, p);
    }
}

/// 0 until first asked, then 1 + the reach's index.
static PREFETCH_REACH: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

impl PrefetchReach {
    /// The reach the kernels use now.
    pub fn current() -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        match PREFETCH_REACH.load(Relaxed) {
            0 => {
                let reach = Self::detect();
                reach.set();
                reach
            }
            code => Self::ALL[usize::from(code) - 1],
        }
    }

    /// Makes every kernel of this process use `self` from now on.
    pub fn set(self) {
        let code = self.index() as u8 + 1;
        PREFETCH_REACH.store(code, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Near => "near",
            Self::Far => "far",
            Self::Off => "off",
            Self::FarL2 => "far-l2",
        }
    }

    /// Every reach.
    pub const ALL: [Self; 4] = [Self::Near, Self::Far, Self::Off, Self::FarL2];

    /// Where `self` lies in [`Self::ALL`].
    pub fn index(self) -> usize {
        match self {
            Self::Near => 0,
            Self::Far => 1,
            Self::Off => 2,
            Self::FarL2 => 3,
        }
    }

    /// The reach the kernels of `isa` follow under this one: far-l2 is a setting of the
    /// AVX-512 kernels, and under it the others follow off. With the AVX2 kernels forced on
    /// Zen 4 (twice the instructions per byte, so their loads are less far behind) whole
    /// decode steps under far-l2 took 1.08× as long as under off (`examples/decode_prefetch`,
    /// 8 rounds alternating in one process), where with AVX-512 off took 1.10× far-l2's.
    pub fn for_isa(self, isa: Isa) -> Self {
        match self {
            Self::FarL2 if isa != Isa::Avx512 => Self::Off,
            reach => reach,
        }
    }

    /// The cache level the streaming decode kernels prefetch into under this reach.
    pub fn hint(self) -> PrefetchHint {
        match self {
            Self::FarL2 => PrefetchHint::L2,
            Self::Near | Self::Far | Self::Off => PrefetchHint::L1,
        }
    }

    /// The reach [`PREFETCH_ENV`] names (case and surrounding spaces ignored).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|r| r.name() == name.trim().to_ascii_lowercase())
    }

    /// [`PREFETCH_ENV`], else far-l2 on Zen 4, far on other AMD CPUs and near elsewhere. An
    /// unknown name is reported once on stderr and the vendor's default is used.
    fn detect() -> Self {
        let vendor_default = if is_zen4() {
            Self::FarL2
        } else if is_amd() {
            Self::Far
        } else {
            Self::Near
        };
        let Some(name) = std::env::var_os(PREFETCH_ENV) else {
            return vendor_default;
        };
        let name = name.to_string_lossy();
        match Self::from_name(&name) {
            Some(reach) => reach,
            None => {
                let names: Vec<&str> = Self::ALL.iter().map(|r| r.name()).collect();
                eprintln!(
                    "warning: {PREFETCH_ENV}={name} is not one of {}; using {}",
                    names.join(", "),
                    vendor_default.name()
                );
                vendor_default
            }
        }
    }
}

/// Whether this CPU is an AMD Zen 4: family 19h, models 10h–1Fh (Genoa), 60h–7Fh and
/// A0h–AFh (Zen 3 shares the family with the other models).
fn is_zen4() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !is_amd() {
            return false;
        }
        // CPUID leaf 1, EAX: base family in bits 8–11 (0xF adds the extended family in bits
        // 20–27), model in bits 4–7 with the extended model in bits 16–19 above it.
        let eax = std::arch::x86_64::__cpuid(1).eax;
        let base_family = (eax >> 8) & 0xF;
        let family = if base_family == 0xF {
            base_family + ((eax >> 20) & 0xFF)
        } else {
            base_family
        };
        let model = ((eax >> 12) & 0xF0) | ((eax >> 4) & 0xF);
        family == 0x19 && matches!(model, 0x10..=0x1F | 0x60..=0x7F | 0xA0..=0xAF)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU's vendor string is AMD's.
fn is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 0: the vendor string in EBX, EDX, ECX.
        let id = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx]
            .iter()
            .flat_map(|r| r.to_le_bytes())
            .collect();
        vendor == b"AuthenticAMD"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_reaches_parse_from_their_names_only() {
        for reach in PrefetchReach::ALL {
            assert_eq!(PrefetchReach::from_name(reach.name()), Some(reach));
        }
        assert_eq!(
            PrefetchReach::from_name("Far-L2"),
            Some(PrefetchReach::FarL2)
        );
        assert_eq!(PrefetchReach::from_name(" FAR\n"), Some(PrefetchReach::Far));
        assert_eq!(PrefetchReach::from_name("farther"), None);
        assert_eq!(PrefetchReach::from_name(""), None);
    }
}
