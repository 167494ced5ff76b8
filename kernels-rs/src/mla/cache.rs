//! The paged latent KV cache: pages of [`PAGE_TOKENS`] tokens, one block table per sequence,
//! one page id valid across all layers (as paged attention engines allocate them).
//!
//! Storage per token and layer:
//! - BF16: the 512 latent values and the 64 RoPE values, 1,152 bytes.
//! - FP8 E4M3: the 512 latent values as E4M3 codes with one FP32 scale per token
//!   (`amax / 448`, so every token uses the full E4M3 range), plus the 64 RoPE values in BF16:
//!   512 + 4 + 128 = 644 bytes. The RoPE part stays BF16 because its rotation spreads values
//!   across magnitudes that one scale would crush, and it is only 11% of the bytes.
//!
//! FP8 scale scheme (shared bit for bit by `mla_append` in `mla_decode.cu` and the goldens):
//! `scale = amax(latent) / 448` in f32 (1 for an all-zero latent), `code = e4m3(x / scale)`
//! rounded to nearest even and saturating at ±448, `value = e4m3_to_f32(code) · scale`.
//! A per-token scale follows each token's own range, which a static scale cannot (RMSNorm'd
//! latents differ in range from token to token). A checkpoint's per-tensor `k_scale` is
//! supported as [`PagedLatentCache::set_fp8_static_scale`]: every token then stores that scale,
//! values beyond `448 · k_scale` saturate, and readers (CPU and GPU) need no second format.

use half::bf16;
use thiserror::Error;

use crate::formats::e4m3::{E4M3_MAX, Overflow, e4m3_to_f32_arith, f32_to_e4m3};
use crate::formats::widen_bf16;

/// Tokens per cache page.
pub const PAGE_TOKENS: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KvCacheDtype {
    /// Full precision: the reference the other two are measured against.
    F32,
    Bf16,
    Fp8E4m3,
}

impl KvCacheDtype {
    pub fn id(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp8E4m3 => "fp8",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "f32" => Some(Self::F32),
            "bf16" => Some(Self::Bf16),
            "fp8" | "fp8_e4m3" => Some(Self::Fp8E4m3),
            _ => None,
        }
    }

    /// Bytes one token occupies in one layer.
    pub fn bytes_per_token(self, shape: &LatentCacheShape) -> usize {
        match self {
            Self::F32 => 4 * (shape.latent_dim + shape.rope_dim),
            Self::Bf16 => 2 * (shape.latent_dim + shape.rope_dim),
            Self::Fp8E4m3 => shape.latent_dim + 4 + 2 * shape.rope_dim,
        }
    }
}

/// Dimensions of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LatentCacheShape {
    pub layers: usize,
    pub latent_dim: usize,
    pub rope_dim: usize,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum CacheError {
    #[error("KV cache is full: {needed} more pages needed, {free} free of {total}")]
    Full {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("unknown sequence {0:?}")]
    UnknownSequence(SeqId),
    #[error("position {pos} is beyond the {reserved} tokens reserved for sequence {seq:?}")]
    NotReserved {
        seq: SeqId,
        pos: usize,
        reserved: usize,
    },
}

/// A sequence's handle in the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

#[derive(Clone, Debug, Default)]
struct BlockTable {
    pages: Vec<u32>,
    /// Tokens whose entries are written in every layer.
    len: usize,
}

/// Storage for one layer. Index of token slot `s` of page `p`: `p * PAGE_TOKENS + s`.
enum LayerStorage {
    F32 {
        values: Vec<f32>,
    },
    Bf16 {
        values: Vec<bf16>,
    },
    Fp8 {
        latent: Vec<u8>,
        scales: Vec<f32>,
        rope: Vec<bf16>,
    },
}

/// One layer's storage as it sits in memory: the layout the GPU kernels read (`mla_decode.cu`),
/// so a device copy is a plain upload. Slot `s` = page · 64 + token in page.
pub enum RawLayer<'a> {
    /// `[slots][latent + rope]`
    F32 { values: &'a [f32] },
    /// `[slots][latent + rope]`
    Bf16 { values: &'a [bf16] },
    /// `latent [slots][latent]` E4M3 codes, `scales [slots]`, `rope [slots][rope]`.
    Fp8 {
        latent: &'a [u8],
        scales: &'a [f32],
        rope: &'a [bf16],
    },
}

/// One token's cached entry, widened to `f32`.
pub struct TokenEntry<'a> {
    pub latent: &'a mut [f32],
    pub rope: &'a mut [f32],
}

/// The cache's bookkeeping without its storage: the free pages and each sequence's block table
/// and length. [`PagedLatentCache`] holds one beside its host storage; a device executor holds
/// one beside storage in device memory, so both hand out pages and slots the same way.
#[derive(Clone, Debug)]
pub struct PageTables {
    num_pages: usize,
    free_pages: Vec<u32>,
    sequences: std::collections::BTreeMap<SeqId, BlockTable>,
    next_seq: u32,
}

impl PageTables {
    pub fn new(num_pages: usize) -> Self {
        Self {
            num_pages,
            // Pop from the end, so hand out low page ids first.
            free_pages: (0..num_pages as u32).rev().collect(),
            sequences: Default::default(),
            next_seq: 0,
        }
    }

    pub fn free_pages(&self) -> usize {
        self.free_pages.len()
    }

    pub fn total_pages(&self) -> usize {
        self.num_pages
    }

    /// Token slots of all pages (`pages × PAGE_TOKENS`).
    pub fn total_slots(&self) -> usize {
        self.num_pages * PAGE_TOKENS
    }

    pub fn add_sequence(&mut self) -> SeqId {
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.sequences.insert(id, BlockTable::default());
        id
    }

    /// Returns the sequence's pages to the free list.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<(), CacheError> {
        let table = self
            .sequences
            .remove(&seq)
            .ok_or(CacheError::UnknownSequence(seq))?;
        self.free_pages.extend(table.pages.into_iter().rev());
        Ok(())
    }

    /// Tokens cached for `seq` (written in every layer).
    pub fn seq_len(&self, seq: SeqId) -> Result<usize, CacheError> {
        Ok(self.table(seq)?.len)
    }

    /// The sequence's page ids, in order.
    pub fn block_table(&self, seq: SeqId) -> Result<&[u32], CacheError> {
        Ok(&self.table(seq)?.pages)
    }

    /// Makes room for `new_tokens` more tokens after the current length.
    pub fn reserve(&mut self, seq: SeqId, new_tokens: usize) -> Result<(), CacheError> {
        let table = self
            .sequences
            .get(&seq)
            .ok_or(CacheError::UnknownSequence(seq))?;
        let needed_pages = (table.len + new_tokens).div_ceil(PAGE_TOKENS);
        let extra = needed_pages.saturating_sub(table.pages.len());
        if extra > self.free_pages.len() {
            return Err(CacheError::Full {
                needed: extra,
                free: self.free_pages.len(),
                total: self.num_pages,
            });
        }
        let new_pages: Vec<u32> = (0..extra)
            .map(|_| self.free_pages.pop().expect("checked above"))
            .collect();
        self.sequences
            .get_mut(&seq)
            .expect("checked above")
            .pages
            .extend(new_pages);
        Ok(())
    }

    /// Marks `new_tokens` more tokens as written in every layer.
    pub fn commit(&mut self, seq: SeqId, new_tokens: usize) -> Result<(), CacheError> {
        let table = self
            .sequences
            .get_mut(&seq)
            .ok_or(CacheError::UnknownSequence(seq))?;
        let reserved = table.pages.len() * PAGE_TOKENS;
        if table.len + new_tokens > reserved {
            return Err(CacheError::NotReserved {
                seq,
                pos: table.len + new_tokens - 1,
                reserved,
            });
        }
        table.len += new_tokens;
        Ok(())
    }

    /// Keeps the first `len` tokens of `seq` (at most its length) and forgets the rest: their
    /// pages stay reserved, and the next tokens overwrite their slots (a rejected draft, a
    /// step replayed to warm up).
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), CacheError> {
        let table = self
            .sequences
            .get_mut(&seq)
            .ok_or(CacheError::UnknownSequence(seq))?;
        table.len = table.len.min(len);
        Ok(())
    }

    fn table(&self, seq: SeqId) -> Result<&BlockTable, CacheError> {
        self.sequences
            .get(&seq)
            .ok_or(CacheError::UnknownSequence(seq))
    }

    /// The physical slot (`page · PAGE_TOKENS + offset`) of token `pos` of `seq`, which must be
    /// reserved.
    pub fn slot(&self, seq: SeqId, pos: usize) -> Result<usize, CacheError> {
        let table = self.table(seq)?;
        let page = table
            .pages
            .get(pos / PAGE_TOKENS)
            .ok_or(CacheError::NotReserved {
                seq,
                pos,
                reserved: table.pages.len() * PAGE_TOKENS,
            })?;
        Ok(*page as usize * PAGE_TOKENS + pos % PAGE_TOKENS)
    }

    /// Physical slots of tokens `0..len` of `seq`, in order.
    pub fn slots(&self, seq: SeqId, len: usize) -> Result<Vec<usize>, CacheError> {
        (0..len).map(|pos| self.slot(seq, pos)).collect()
    }
}

pub struct PagedLatentCache {
    shape: LatentCacheShape,
    dtype: KvCacheDtype,
    layers: Vec<LayerStorage>,
    pages: PageTables,
    /// Per-tensor FP8 scale (a checkpoint's `k_scale`) instead of per-token amax scales.
    fp8_static_scale: Option<f32>,
}

impl PagedLatentCache {
    pub fn new(shape: LatentCacheShape, dtype: KvCacheDtype, num_pages: usize) -> Self {
        let slots = num_pages * PAGE_TOKENS;
        let layers = (0..shape.layers)
            .map(|_| match dtype {
                KvCacheDtype::F32 => LayerStorage::F32 {
                    values: vec![0.0; slots * (shape.latent_dim + shape.rope_dim)],
                },
                KvCacheDtype::Bf16 => LayerStorage::Bf16 {
                    values: vec![bf16::ZERO; slots * (shape.latent_dim + shape.rope_dim)],
                },
                KvCacheDtype::Fp8E4m3 => LayerStorage::Fp8 {
                    latent: vec![0; slots * shape.latent_dim],
                    scales: vec![0.0; slots],
                    rope: vec![bf16::ZERO; slots * shape.rope_dim],
                },
            })
            .collect();
        Self {
            shape,
            dtype,
            layers,
            pages: PageTables::new(num_pages),
            fp8_static_scale: None,
        }
    }

    /// A cache big enough for `tokens` tokens in total.
    pub fn with_capacity_tokens(
        shape: LatentCacheShape,
        dtype: KvCacheDtype,
        tokens: usize,
    ) -> Self {
        Self::new(shape, dtype, tokens.div_ceil(PAGE_TOKENS))
    }

    pub fn shape(&self) -> LatentCacheShape {
        self.shape
    }

    pub fn dtype(&self) -> KvCacheDtype {
        self.dtype
    }

    /// Uses one per-tensor scale for every FP8 token written from now on (`None`: per-token
    /// amax scales, the default). Ignored by the other dtypes.
    ///
    /// # Panics
    /// If the scale is not finite and positive.
    pub fn set_fp8_static_scale(&mut self, scale: Option<f32>) {
        if let Some(s) = scale {
            assert!(
                s.is_finite() && s > 0.0,
                "FP8 k_scale must be finite and > 0: {s}"
            );
        }
        self.fp8_static_scale = scale;
    }

    pub fn fp8_static_scale(&self) -> Option<f32> {
        self.fp8_static_scale
    }

    pub fn free_pages(&self) -> usize {
        self.pages.free_pages()
    }

    pub fn total_pages(&self) -> usize {
        self.pages.total_pages()
    }

    /// The page bookkeeping alone.
    pub fn page_tables(&self) -> &PageTables {
        &self.pages
    }

    /// The page bookkeeping, to hand out and return pages (the storage follows the slots).
    pub fn page_tables_mut(&mut self) -> &mut PageTables {
        &mut self.pages
    }

    pub fn add_sequence(&mut self) -> SeqId {
        self.pages.add_sequence()
    }

    /// Returns the sequence's pages to the free list.
    pub fn free_sequence(&mut self, seq: SeqId) -> Result<(), CacheError> {
        self.pages.free_sequence(seq)
    }

    /// Tokens cached for `seq` (written in every layer).
    pub fn seq_len(&self, seq: SeqId) -> Result<usize, CacheError> {
        self.pages.seq_len(seq)
    }

    /// The sequence's page ids, in order.
    pub fn block_table(&self, seq: SeqId) -> Result<&[u32], CacheError> {
        self.pages.block_table(seq)
    }

    /// Makes room for `new_tokens` more tokens after the current length.
    pub fn reserve(&mut self, seq: SeqId, new_tokens: usize) -> Result<(), CacheError> {
        self.pages.reserve(seq, new_tokens)
    }

    /// Marks `new_tokens` more tokens as written in every layer.
    pub fn commit(&mut self, seq: SeqId, new_tokens: usize) -> Result<(), CacheError> {
        self.pages.commit(seq, new_tokens)
    }

    fn slot(&self, seq: SeqId, pos: usize) -> Result<usize, CacheError> {
        self.pages.slot(seq, pos)
    }

    /// Writes token `pos` of `seq` in `layer`: the normalized latent and the RoPE'd key part,
    /// quantized to the cache's dtype.
    pub fn write(
        &mut self,
        layer: usize,
        seq: SeqId,
        pos: usize,
        latent: &[f32],
        rope: &[f32],
    ) -> Result<(), CacheError> {
        let (l, r) = (self.shape.latent_dim, self.shape.rope_dim);
        assert_eq!(
            (latent.len(), rope.len()),
            (l, r),
            "cache write: latent/rope lengths"
        );
        let slot = self.slot(seq, pos)?;
        let static_scale = self.fp8_static_scale;
        match &mut self.layers[layer] {
            LayerStorage::F32 { values } => {
                let entry = &mut values[slot * (l + r)..(slot + 1) * (l + r)];
                entry[..l].copy_from_slice(latent);
                entry[l..].copy_from_slice(rope);
            }
            LayerStorage::Bf16 { values } => {
                let entry = &mut values[slot * (l + r)..(slot + 1) * (l + r)];
                for (dst, &src) in entry.iter_mut().zip(latent.iter().chain(rope)) {
                    *dst = bf16::from_f32(src);
                }
            }
            LayerStorage::Fp8 {
                latent: codes,
                scales,
                rope: rope_store,
            } => {
                let scale = static_scale.unwrap_or_else(|| fp8_token_scale(latent));
                scales[slot] = scale;
                for (dst, &src) in codes[slot * l..(slot + 1) * l].iter_mut().zip(latent) {
                    *dst = f32_to_e4m3(src / scale, Overflow::Saturate);
                }
                for (dst, &src) in rope_store[slot * r..(slot + 1) * r].iter_mut().zip(rope) {
                    *dst = bf16::from_f32(src);
                }
            }
        }
        Ok(())
    }

    /// Reads token `pos` of `seq` in `layer`, dequantized, into `entry`.
    pub fn read(
        &self,
        layer: usize,
        seq: SeqId,
        pos: usize,
        entry: TokenEntry<'_>,
    ) -> Result<(), CacheError> {
        let slot = self.slot(seq, pos)?;
        self.read_slot(layer, slot, entry.latent, entry.rope);
        Ok(())
    }

    /// Reads the cache entry in physical slot `slot` of `layer`. Always inlined: into the
    /// attention's per-ISA bodies, where the widening loops vectorize for that ISA.
    #[inline(always)]
    pub fn read_slot(&self, layer: usize, slot: usize, latent: &mut [f32], rope: &mut [f32]) {
        let (l, r) = (self.shape.latent_dim, self.shape.rope_dim);
        match &self.layers[layer] {
            LayerStorage::F32 { values } => {
                let entry = &values[slot * (l + r)..(slot + 1) * (l + r)];
                latent.copy_from_slice(&entry[..l]);
                rope.copy_from_slice(&entry[l..]);
            }
            LayerStorage::Bf16 { values } => {
                let entry = &values[slot * (l + r)..(slot + 1) * (l + r)];
                for (dst, &src) in latent.iter_mut().zip(&entry[..l]) {
                    *dst = widen_bf16(src);
                }
                for (dst, &src) in rope.iter_mut().zip(&entry[l..]) {
                    *dst = widen_bf16(src);
                }
            }
            LayerStorage::Fp8 {
                latent: codes,
                scales,
                rope: rope_store,
            } => {
                let scale = scales[slot];
                for (dst, &code) in latent.iter_mut().zip(&codes[slot * l..(slot + 1) * l]) {
                    *dst = e4m3_to_f32_arith(code) * scale;
                }
                for (dst, &src) in rope.iter_mut().zip(&rope_store[slot * r..(slot + 1) * r]) {
                    *dst = widen_bf16(src);
                }
            }
        }
    }

    /// The storage of `layer`, for uploading to a device.
    pub fn raw_layer(&self, layer: usize) -> RawLayer<'_> {
        match &self.layers[layer] {
            LayerStorage::F32 { values } => RawLayer::F32 { values },
            LayerStorage::Bf16 { values } => RawLayer::Bf16 { values },
            LayerStorage::Fp8 {
                latent,
                scales,
                rope,
            } => RawLayer::Fp8 {
                latent,
                scales,
                rope,
            },
        }
    }

    /// Physical slots of tokens `0..len` of `seq`, in order.
    pub fn slots(&self, seq: SeqId, len: usize) -> Result<Vec<usize>, CacheError> {
        self.pages.slots(seq, len)
    }

    /// Bytes the cache's storage occupies.
    pub fn storage_bytes(&self) -> usize {
        self.pages.total_pages()
            * PAGE_TOKENS
            * self.shape.layers
            * self.dtype.bytes_per_token(&self.shape)
    }
}

/// The per-token FP8 scale: the token's latent amax maps to 448; an all-zero latent gets 1.
pub fn fp8_token_scale(latent: &[f32]) -> f32 {
    let amax = latent.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: LatentCacheShape = LatentCacheShape {
        layers: 2,
        latent_dim: 32,
        rope_dim: 8,
    };

    #[test]
    fn pages_are_allocated_per_sequence_and_returned() {
        let mut cache = PagedLatentCache::new(SHAPE, KvCacheDtype::Bf16, 4);
        let a = cache.add_sequence();
        let b = cache.add_sequence();
        cache.reserve(a, 65).unwrap();
        assert_eq!(cache.block_table(a).unwrap(), &[0, 1]);
        cache.reserve(b, 64).unwrap();
        assert_eq!(cache.block_table(b).unwrap(), &[2]);
        assert_eq!(
            cache.reserve(b, 200),
            Err(CacheError::Full {
                needed: 3,
                free: 1,
                total: 4
            })
        );
        cache.free_sequence(a).unwrap();
        assert_eq!(cache.free_pages(), 3);
        cache.reserve(b, 129).unwrap();
        assert_eq!(cache.block_table(b).unwrap(), &[2, 0, 1]);
        assert!(cache.commit(b, 193).is_err());
        cache.commit(b, 129).unwrap();
        assert_eq!(cache.seq_len(b).unwrap(), 129);
    }

    #[test]
    fn bf16_and_fp8_round_trip_within_their_precision() {
        for dtype in [KvCacheDtype::F32, KvCacheDtype::Bf16, KvCacheDtype::Fp8E4m3] {
            let mut cache = PagedLatentCache::new(SHAPE, dtype, 2);
            let seq = cache.add_sequence();
            cache.reserve(seq, 70).unwrap();
            let latent: Vec<f32> = (0..32).map(|i| ((i as f32) * 0.37).sin() * 3.0).collect();
            let rope: Vec<f32> = (0..8).map(|i| i as f32 * 0.1 - 0.3).collect();
            cache.write(1, seq, 66, &latent, &rope).unwrap();
            let (mut l, mut r) = (vec![0.0; 32], vec![0.0; 8]);
            cache
                .read(
                    1,
                    seq,
                    66,
                    TokenEntry {
                        latent: &mut l,
                        rope: &mut r,
                    },
                )
                .unwrap();
            let amax = 3.0f32;
            // BF16 keeps 8 significant bits; E4M3 keeps 4, relative to the token's own scale.
            let tol = match dtype {
                KvCacheDtype::F32 => 0.0,
                KvCacheDtype::Bf16 => amax / 256.0,
                KvCacheDtype::Fp8E4m3 => amax / 16.0,
            };
            for (a, b) in latent.iter().zip(&l) {
                assert!((a - b).abs() <= tol, "{dtype:?}: {a} vs {b}");
            }
            for (a, b) in rope.iter().zip(&r) {
                assert!((a - b).abs() <= 0.3 / 256.0 + 1e-6, "{dtype:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn a_static_fp8_scale_is_stored_for_every_token_and_saturates() {
        let mut cache = PagedLatentCache::new(SHAPE, KvCacheDtype::Fp8E4m3, 1);
        let seq = cache.add_sequence();
        cache.reserve(seq, 2).unwrap();
        cache.set_fp8_static_scale(Some(0.01));
        let latent: Vec<f32> = (0..32).map(|i| i as f32 * 0.2 - 3.0).collect();
        cache.write(0, seq, 0, &latent, &[0.0; 8]).unwrap();
        let (mut l, mut r) = (vec![0.0; 32], vec![0.0; 8]);
        cache.read_slot(0, 0, &mut l, &mut r);
        for (a, b) in latent.iter().zip(&l) {
            // 448 · 0.01 = 4.48 covers the range; E4M3 keeps 4 significant bits.
            assert!((a - b).abs() <= a.abs() / 16.0 + 0.01 / 512.0, "{a} vs {b}");
        }
        // Beyond 448 · k_scale the codes saturate.
        cache.write(0, seq, 1, &[100.0; 32], &[0.0; 8]).unwrap();
        cache.read_slot(0, 1, &mut l, &mut r);
        assert!(l.iter().all(|&v| (v - 4.48).abs() < 1e-5), "{l:?}");
    }

    #[test]
    fn cache_sizes_match_the_model_facts() {
        let kimi = LatentCacheShape {
            layers: 61,
            latent_dim: 512,
            rope_dim: 64,
        };
        assert_eq!(KvCacheDtype::Bf16.bytes_per_token(&kimi), 1152);
        assert_eq!(KvCacheDtype::Fp8E4m3.bytes_per_token(&kimi), 644);
    }
}
