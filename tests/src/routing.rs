//! The routed experts' choices of a forward pass, recorded from the CPU model, and the HF
//! golden's (`routing_w4a4.layers.L.*` of `golden.safetensors`), so that a test can tell a
//! changed expert choice from a changed value feeding the router. The MoE calls of one pass
//! come in layer order, one per MoE layer.

use std::sync::Mutex;

use kernels::matrix::MatrixView;
use kernels::mla::cache::{CacheError, PagedLatentCache};
use kernels::mla::reference::MlaProblem;
use kernels::moe_gemm::reference::{ExpertInputAmax, ExpertView, Routing};
use model::backend::Backend;
use model::tensor_file::TensorFile;

/// One MoE layer's choice: per token, the experts sorted by id and their weights in that order.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRouting {
    pub layer: usize,
    pub experts: Vec<Vec<u32>>,
    pub weights: Vec<Vec<f32>>,
}

impl LayerRouting {
    /// `routing`'s choice of every token, sorted by expert id.
    pub fn of(layer: usize, routing: &Routing) -> Self {
        let (mut experts, mut weights) = (Vec::new(), Vec::new());
        for t in 0..routing.tokens() {
            let slots = t * routing.top_k..(t + 1) * routing.top_k;
            let mut pairs: Vec<(u32, f32)> = routing.experts[slots.clone()]
                .iter()
                .copied()
                .zip(routing.weights[slots].iter().copied())
                .collect();
            pairs.sort_by_key(|&(e, _)| e);
            experts.push(pairs.iter().map(|&(e, _)| e).collect());
            weights.push(pairs.iter().map(|&(_, w)| w).collect());
        }
        Self {
            layer,
            experts,
            weights,
        }
    }
}

/// The HF golden's choices of every MoE layer (`first_moe_layer..layers`), in layer order.
///
/// # Panics
/// If the golden lacks them or they are malformed.
pub fn hf_routing(golden: &TensorFile, first_moe_layer: usize, layers: usize) -> Vec<LayerRouting> {
    (first_moe_layer..layers)
        .map(|layer| {
            let name = |what: &str| format!("routing_w4a4.layers.{layer}.{what}");
            let experts = golden.i64_values(&name("topk_indices")).unwrap();
            let weights = golden.f32_values(&name("topk_weights")).unwrap();
            let k = golden.info(&name("topk_indices")).unwrap().shape[1];
            LayerRouting {
                layer,
                experts: experts
                    .chunks_exact(k)
                    .map(|row| row.iter().map(|&e| e as u32).collect())
                    .collect(),
                weights: weights.chunks_exact(k).map(<[f32]>::to_vec).collect(),
            }
        })
        .collect()
}

/// A backend that passes every call to `inner`, recording each MoE call's routing (the i-th
/// MoE call of a pass is layer `first_moe_layer + i`).
pub struct RoutingBackend<'a> {
    inner: &'a dyn Backend,
    first_moe_layer: usize,
    recorded: Mutex<Vec<LayerRouting>>,
}

impl<'a> RoutingBackend<'a> {
    pub fn new(inner: &'a dyn Backend, first_moe_layer: usize) -> Self {
        Self {
            inner,
            first_moe_layer,
            recorded: Mutex::default(),
        }
    }

    /// The model's choices so far, one per MoE call.
    pub fn recorded(&self) -> Vec<LayerRouting> {
        self.recorded.lock().unwrap().clone()
    }
}

impl Backend for RoutingBackend<'_> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn matmul(&self, x: &[f32], tokens: usize, w: MatrixView<'_>, out: &mut [f32]) {
        self.inner.matmul(x, tokens, w, out)
    }

    fn matmul_per_head(&self, x: &[f32], tokens: usize, w: &[MatrixView<'_>], out: &mut [f32]) {
        self.inner.matmul_per_head(x, tokens, w, out)
    }

    fn matmul_many(
        &self,
        x: &[f32],
        tokens: usize,
        ws: &[MatrixView<'_>],
        outs: &mut [&mut [f32]],
    ) {
        self.inner.matmul_many(x, tokens, ws, outs)
    }

    fn moe(
        &self,
        x: &[f32],
        hidden: usize,
        routing: &Routing,
        experts: &[ExpertView<'_>],
        out: &mut [f32],
        amax: Option<&mut ExpertInputAmax>,
    ) {
        {
            let mut recorded = self.recorded.lock().unwrap();
            let layer = self.first_moe_layer + recorded.len();
            recorded.push(LayerRouting::of(layer, routing));
        }
        self.inner.moe(x, hidden, routing, experts, out, amax)
    }

    fn mla_attention(
        &self,
        cache: &PagedLatentCache,
        problem: &MlaProblem<'_>,
        out: &mut [f32],
        lse: &mut [f32],
    ) -> Result<(), CacheError> {
        self.inner.mla_attention(cache, problem, out, lse)
    }

    fn run_step(&self, step: &mut (dyn FnMut() + Send)) {
        self.inner.run_step(step)
    }
}
