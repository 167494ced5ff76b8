//! Problem shapes of one decode step on one GPU, derived from the model config under tensor
//! parallelism: they live in `model::exec::tactics`, where `model run --tactics` uses them too.

pub use model::exec::tactics::{
    BATCHES, CONTEXTS, DenseProduct, dense_products, expert_load, shapes,
};
