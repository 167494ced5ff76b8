//! `model quantize` against ModelOpt: the BF16 master weights of a golden model, quantized by
//! us, must give the NVFP4 expert bytes ModelOpt wrote for the same weights.

use model::checkpoint::Checkpoint;
use model::quantize::quantize_checkpoint;
use project_tests::golden_path;
use safetensors::Dtype;

#[test]
fn quantized_expert_bytes_equal_modelopt() {
    let source = golden_path("models").join("dsv3-mini-unsharded-bf16");
    let expected = Checkpoint::open(&golden_path("models").join("dsv3-mini-unsharded")).unwrap();
    let out = tempfile::tempdir().unwrap();
    quantize_checkpoint(&source, out.path(), 64, 7, 1 << 20, false).unwrap();
    let ours = Checkpoint::open(out.path()).unwrap();
    assert!(ours.config.quant.is_some(), "hf_quant_config.json written");

    let (mut tensors, mut bytes) = (0, 0);
    for (name, file) in expected.tensor_names() {
        if !name.contains(".mlp.experts.") || name.ends_with("input_scale") {
            continue;
        }
        let info = file.info(name).unwrap();
        let golden = file.bytes(name, &[info.dtype]).unwrap();
        let (our_file, our_name) = ours.locate(name).unwrap();
        let our_info = our_file.info(&our_name).unwrap();
        assert_eq!(our_info.dtype, info.dtype, "{name}");
        assert_eq!(our_info.numel(), info.numel(), "{name}");
        assert_eq!(
            our_file.bytes(&our_name, &[info.dtype]).unwrap(),
            golden,
            "{name}"
        );
        tensors += 1;
        bytes += golden.len();
    }
    println!("{tensors} expert tensors, {bytes} bytes identical to ModelOpt");
    assert!(tensors >= 2 * 8 * 3 * 3);

    // input_scale is calibrated on our own tokens, so it differs; it must still be a sane
    // activation range (positive, and within a factor of 16 of the golden calibration).
    for (name, file) in expected
        .tensor_names()
        .filter(|(n, _)| n.ends_with("input_scale"))
    {
        let golden = file.f32_values(name).unwrap()[0];
        let (f, n) = ours.locate(name).unwrap();
        let value = f.positive_scale(&n).unwrap();
        assert!(
            value / golden < 16.0 && golden / value < 16.0,
            "{name}: {value} vs {golden}"
        );
    }
    // Everything that is not a routed expert is copied unchanged.
    for (name, file) in expected
        .tensor_names()
        .filter(|(n, _)| !n.contains(".mlp.experts."))
    {
        let info = file.info(name).unwrap();
        if info.dtype == Dtype::BF16 {
            let (f, n) = ours.locate(name).unwrap();
            assert_eq!(
                f.bytes(&n, &[Dtype::BF16]).unwrap(),
                file.bytes(name, &[Dtype::BF16]).unwrap(),
                "{name}"
            );
        }
    }
}
