//! Bit-exact comparison of our number formats with PyTorch and NVIDIA ModelOpt, on the goldens
//! written by `golden/gen_formats.py`.

use kernels::formats::e4m3::{Overflow, e4m3_to_f32, f32_to_e4m3};
use kernels::formats::nvfp4::Nvfp4Matrix;
use model::checkpoint::nvfp4_file::read_nvfp4;
use model::checkpoint::tensor_file::TensorFile;
use project_tests::golden_path;
use safetensors::Dtype;

/// Asserts two byte slices are equal, reporting the first differing position.
fn assert_bytes_eq(what: &str, ours: &[u8], golden: &[u8]) {
    assert_eq!(ours.len(), golden.len(), "{what}: length");
    if let Some(i) = ours.iter().zip(golden).position(|(a, b)| a != b) {
        let mismatches = ours.iter().zip(golden).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {mismatches} bytes differ; first at {i}: ours {:#04x}, golden {:#04x}",
            ours[i], golden[i]
        );
    }
}

/// Asserts two float slices are bit-identical.
fn assert_f32_bits_eq(what: &str, ours: &[f32], golden: &[f32]) {
    assert_eq!(ours.len(), golden.len(), "{what}: length");
    if let Some(i) = ours
        .iter()
        .zip(golden)
        .position(|(a, b)| a.to_bits() != b.to_bits())
    {
        panic!(
            "{what}: first difference at {i}: ours {:e}, golden {:e}",
            ours[i], golden[i]
        );
    }
}

fn case_names(file: &TensorFile) -> Vec<String> {
    let names: Vec<String> = file
        .names()
        .filter_map(|n| n.strip_suffix(".input"))
        .map(str::to_string)
        .collect();
    assert!(!names.is_empty(), "{}: no cases", file.path().display());
    names
}

#[test]
fn e4m3_matches_torch_on_every_input_and_code() {
    let file = TensorFile::open(golden_path("e4m3.safetensors")).unwrap();
    for (inputs, codes) in [("inputs", "codes"), ("bf16_inputs", "bf16_codes")] {
        let inputs = file.f32_values(inputs).unwrap();
        let golden = file.u8_values(codes, &[Dtype::U8]).unwrap();
        let ours: Vec<u8> = inputs
            .iter()
            .map(|&x| f32_to_e4m3(x, Overflow::Saturate))
            .collect();
        assert_bytes_eq(codes, &ours, golden);
        assert!(inputs.len() > 5000, "{} inputs", inputs.len());
    }
    let decoded = file.f32_values("decoded_all_codes").unwrap();
    assert_eq!(decoded.len(), 256);
    for (code, &golden) in decoded.iter().enumerate() {
        let ours = e4m3_to_f32(code as u8);
        assert!(
            ours.to_bits() == golden.to_bits() || (ours.is_nan() && golden.is_nan()),
            "code {code}: {ours} vs {golden}"
        );
    }
}

#[test]
fn nvfp4_weight_quantization_is_bit_exact_with_modelopt() {
    let file = TensorFile::open(golden_path("nvfp4_weights.safetensors")).unwrap();
    let (mut tensors, mut bytes) = (0, 0);
    for case in case_names(&file) {
        let input_name = format!("{case}.input");
        let shape = file.info(&input_name).unwrap().shape.clone();
        let (rows, cols) = (shape[0], shape[1]);
        let input = file.f32_values(&input_name).unwrap();
        let ours = Nvfp4Matrix::quantize_weight(&input, rows, cols).unwrap();
        let golden = read_nvfp4(&file, &format!("{case}.weight")).unwrap();

        assert_eq!(
            ours.global_scale.to_bits(),
            golden.global_scale.to_bits(),
            "{case}: weight_scale_2"
        );
        assert_bytes_eq(
            &format!("{case}.weight_scale"),
            &ours.block_scales,
            &golden.block_scales,
        );
        assert_bytes_eq(&format!("{case}.weight"), &ours.packed, &golden.packed);
        let dequant = file.f32_values(&format!("{case}.dequant")).unwrap();
        assert_f32_bits_eq(&format!("{case}.dequant"), &golden.dequantize(), &dequant);
        tensors += 1;
        bytes += ours.packed.len() + ours.block_scales.len() + 4;
    }
    println!("compared {tensors} NVFP4 weight tensors, {bytes} bytes, bit for bit");
    assert!(tensors >= 10);
}

#[test]
fn nvfp4_activation_fake_quant_is_bit_exact_with_modelopt() {
    let file = TensorFile::open(golden_path("nvfp4_activations.safetensors")).unwrap();
    for case in case_names(&file) {
        let input_name = format!("{case}.input");
        let shape = file.info(&input_name).unwrap().shape.clone();
        let input = file.f32_values(&input_name).unwrap();
        let input_scale = file.positive_scale(&format!("{case}.input_scale")).unwrap();
        let ours = Nvfp4Matrix::quantize_with_global_scale(&input, shape[0], shape[1], input_scale)
            .unwrap();
        let codes = file
            .u8_values(&format!("{case}.codes"), &[Dtype::U8])
            .unwrap();
        let scales = file
            .u8_values(&format!("{case}.block_scales"), &[Dtype::F8_E4M3])
            .unwrap();
        assert_bytes_eq(&format!("{case}.block_scales"), &ours.block_scales, scales);
        assert_bytes_eq(&format!("{case}.codes"), &ours.packed, codes);
        let fake = file.f32_values(&format!("{case}.fake_quant")).unwrap();
        assert_f32_bits_eq(&format!("{case}.fake_quant"), &ours.dequantize(), &fake);
    }
}

#[test]
fn damaged_golden_files_name_the_file_and_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let original = std::fs::read(golden_path("nvfp4_weights.safetensors")).unwrap();

    let truncated = dir.path().join("truncated.safetensors");
    std::fs::write(&truncated, &original[..original.len() / 2]).unwrap();
    let err = TensorFile::open(&truncated).unwrap_err().to_string();
    assert!(err.contains("truncated.safetensors"), "{err}");

    // Rename one tensor in the header (same length, so offsets stay valid): it goes missing.
    let renamed = dir.path().join("renamed.safetensors");
    let needle = b"exact_ties_4x32.weight_scale_2";
    let at = original
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("tensor name in header");
    let mut bytes = original.clone();
    bytes[at..at + needle.len()].copy_from_slice(b"exact_ties_4x32.weight_scale_X");
    std::fs::write(&renamed, &bytes).unwrap();
    let file = TensorFile::open(&renamed).unwrap();
    let err = read_nvfp4(&file, "exact_ties_4x32.weight")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("renamed.safetensors") && err.contains("exact_ties_4x32.weight_scale_2"),
        "{err}"
    );

    // A block-scale tensor read as the packed weight: wrong dtype, named.
    let err = file
        .u8_values("exact_ties_4x32.weight_scale", &[Dtype::U8])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("exact_ties_4x32.weight_scale") && err.contains("F8_E4M3"),
        "{err}"
    );
}
