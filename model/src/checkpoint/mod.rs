//! Loading a checkpoint directory as NVIDIA ships it: `config.json`, `hf_quant_config.json`,
//! sharded safetensors with `model.safetensors.index.json`, tensor names with the
//! `language_model.` prefix (Kimi-K2.5) or without it (DeepSeek-V3 family). Shards are
//! memory-mapped; weights are borrowed from the mappings, never copied.

pub mod embedded;
pub mod hub;
pub mod nvfp4_file;
pub mod tensor_file;
pub mod weights;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use half::bf16;
use indicatif::{ProgressBar, ProgressStyle};
use kernels::files::{FileError, TEXT_FILE_LIMIT, read_text_bounded};
use kernels::formats::NVFP4_BLOCK;
use safetensors::Dtype;
use serde::Deserialize;
use thiserror::Error;

use crate::arch::config::{CheckpointConfig, ConfigError, KvCacheQuant, ModelConfig};
use crate::arch::names;
use crate::arch::shard::TpShard;
use crate::checkpoint::tensor_file::{TensorFile, TensorFileError};
use crate::checkpoint::weights::*;
use crate::input::InvalidInput;

pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Prefix of the text model's tensors in Kimi-K2.5 (a multimodal wrapper).
pub use crate::arch::names::KIMI_K25_PREFIX;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Tensor(#[from] TensorFileError),
    #[error(transparent)]
    File(#[from] FileError),
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    /// A `--checkpoint` (or `flag`) that does not exist or cannot be read.
    #[error("{flag} {}: {why}", path.display())]
    Missing {
        flag: &'static str,
        path: PathBuf,
        why: String,
    },
    /// A repository id whose files `hf download` has not put in the local cache.
    #[error(
        "{flag} {repo}: not in the Hugging Face cache ({looked_in}); download it with `hf download {repo}`"
    )]
    NotInHubCache {
        flag: &'static str,
        repo: String,
        looked_in: String,
    },
}

#[derive(Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

/// Where a CPU forward pass reads the weights from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WeightPlacement {
    /// The checkpoint's files, memory-mapped (4 KiB pages of the page cache), populated at
    /// load: no copy, the least memory.
    Mapped,
    /// A copy in anonymous memory on 2 MiB transparent huge pages: fewer TLB misses while a
    /// decode step streams the weights (1.5x the read bandwidth on a KVM guest, measured), at
    /// the cost of the copy's RAM and time.
    HugePages,
}

impl WeightPlacement {
    /// Huge pages where the kernel offers them to a process that asks
    /// (`/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise`) and the copy
    /// fits in half of the memory available now; else the mapping.
    pub fn auto(checkpoint_bytes: usize) -> Self {
        let thp = read_text_bounded(
            Path::new("/sys/kernel/mm/transparent_hugepage/enabled"),
            TEXT_FILE_LIMIT,
        )
        .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"));
        match crate::input::available_memory_bytes() {
            Some(bytes) if thp && checkpoint_bytes as u64 <= bytes / 2 => Self::HugePages,
            _ => Self::Mapped,
        }
    }
}

/// An opened checkpoint: its configuration and its memory-mapped shards.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: CheckpointConfig,
    /// `language_model.` for Kimi-K2.5, empty for DeepSeek-V3 / Kimi-K2.
    pub prefix: String,
    shards: Vec<Arc<TensorFile>>,
    shard_of: HashMap<String, usize>,
    /// The file that lists the tensors (the index, or the single shard), for error messages.
    listing: PathBuf,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let config = CheckpointConfig::from_dir(dir)?;
        let index_path = dir.join(INDEX_FILE);
        let invalid = |path: &Path, message: String| CheckpointError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let (listing, weight_map): (PathBuf, BTreeMap<String, String>) = if index_path.exists() {
            let text = read_text_bounded(&index_path, TEXT_FILE_LIMIT)?;
            let weight_map = parse_index(&text).map_err(|e| invalid(&index_path, e))?;
            (index_path, weight_map)
        } else {
            let single = dir.join("model.safetensors");
            if !single.exists() {
                return Err(invalid(
                    dir,
                    format!("neither {INDEX_FILE} nor model.safetensors is here"),
                ));
            }
            let file = TensorFile::open(&single)?;
            (
                single,
                file.names()
                    .map(|n| (n.to_string(), "model.safetensors".to_string()))
                    .collect(),
            )
        };

        let mut shard_names: Vec<&String> = weight_map.values().collect();
        shard_names.sort();
        shard_names.dedup();
        let progress = progress_bar(shard_names.len() as u64, "mapping shards");
        let mut shards = Vec::new();
        let mut shard_index = HashMap::new();
        for name in shard_names {
            let file = TensorFile::open(dir.join(name))?;
            shard_index.insert(name.clone(), shards.len());
            shards.push(Arc::new(file));
            progress.inc(1);
        }
        progress.finish_and_clear();
        let mut shard_of = HashMap::new();
        for (tensor, shard) in &weight_map {
            let i = shard_index[shard];
            if !shards[i].contains(tensor) {
                return Err(invalid(
                    &listing,
                    format!("lists tensor `{tensor}` in shard {shard}, which does not contain it"),
                ));
            }
            shard_of.insert(tensor.clone(), i);
        }
        let prefix = if shard_of.contains_key(&format!(
            "{KIMI_K25_PREFIX}{}",
            names::embed_tokens().weight()
        )) {
            KIMI_K25_PREFIX.to_string()
        } else if shard_of.contains_key(&names::embed_tokens().weight()) {
            String::new()
        } else {
            return Err(invalid(
                &listing,
                format!(
                    "no `{}` (with or without the `{KIMI_K25_PREFIX}` prefix)",
                    names::embed_tokens().weight()
                ),
            ));
        };
        check_layers_and_experts(&config.model, &prefix, shard_of.keys())
            .map_err(|message| invalid(&listing, message))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            prefix,
            shards,
            shard_of,
            listing,
        })
    }

    /// Every floating-point tensor holding a NaN or an infinity, with its file and the first
    /// such element. Reads all the weights, so `model inspect` runs it, not every load; a run
    /// stops at the first layer whose output is not finite instead.
    pub fn non_finite_tensors(&self) -> Result<Vec<(String, PathBuf, usize)>, CheckpointError> {
        use rayon::prelude::*;
        let mut names: Vec<(&str, &TensorFile)> = self.tensor_names().collect();
        names.sort_by_key(|(n, _)| *n);
        let found = names
            .par_iter()
            .map(|(name, file)| {
                Ok(file
                    .first_non_finite(name)?
                    .map(|i| (name.to_string(), file.path().to_path_buf(), i)))
            })
            .collect::<Result<Vec<_>, TensorFileError>>()?;
        Ok(found.into_iter().flatten().collect())
    }

    /// The latent cache dtype the checkpoint asks for (`kv_cache_quant_algo`), else BF16.
    pub fn kv_cache_dtype(&self) -> kernels::mla::cache::KvCacheDtype {
        use kernels::mla::cache::KvCacheDtype;
        match self
            .config
            .quant
            .as_ref()
            .and_then(|q| q.kv_cache_quant_algo)
        {
            Some(KvCacheQuant::Fp8) => KvCacheDtype::Fp8E4m3,
            None => KvCacheDtype::Bf16,
        }
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.config.model
    }

    /// Every tensor name in the checkpoint, with its shard.
    pub fn tensor_names(&self) -> impl Iterator<Item = (&str, &TensorFile)> {
        self.shard_of
            .iter()
            .map(|(n, &i)| (n.as_str(), self.shards[i].as_ref()))
    }

    pub fn shards(&self) -> &[Arc<TensorFile>] {
        &self.shards
    }

    pub fn contains(&self, name: &str) -> bool {
        self.shard_of
            .contains_key(&format!("{}{name}", self.prefix))
    }

    /// The shard holding `name` (without prefix) and the full tensor name.
    pub fn locate(&self, name: &str) -> Result<(&Arc<TensorFile>, String), CheckpointError> {
        let full = format!("{}{name}", self.prefix);
        match self.shard_of.get(&full) {
            Some(&i) => Ok((&self.shards[i], full)),
            None => Err(CheckpointError::Invalid {
                path: self.listing.clone(),
                message: format!("tensor `{full}` is missing"),
            }),
        }
    }

    pub fn bf16(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<Bf16Weight, CheckpointError> {
        let (file, full) = self.locate(name)?;
        file.expect_shape(&full, &[rows, cols])?;
        let range = file.byte_range(&full, &[Dtype::BF16])?;
        let data = if bytemuck::try_cast_slice::<u8, bf16>(file.mapped(range.clone())).is_ok() {
            Bf16Data::Mapped {
                file: file.clone(),
                range,
            }
        } else {
            let bytes = file.mapped(range);
            Bf16Data::Owned(Arc::new(
                bytes
                    .chunks_exact(2)
                    .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                    .collect(),
            ))
        };
        Ok(Bf16Weight { rows, cols, data })
    }

    /// A 1-D floating-point vector (norm weights, biases) widened to `f32`.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, CheckpointError> {
        let (file, full) = self.locate(name)?;
        file.expect_shape(&full, &[len])?;
        let values = file.f32_values(&full)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(file
                .bad_value(&full, format!("element {i} is {}", values[i]))
                .into());
        }
        Ok(values)
    }

    /// An NVFP4 linear layer `{module}.weight/weight_scale/weight_scale_2/input_scale`.
    pub fn nvfp4(
        &self,
        module: &names::Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<Nvfp4Weight, CheckpointError> {
        let (file, weight) = self.locate(&module.weight())?;
        file.expect_shape(&weight, &[rows, cols / 2])?;
        let packed = file.byte_range(&weight, &[Dtype::U8])?;
        let (scale_file, scale_name) = self.locate(&module.weight_scale())?;
        scale_file.expect_shape(&scale_name, &[rows, cols / NVFP4_BLOCK])?;
        let scales = scale_file.byte_range(&scale_name, &[Dtype::F8_E4M3])?;
        if let Some(i) = scale_file
            .mapped(scales.clone())
            .iter()
            .position(|&c| c & 0x7F == 0x7F)
        {
            return Err(scale_file
                .bad_value(
                    &scale_name,
                    format!("block scale {i} (row {}) is NaN", i / (cols / NVFP4_BLOCK)),
                )
                .into());
        }
        let (f2, n2) = self.locate(&module.weight_scale_2())?;
        let global_scale = f2.positive_scale(&n2)?;
        let (fi, ni) = self.locate(&module.input_scale())?;
        let input_scale = fi.positive_scale(&ni)?;
        Ok(Nvfp4Weight {
            rows,
            cols,
            packed: ByteData::Mapped {
                file: file.clone(),
                range: packed,
            },
            block_scales: ByteData::Mapped {
                file: scale_file.clone(),
                range: scales,
            },
            global_scale,
            input_scale,
        })
    }

    /// A routed expert's projection, NVFP4 or BF16 depending on what the checkpoint holds.
    pub fn expert_matrix(
        &self,
        module: &names::Tensor,
        rows: usize,
        cols: usize,
    ) -> Result<ExpertMatrix, CheckpointError> {
        let (file, weight) = self.locate(&module.weight())?;
        if file.info(&weight)?.dtype == Dtype::U8 {
            if self.config.quant.is_none() {
                // Run anyway, the checkpoint's KV-cache choice (FP8 for Kimi-K2.5-NVFP4) would
                // silently become BF16.
                return Err(CheckpointError::Invalid {
                    path: file.path().to_path_buf(),
                    message: format!(
                        "tensor `{weight}` is NVFP4 (U8), but {} has no hf_quant_config.json and config.json no quantization_config; restore hf_quant_config.json from the release",
                        self.dir.display()
                    ),
                });
            }
            Ok(ExpertMatrix::Nvfp4(self.nvfp4(module, rows, cols)?))
        } else {
            Ok(ExpertMatrix::Bf16(self.bf16(
                &module.weight(),
                rows,
                cols,
            )?))
        }
    }

    /// [`Self::place_weights`], timed: where the weights were copied into huge pages, how
    /// much and how long it took (`"401.4 MiB in 0.39 s"`), for the line that says so.
    pub fn place_weights_timed(&mut self, placement: WeightPlacement) -> Option<String> {
        let started = std::time::Instant::now();
        (self.place_weights(placement) == WeightPlacement::HugePages).then(|| {
            format!(
                "{:.1} MiB in {:.2} s",
                self.file_bytes() as f64 / (1 << 20) as f64,
                started.elapsed().as_secs_f64()
            )
        })
    }

    /// Puts the weights where a CPU forward pass reads them fastest, as `placement` asks, and
    /// returns where they went: [`WeightPlacement::HugePages`] copies every shard into huge
    /// pages ([`TensorFile::copy_into_huge_pages`]) with a progress bar, and falls back to the
    /// populated mapping, with a warning, when a copy cannot be made (out of memory).
    /// Call before [`load_weights`](Self::load_weights): the weights point into the shards.
    pub fn place_weights(&mut self, placement: WeightPlacement) -> WeightPlacement {
        if placement == WeightPlacement::HugePages {
            let total: usize = self.shards.iter().map(|s| s.file_bytes()).sum();
            let progress = bytes_progress(Some(total as u64), "copying weights into huge pages");
            let mut copies = Vec::with_capacity(self.shards.len());
            for shard in &self.shards {
                match shard.copy_into_huge_pages() {
                    Ok(copy) => copies.push(Arc::new(copy)),
                    Err(e) => {
                        progress.finish_and_clear();
                        eprintln!(
                            "warning: {e}; reading the weights from the file mapping instead"
                        );
                        self.populate();
                        return WeightPlacement::Mapped;
                    }
                }
                progress.inc(shard.file_bytes() as u64);
            }
            progress.finish_and_clear();
            self.shards = copies;
            return WeightPlacement::HugePages;
        }
        self.populate();
        WeightPlacement::Mapped
    }

    /// Bytes of every shard file.
    pub fn file_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.file_bytes()).sum()
    }

    /// Maps every page of every shard now ([`TensorFile::populate`]), in parallel, with a
    /// progress bar: for a model the CPU computes on, so that the first request does not pay
    /// the page faults of the whole model (llama.cpp maps with `MAP_POPULATE` for the same
    /// reason).
    pub fn populate(&self) {
        use rayon::prelude::*;
        let total = self.file_bytes() as u64;
        let progress = bytes_progress(Some(total), "reading weights");
        self.shards.par_iter().for_each(|shard| {
            shard.populate();
            progress.inc(shard.file_bytes() as u64);
        });
        progress.finish_and_clear();
    }

    /// Loads every weight the text model needs, with a progress bar over layers.
    pub fn load_weights(&self) -> Result<ModelWeights, CheckpointError> {
        let c = self.model_config().clone();
        let progress = progress_bar(c.num_hidden_layers as u64, "loading layers");
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for layer in 0..c.num_hidden_layers {
            layers.push(self.load_layer(&c, layer)?);
            progress.inc(1);
        }
        progress.finish_and_clear();
        let embed = self.bf16(&names::embed_tokens().weight(), c.vocab_size, c.hidden_size)?;
        let lm_head = if c.tie_word_embeddings && !self.contains(&names::lm_head().weight()) {
            embed.clone()
        } else {
            self.bf16(&names::lm_head().weight(), c.vocab_size, c.hidden_size)?
        };
        Ok(ModelWeights {
            embed,
            layers,
            norm: self.vector(&names::norm().weight(), c.hidden_size)?,
            lm_head,
            vocab_rows: 0..c.vocab_size,
        })
    }

    fn load_layer(&self, c: &ModelConfig, layer: usize) -> Result<LayerWeights, CheckpointError> {
        let p = names::layer(layer);
        let heads = c.num_attention_heads;
        let q = match c.q_lora_rank {
            Some(rank) => QueryProjection::LowRank {
                a: self.bf16(&p.q_a_proj().weight(), rank, c.hidden_size)?,
                norm: self.vector(&p.q_a_layernorm().weight(), rank)?,
                b: self.bf16(&p.q_b_proj().weight(), heads * c.qk_head_dim(), rank)?,
            },
            None => QueryProjection::Full(self.bf16(
                &p.q_proj().weight(),
                heads * c.qk_head_dim(),
                c.hidden_size,
            )?),
        };
        let attention = AttentionWeights {
            q,
            kv_a: self.bf16(
                &p.kv_a_proj_with_mqa().weight(),
                c.latent_cache_dim(),
                c.hidden_size,
            )?,
            kv_a_norm: self.vector(&p.kv_a_layernorm().weight(), c.kv_lora_rank)?,
            kv_b: self.bf16(
                &p.kv_b_proj().weight(),
                heads * (c.qk_nope_head_dim + c.v_head_dim),
                c.kv_lora_rank,
            )?,
            o: self.bf16(&p.o_proj().weight(), c.hidden_size, heads * c.v_head_dim)?,
        };
        let dense = |mlp: names::Mlp, inter: usize| -> Result<DenseMlpWeights, CheckpointError> {
            Ok(DenseMlpWeights {
                gate: self.bf16(&mlp.gate_proj().weight(), inter, c.hidden_size)?,
                up: self.bf16(&mlp.up_proj().weight(), inter, c.hidden_size)?,
                down: self.bf16(&mlp.down_proj().weight(), c.hidden_size, inter)?,
            })
        };
        let mlp = if c.is_moe_layer(layer) {
            let inter = c.moe_intermediate_size;
            let experts = (0..c.n_routed_experts)
                .map(|e| {
                    let m = p.routed_expert(e);
                    Ok(ExpertWeights {
                        gate: self.expert_matrix(&m.gate_proj(), inter, c.hidden_size)?,
                        up: self.expert_matrix(&m.up_proj(), inter, c.hidden_size)?,
                        down: self.expert_matrix(&m.down_proj(), c.hidden_size, inter)?,
                    })
                })
                .collect::<Result<Vec<_>, CheckpointError>>()?;
            MlpWeights::Moe(MoeWeights {
                router: self.bf16(&p.router().weight(), c.n_routed_experts, c.hidden_size)?,
                correction_bias: self.vector(&p.e_score_correction_bias(), c.n_routed_experts)?,
                experts,
                shared: if c.n_shared_experts > 0 {
                    Some(dense(p.shared_experts(), inter * c.n_shared_experts)?)
                } else {
                    None
                },
            })
        } else {
            MlpWeights::Dense(dense(p.mlp(), c.intermediate_size)?)
        };
        Ok(LayerWeights {
            input_norm: self.vector(&p.input_layernorm().weight(), c.hidden_size)?,
            attention,
            post_attention_norm: self
                .vector(&p.post_attention_layernorm().weight(), c.hidden_size)?,
            mlp,
        })
    }
}

/// Parses `model.safetensors.index.json`: its `weight_map`, with every shard confined to the
/// checkpoint folder (a relative path without `..`, as Hugging Face writes them; symbolic links
/// inside the folder, as in the Hugging Face cache, are followed when the shard is opened).
pub fn parse_index(text: &str) -> Result<BTreeMap<String, String>, String> {
    let index: IndexFile = serde_json::from_str(text).map_err(|e| format!("invalid index: {e}"))?;
    for (tensor, shard) in &index.weight_map {
        let path = Path::new(shard);
        let confined = !shard.is_empty()
            && path
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !confined {
            return Err(format!(
                "tensor `{tensor}` is listed in shard {shard:?}, which is not a file inside the checkpoint folder (a relative path without `..`)"
            ));
        }
    }
    Ok(index.weight_map)
}

/// `model.layers.L.` and `model.layers.L.mlp.experts.E.` in tensor names against the config:
/// a checkpoint must hold every layer the config lists and nothing beyond them (but the
/// multi-token-prediction layers), and no expert beyond `n_routed_experts`.
fn check_layers_and_experts<'a>(
    c: &ModelConfig,
    prefix: &str,
    names: impl Iterator<Item = &'a String>,
) -> Result<(), String> {
    let layers_prefix = format!("{prefix}{}", names::LAYERS);
    let index = |text: &str| -> Option<(usize, usize)> {
        let digits = text.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 || !text[digits..].starts_with('.') {
            return None;
        }
        // Too many digits for usize is still a layer number, beyond any config.
        Some((text[..digits].parse().unwrap_or(usize::MAX), digits + 1))
    };
    let mut present = std::collections::BTreeSet::new();
    for name in names {
        let Some(rest) = name.strip_prefix(&layers_prefix) else {
            continue;
        };
        let Some((layer, skip)) = index(rest) else {
            continue;
        };
        present.insert(layer);
        if let Some(expert) = rest[skip..]
            .strip_prefix(names::ROUTED_EXPERTS)
            .and_then(index)
            && layer < c.num_hidden_layers
            && expert.0 >= c.n_routed_experts
        {
            return Err(format!(
                "holds expert {} of layer {layer} (`{name}`), but config.json has n_routed_experts = {}",
                expert.0, c.n_routed_experts
            ));
        }
    }
    let listed = c.num_hidden_layers + c.num_nextn_predict_layers;
    if let Some(&last) = present.last()
        && last >= listed
    {
        let first = present.range(listed..).next().copied().unwrap_or(last);
        return Err(format!(
            "holds layers {first} to {last}, which config.json does not list (num_hidden_layers = {}, num_nextn_predict_layers = {}): the config and the weights do not belong together",
            c.num_hidden_layers, c.num_nextn_predict_layers
        ));
    }
    if let Some(missing) = (0..c.num_hidden_layers).find(|l| !present.contains(l)) {
        return Err(format!(
            "config.json lists {} layers, but no tensor of layer {missing} (`{layers_prefix}{missing}.…`) is here",
            c.num_hidden_layers
        ));
    }
    Ok(())
}

/// A progress bar on stderr that stays silent when stderr is not a terminal.
/// A progress bar over `len` bytes (or an open count where `len` is `None`), with the rate.
pub fn bytes_progress(len: Option<u64>, what: &str) -> ProgressBar {
    let (bar, template) = match len {
        Some(len) => (
            ProgressBar::new(len),
            "{msg:>16} [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ({elapsed})",
        ),
        None => (
            ProgressBar::no_length(),
            "{msg:>16} {binary_bytes} {binary_bytes_per_sec} ({elapsed})",
        ),
    };
    bar.set_style(
        ProgressStyle::with_template(template)
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

pub fn progress_bar(len: u64, what: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg:>16} [{bar:40}] {pos}/{len} ({elapsed})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// Opens `dir` and loads the weights of `shard` of it, where `placement` says (the CPU
/// backend's choice; the mapping elsewhere).
pub fn load_model(
    dir: &Path,
    shard: TpShard,
    placement: impl FnOnce(&Checkpoint) -> WeightPlacement,
) -> anyhow::Result<Model> {
    let mut checkpoint = Checkpoint::open(dir)?;
    let config = checkpoint.model_config().clone();
    check_tensor_parallel(dir, &config, shard.world)?;
    let asked = placement(&checkpoint);
    if let Some(copied) = checkpoint.place_weights_timed(asked)
        && shard.rank == 0
        && crate::start_details::start_details_shown()
    {
        eprintln!(
            "weights: a copy on 2 MiB pages ({copied}; --weights mapped reads the files' mapping)"
        );
    }
    let weights = checkpoint
        .load_weights()?
        .shard(&config, shard)
        .map_err(InvalidInput)?;
    Ok(Model::new(config, weights))
}

pub fn check_tensor_parallel(dir: &Path, config: &ModelConfig, world: usize) -> anyhow::Result<()> {
    config.check_tensor_parallel(world).map_err(|e| {
        InvalidInput(format!(
            "{}: tensor parallelism over {world} ranks: {e}",
            dir.display()
        ))
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::input::mem_available_in;

    #[test]
    fn mem_available_is_read_from_meminfo_in_bytes() {
        let meminfo =
            "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   23000000 kB\n";
        assert_eq!(mem_available_in(meminfo), Some(23_000_000 * 1024));
        assert_eq!(mem_available_in("MemTotal: 5 kB\n"), None);
        assert_eq!(mem_available_in("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn auto_placement_keeps_the_mapping_when_the_copy_does_not_fit() {
        assert_eq!(
            WeightPlacement::auto(usize::MAX / 2),
            WeightPlacement::Mapped
        );
    }
}
