//! The decode step's small kernels (`layers.cu`), compiled for the CPU and run by the host
//! execution layer, through the checks of `project_tests::layer_checks` (the same ones
//! `gpu_layers.rs` runs on a GPU).

use cuda_host::HostDevice;
use kernels::arch::Sm;
use kernels::layers::LayerKernels;
use project_tests::layer_checks;

fn run(check: layer_checks::Check<HostDevice>) {
    let dev = HostDevice::new(Sm::Sm120);
    let kernels = LayerKernels::load(&dev).unwrap();
    check(&dev, &kernels);
}

#[test]
fn embed_gather_copies_rows_and_reports_a_bad_id() {
    run(layer_checks::embed_gather_copies_rows_and_reports_a_bad_id);
}

#[test]
fn add_rms_norm_matches_the_cpu_norm() {
    run(layer_checks::add_rms_norm_matches_the_cpu_norm);
}

#[test]
fn rope_matches_yarn_rope_on_q_and_kv_layouts() {
    run(layer_checks::rope_matches_yarn_rope_on_q_and_kv_layouts);
}

#[test]
fn router_matches_the_cpu_router_kimi_and_grouped() {
    run(layer_checks::router_matches_the_cpu_router_kimi_and_grouped);
}

#[test]
fn router_rejects_shapes_it_cannot_route() {
    run(layer_checks::router_rejects_shapes_it_cannot_route);
}

#[test]
fn expert_grouping_matches_grouped_routing() {
    run(layer_checks::expert_grouping_matches_grouped_routing);
}

#[test]
fn dense_bf16_matches_a_double_precision_product() {
    run(layer_checks::dense_bf16_matches_a_double_precision_product);
}

#[test]
fn silu_mul_matches_the_reference_silu() {
    run(layer_checks::silu_mul_matches_the_reference_silu);
}

#[test]
fn argmax_matches_greedy_sampling_with_ties() {
    run(layer_checks::argmax_matches_greedy_sampling_with_ties);
}

#[test]
fn vocabulary_parallel_argmax_equals_the_whole_rows() {
    run(layer_checks::vocabulary_parallel_argmax_equals_the_whole_rows);
}

#[test]
fn launchers_name_the_kernel_and_buffer_that_is_too_small() {
    run(layer_checks::launchers_name_the_kernel_and_buffer_that_is_too_small);
}

#[test]
fn dense_heads_matches_per_head_products_in_both_output_types() {
    run(layer_checks::dense_heads_matches_per_head_products_in_both_output_types);
}

#[test]
fn to_bf16_strided_and_gather_rows_move_the_right_values() {
    run(layer_checks::to_bf16_strided_and_gather_rows_move_the_right_values);
}

#[test]
fn sample_rows_draws_what_the_reference_sampler_draws() {
    run(layer_checks::sample_rows_draws_what_the_reference_sampler_draws);
}
