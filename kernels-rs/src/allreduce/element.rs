//! Element types the all-reduce moves and sums.

use half::bf16;

/// Data types of a collective, as written into the shared segment's call descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bf16,
    F32,
}

impl DType {
    pub fn id(self) -> &'static str {
        match self {
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
        }
    }

    pub fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }

    pub fn code(self) -> u64 {
        match self {
            DType::Bf16 => 1,
            DType::F32 => 2,
        }
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bf16" => Ok(DType::Bf16),
            "f32" => Ok(DType::F32),
            other => Err(format!("unknown dtype {other:?} (expected bf16 or f32)")),
        }
    }
}

/// An element that can be all-reduced. Sums are carried in f32 (as the GPU kernels do) and
/// rounded to the element type once per stored value.
pub trait Element: bytemuck::Pod + Send + Sync + PartialEq + std::fmt::Debug + 'static {
    const DTYPE: DType;
    fn to_acc(self) -> f32;
    fn from_acc(acc: f32) -> Self;
}

impl Element for bf16 {
    const DTYPE: DType = DType::Bf16;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn from_acc(acc: f32) -> Self {
        bf16::from_f32(acc)
    }
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_acc(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_acc(acc: f32) -> Self {
        acc
    }
}
