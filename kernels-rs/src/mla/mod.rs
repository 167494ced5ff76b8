//! MLA decode attention over a paged latent KV cache.
//!
//! DeepSeek-V3's multi-head latent attention caches, per token and layer, one normalized latent
//! `c` (`kv_lora_rank` values: 512 in Kimi-K2.5) and one RoPE'd key part `k_pe`
//! (`qk_rope_head_dim`: 64), shared by all heads. With the absorbed formulation a query head `h` arrives as `q_abs[h]` (its no-PE query
//! already multiplied into latent space) and `q_pe[h]`, and attention is
//! `softmax_t((q_abs·c_t + q_pe·kpe_t) · scale) · c_t`, leaving the output in latent space.
//!
//! - [`cache`]: pages of 64 tokens, block tables, BF16 or FP8 E4M3 storage.
//! - [`reference`]: the CPU reference of the attention (FP32, two passes).
//! - [`cpu`]: the fast CPU path (one pass, online softmax, split-KV with an exact LSE merge).
//! - [`kernel_model`]: a lane-level CPU model of the CUDA kernel that checks its index math.
//! - [`tactic`]: the typed tactic space of the CUDA kernel and its shared-memory layout.
//! - `mla_decode.cu` (beside this file): split-KV decode, LSE combine and cache append kernels
//!   for sm_120a and sm_90a; [`launch`] launches them on any
//!   [`Device`](crate::device::Device), and `gpu_check.md` describes the on-GPU check
//!   (`bin/mla-gpu-check.rs`).
//! - [`golden_hash`]: the closed-form cache contents of the MLA goldens.
//! - [`check`]: the golden and append checks every device's runs go through.

pub mod cache;
pub mod check;
pub mod cpu;
pub mod golden_hash;
pub mod kernel_model;
pub mod launch;
pub mod reference;
pub mod tactic;

pub use cache::{CacheError, KvCacheDtype, LatentCacheShape, PAGE_TOKENS, PagedLatentCache, SeqId};
pub use tactic::{MlaDims, MlaKind, MlaSmem, MlaSplitTactic, MlaTactic};
