//! A damaged checkpoint fails with an error that names the file and the tensor, never a panic.

use std::path::{Path, PathBuf};

use model::checkpoint::Checkpoint;
use project_tests::golden_path;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// A writable copy of the `kimi-tiny` golden checkpoint.
fn copy_checkpoint() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let src = golden_path("models").join("kimi-tiny");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.path().join(path.file_name().unwrap())).unwrap();
    }
    let root = dir.path().to_path_buf();
    (dir, root)
}

fn shard_holding(dir: &Path, tensor: &str) -> PathBuf {
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    dir.join(index["weight_map"][tensor].as_str().unwrap())
}

/// Rewrites the shard holding `tensor`, replacing that tensor by `(dtype, shape, bytes)`.
fn replace_tensor(dir: &Path, tensor: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) {
    let path = shard_holding(dir, tensor);
    let data = std::fs::read(&path).unwrap();
    let shard = SafeTensors::deserialize(&data).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = shard
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect();
    for t in tensors.iter_mut().filter(|t| t.0 == tensor) {
        *t = (tensor.to_string(), dtype, shape.clone(), bytes.clone());
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn load_error(dir: &Path) -> String {
    match Checkpoint::open(dir).and_then(|c| c.load_weights().map(|_| ())) {
        Ok(()) => panic!("the damaged checkpoint loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn truncated_shard_names_the_shard() {
    let (_keep, dir) = copy_checkpoint();
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 1000]).unwrap();
    let err = load_error(&dir);
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let (_keep, dir) = copy_checkpoint();
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let name = "language_model.model.layers.1.self_attn.o_proj.weight";
    index["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove(name)
        .unwrap();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let err = load_error(&dir);
    assert!(err.contains(name) && err.contains("missing"), "{err}");
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let (_keep, dir) = copy_checkpoint();
    let name = "language_model.model.layers.2.self_attn.kv_a_layernorm.weight";
    replace_tensor(&dir, name, Dtype::BF16, vec![32], vec![0; 64]);
    let err = load_error(&dir);
    assert!(
        err.contains(name) && err.contains("[32]") && err.contains("[64]"),
        "{err}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let (_keep, dir) = copy_checkpoint();
    let name = "language_model.model.layers.1.mlp.experts.3.up_proj.weight_scale";
    let shape = vec![64, 256 / 16];
    replace_tensor(&dir, name, Dtype::U8, shape, vec![0x38; 64 * 16]);
    let err = load_error(&dir);
    assert!(err.contains(name) && err.contains("F8_E4M3"), "{err}");
}

#[test]
fn nan_scales_are_named() {
    let (_keep, dir) = copy_checkpoint();
    let name = "language_model.model.layers.2.mlp.experts.0.down_proj.weight_scale";
    let mut scales = vec![0x38u8; 256 * (64 / 16)];
    scales[5] = 0x7F;
    replace_tensor(&dir, name, Dtype::F8_E4M3, vec![256, 64 / 16], scales);
    let err = load_error(&dir);
    assert!(err.contains(name) && err.contains("NaN"), "{err}");

    let (_keep, dir) = copy_checkpoint();
    let name = "language_model.model.layers.1.mlp.experts.7.gate_proj.weight_scale_2";
    replace_tensor(
        &dir,
        name,
        Dtype::F32,
        vec![],
        f32::INFINITY.to_le_bytes().to_vec(),
    );
    let err = load_error(&dir);
    assert!(err.contains(name) && err.contains("inf"), "{err}");
}

#[test]
fn unknown_quant_algo_is_named() {
    let (_keep, dir) = copy_checkpoint();
    let path = dir.join("hf_quant_config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"NVFP4\"", "\"W4A8_AWQ\"");
    std::fs::write(&path, text).unwrap();
    let err = load_error(&dir);
    assert!(
        err.contains("hf_quant_config.json") && err.contains("W4A8_AWQ"),
        "{err}"
    );
}

#[test]
fn fp8_kv_cache_request_is_honoured() {
    let checkpoint = Checkpoint::open(&golden_path("models").join("kimi-tiny")).unwrap();
    let quant = checkpoint.config.quant.as_ref().unwrap();
    assert_eq!(
        quant.kv_cache_quant_algo,
        Some(model::arch::config::KvCacheQuant::Fp8)
    );
    assert_eq!(checkpoint.prefix, "language_model.");
}
