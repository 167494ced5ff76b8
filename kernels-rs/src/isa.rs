//! The instruction set the CPU kernels run: AVX-512, AVX2 with FMA, or portable Rust.
//!
//! Every family's CPU path (the dense products, the NVFP4 grouped GEMM, MLA attention) is
//! compiled for each of them and dispatches on an [`Isa`] at run time, so one binary runs on
//! any x86-64 CPU. The choice is made once per process: the best set this CPU supports, unless
//! [`ISA_ENV`] forces another (to measure the AVX2 path on an AVX-512 machine).

/// The environment variable that forces the CPU kernels' instruction set
/// (`avx512`, `avx2` or `scalar`); unset, the best one the CPU supports is used.
pub const ISA_ENV: &str = "KIMI_CPU_ISA";

/// The instruction set a kernel is compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// AVX-512F (+BW for the byte shuffles).
    Avx512,
    /// AVX2 with FMA.
    Avx2Fma,
    /// Portable Rust; the compiler may still auto-vectorize it for the baseline target.
    Scalar,
}

/// As people name the instruction sets: `avx512`, `avx2+fma`, `scalar`.
impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Avx512 => "avx512",
            Self::Avx2Fma => "avx2+fma",
            Self::Scalar => "scalar",
        })
    }
}

impl Isa {
    /// The instruction set the CPU kernels use: the best this CPU supports, or the one
    /// [`ISA_ENV`] names (to measure the AVX2 path on an AVX-512 machine). A name that is
    /// unknown or unsupported here is reported once on stderr and the best one is used.
    pub fn detect() -> Self {
        static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let best = Self::best_supported();
            let Some(name) = std::env::var_os(ISA_ENV) else {
                return best;
            };
            let name = name.to_string_lossy();
            match Self::from_name(&name) {
                Some(isa) if isa.is_supported() => isa,
                Some(isa) => {
                    eprintln!("warning: {ISA_ENV}={name}: {isa} is not supported by this CPU; using {best}");
                    best
                }
                None => {
                    eprintln!("warning: {ISA_ENV}={name} is not one of avx512, avx2, scalar; using {best}");
                    best
                }
            }
        })
    }

    /// The best instruction set this CPU supports, whatever [`ISA_ENV`] says.
    pub fn best_supported() -> Self {
        [Self::Avx512, Self::Avx2Fma]
            .into_iter()
            .find(|isa| isa.is_supported())
            .unwrap_or(Self::Scalar)
    }

    /// The name [`ISA_ENV`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Avx512 => "avx512",
            Self::Avx2Fma => "avx2",
            Self::Scalar => "scalar",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Avx512, Self::Avx2Fma, Self::Scalar]
            .into_iter()
            .find(|isa| isa.name() == name.trim().to_ascii_lowercase())
    }

    /// Whether this CPU can run the kernels compiled for `self`.
    pub fn is_supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Self::Avx512 => {
                is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
            }
            #[cfg(target_arch = "x86_64")]
            Self::Avx2Fma => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            Self::Avx512 | Self::Avx2Fma => false,
            Self::Scalar => true,
        }
    }

    /// Every instruction set this CPU supports, best first (for tests and benchmarks).
    pub fn all_supported() -> Vec<Self> {
        [Self::Avx512, Self::Avx2Fma, Self::Scalar]
            .into_iter()
            .filter(|isa| isa.is_supported())
            .collect()
    }
}
