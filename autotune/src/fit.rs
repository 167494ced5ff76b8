//! Refitting the cost model (`crate::cost::CostParams`) to device measurements, by least
//! squares over the measured points.
//!
//! The residual of a point is `ln(predicted / measured)`: the lab's times span a microsecond to
//! milliseconds, and a ratio is what "predicted 2× too fast" means at every scale. The
//! parameters are fitted in log space (each stays positive) within physical bounds, by
//! Levenberg–Marquardt with a finite-difference Jacobian: the model is piecewise (a kernel is
//! bound by memory, compute or latency, whichever is larger), so a parameter only has an effect
//! on the points it bounds. One that has none on any measured point (no emulated tactic was
//! timed, no kernel was compute-bound) is not determined by the measurements: it keeps its value
//! and is reported as held. Bad inputs — no points, a measurement that is not a positive finite
//! time, a point the model cannot predict, fewer points than determined parameters — are
//! errors, never NaN parameters.

use std::fmt;

use kernels::allreduce::cost::least_squares;

use crate::cost::CostParams;

/// The fitted parameters' names, in [`to_vec`] order.
pub const PARAMS: [&str; 6] = [
    "stream_efficiency",
    "memory_latency_ns",
    "launch_us",
    "empty_wave_us",
    "emulation_slowdown",
    "compute_efficiency",
];

/// Physical bounds of each parameter, in [`PARAMS`] order.
const BOUNDS: [(f64, f64); 6] = [
    (0.05, 1.5),
    (50.0, 20_000.0),
    (0.01, 200.0),
    (0.001, 200.0),
    (1.0, 1000.0),
    (0.01, 1.5),
];

pub fn to_vec(p: &CostParams) -> [f64; 6] {
    [
        p.stream_efficiency,
        p.memory_latency_ns,
        p.launch_us,
        p.empty_wave_us,
        p.emulation_slowdown,
        p.compute_efficiency,
    ]
}

pub fn from_vec(v: &[f64; 6]) -> CostParams {
    CostParams {
        stream_efficiency: v[0],
        memory_latency_ns: v[1],
        launch_us: v[2],
        empty_wave_us: v[3],
        emulation_slowdown: v[4],
        compute_efficiency: v[5],
    }
}

/// One measured point: what it is, and its measured time.
#[derive(Clone, Debug, PartialEq)]
pub struct FitPoint {
    pub label: String,
    pub measured_us: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum FitError {
    NoPoints,
    /// A measurement that is not a positive, finite time.
    BadMeasurement {
        label: String,
        value: f64,
    },
    /// The model gives no positive, finite time for a point at the starting parameters.
    NoPrediction {
        label: String,
    },
    /// Fewer points than parameters they determine.
    TooFew {
        points: usize,
        parameters: usize,
    },
    /// No parameter has any effect on the measured points.
    Undetermined,
}

impl fmt::Display for FitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FitError::NoPoints => f.write_str("no measured points to fit"),
            FitError::BadMeasurement { label, value } => {
                write!(
                    f,
                    "{label}: measured {value} µs is not a positive finite time"
                )
            }
            FitError::NoPrediction { label } => {
                write!(f, "{label}: the cost model predicts no time for it")
            }
            FitError::TooFew { points, parameters } => write!(
                f,
                "{points} measured points cannot determine {parameters} parameters"
            ),
            FitError::Undetermined => {
                f.write_str("no parameter of the cost model affects the measured points")
            }
        }
    }
}

impl std::error::Error for FitError {}

/// The fit and how well it fits.
#[derive(Clone, Debug, PartialEq)]
pub struct CostFit {
    pub start: CostParams,
    pub params: CostParams,
    /// Parameters the measurements determine, and those they leave at their start value.
    pub determined: Vec<&'static str>,
    pub held: Vec<&'static str>,
    /// Per point `predicted / measured − 1` with the fitted parameters, and with the start.
    pub residuals: Vec<f64>,
    pub start_residuals: Vec<f64>,
    pub iterations: usize,
}

impl CostFit {
    /// Root mean square of the relative residuals.
    pub fn rms(&self) -> f64 {
        rms(&self.residuals)
    }

    pub fn start_rms(&self) -> f64 {
        rms(&self.start_residuals)
    }
}

fn rms(r: &[f64]) -> f64 {
    (r.iter().map(|x| x * x).sum::<f64>() / r.len().max(1) as f64).sqrt()
}

/// Fits the cost model's parameters to `points`, starting at `start`; `predict(params, i)` is
/// the model's time for point `i` under `params` (`None`: it has none).
pub fn fit_cost_params(
    points: &[FitPoint],
    start: &CostParams,
    predict: impl Fn(&CostParams, usize) -> Option<f64>,
) -> Result<CostFit, FitError> {
    if points.is_empty() {
        return Err(FitError::NoPoints);
    }
    for p in points {
        if !(p.measured_us.is_finite() && p.measured_us > 0.0) {
            return Err(FitError::BadMeasurement {
                label: p.label.clone(),
                value: p.measured_us,
            });
        }
    }
    let clamp = |theta: &mut [f64; 6]| {
        for (t, (lo, hi)) in theta.iter_mut().zip(BOUNDS) {
            *t = t.clamp(lo.ln(), hi.ln());
        }
    };
    let params_of = |theta: &[f64; 6]| from_vec(&theta.map(f64::exp));
    // Log residuals; `None` when a prediction is not a positive finite time.
    let residuals = |theta: &[f64; 6]| -> Option<Vec<f64>> {
        let p = params_of(theta);
        points
            .iter()
            .enumerate()
            .map(|(i, pt)| {
                predict(&p, i)
                    .filter(|v| v.is_finite() && *v > 0.0)
                    .map(|v| (v / pt.measured_us).ln())
            })
            .collect()
    };
    let mut theta = to_vec(start).map(|v| v.max(f64::MIN_POSITIVE).ln());
    clamp(&mut theta);
    let Some(mut r) = residuals(&theta) else {
        let bad = (0..points.len())
            .find(|&i| predict(&params_of(&theta), i).is_none_or(|v| !(v.is_finite() && v > 0.0)))
            .unwrap_or(0);
        return Err(FitError::NoPrediction {
            label: points[bad].label.clone(),
        });
    };
    let start_r = r.clone();
    let cost = |r: &[f64]| r.iter().map(|x| x * x).sum::<f64>();
    let mut c = cost(&r);
    let mut lambda: f64 = 1e-3;
    let mut iterations = 0;
    let mut free = Vec::new();
    for it in 0..200 {
        iterations = it + 1;
        let (jac, cols) = jacobian(&theta, &r, &residuals);
        free = cols;
        if free.is_empty() {
            return Err(FitError::Undetermined);
        }
        if points.len() < free.len() {
            return Err(FitError::TooFew {
                points: points.len(),
                parameters: free.len(),
            });
        }
        // argmin ‖J δ + r‖² + λ ‖D δ‖² as one stacked least-squares problem.
        let mut improved = false;
        while lambda < 1e12 {
            let mut rows: Vec<Vec<f64>> = jac
                .iter()
                .map(|row| free.iter().map(|&j| row[j]).collect())
                .collect();
            let mut y: Vec<f64> = r.iter().map(|x| -x).collect();
            for (k, &j) in free.iter().enumerate() {
                let d = jac.iter().map(|row| row[j] * row[j]).sum::<f64>().sqrt();
                let mut damp = vec![0.0; free.len()];
                damp[k] = lambda.sqrt() * d.max(1e-12);
                rows.push(damp);
                y.push(0.0);
            }
            let Ok(delta) = least_squares(&rows, &y) else {
                lambda *= 10.0;
                continue;
            };
            let mut trial = theta;
            for (k, &j) in free.iter().enumerate() {
                trial[j] += delta[k];
            }
            clamp(&mut trial);
            match residuals(&trial) {
                Some(tr) if cost(&tr) < c => {
                    let gain = (c - cost(&tr)) / c.max(1e-300);
                    theta = trial;
                    r = tr;
                    c = cost(&r);
                    lambda = (lambda / 10.0).max(1e-12);
                    improved = gain > 1e-12;
                    break;
                }
                _ => lambda *= 10.0,
            }
        }
        if !improved {
            break;
        }
    }
    // Held parameters keep their start value exactly (not its round trip through the log).
    let mut values = theta.map(f64::exp);
    let start_values = to_vec(start);
    for j in (0..6).filter(|j| !free.contains(j)) {
        values[j] = start_values[j];
    }
    let params = from_vec(&values);
    let relative = |r: &[f64]| r.iter().map(|x| x.exp() - 1.0).collect::<Vec<_>>();
    let determined: Vec<&'static str> = free.iter().map(|&j| PARAMS[j]).collect();
    let held = PARAMS
        .iter()
        .copied()
        .filter(|p| !determined.contains(p))
        .collect();
    Ok(CostFit {
        start: start.clone(),
        params,
        determined,
        held,
        residuals: relative(&r),
        start_residuals: relative(&start_r),
        iterations,
    })
}

/// Central-difference Jacobian of the log residuals in log parameters, and the columns (the
/// parameters) that affect some point. A step that leaves the bounds or gives no prediction
/// counts as no effect.
fn jacobian(
    theta: &[f64; 6],
    r: &[f64],
    residuals: &impl Fn(&[f64; 6]) -> Option<Vec<f64>>,
) -> (Vec<[f64; 6]>, Vec<usize>) {
    let h = 1e-3;
    let mut jac = vec![[0.0; 6]; r.len()];
    let mut free = Vec::new();
    for j in 0..6 {
        let (lo, hi) = (BOUNDS[j].0.ln(), BOUNDS[j].1.ln());
        let up = (theta[j] + h).min(hi);
        let down = (theta[j] - h).max(lo);
        if up - down <= 0.0 {
            continue;
        }
        let at = |v: f64| {
            let mut t = *theta;
            t[j] = v;
            residuals(&t)
        };
        let (Some(a), Some(b)) = (at(up), at(down)) else {
            continue;
        };
        let mut norm = 0.0;
        for (i, row) in jac.iter_mut().enumerate() {
            row[j] = (a[i] - b[i]) / (up - down);
            norm += row[j] * row[j];
        }
        if norm.sqrt() > 1e-6 {
            free.push(j);
        }
    }
    (jac, free)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{Model, moe_grid_bounds};
    use kernels::arch::{RTX_PRO_6000, Sm};
    use kernels::mla::MlaSplitTactic;
    use kernels::moe_gemm::MoeGemmTactic;
    use kernels::tactic::{ProblemShape, Tactic};

    /// One synthetic point: its time under a model's parameters.
    type Point = Box<dyn Fn(&Model<'_>) -> Option<f64>>;

    /// Points over the SM120 MoE and MLA spaces and some dense products: memory-, latency- and
    /// compute-bound kernels, so every parameter but the emulation's is determined.
    fn synthetic_points() -> Vec<Point> {
        let mut out: Vec<Point> = Vec::new();
        for t in MoeGemmTactic::space(Sm::Sm120) {
            for (tpe, active) in [(1u32, 8u32), (2, 64), (2, 240), (8, 376)] {
                let s = ProblemShape::Moe {
                    tokens_per_expert: tpe,
                    active_experts: active,
                    hidden: 7168,
                    inter: 256,
                };
                if !t.serves(&s) {
                    continue;
                }
                let b = moe_grid_bounds(&s, 384, 8).unwrap();
                out.push(Box::new(move |m: &Model<'_>| {
                    m.moe(&t, None, &s, &b).map(|p| p.us)
                }));
            }
        }
        for t in MlaSplitTactic::space(Sm::Sm120).into_iter().step_by(3) {
            for (batch, context) in [(1u32, 1024u32), (8, 8192), (64, 65536)] {
                let s = ProblemShape::mla(batch, 8, context, t.kernel.kind.is_fp8(), t.kernel.dims);
                out.push(Box::new(move |m: &Model<'_>| {
                    m.mla(&t, None, &s).map(|p| p.us)
                }));
            }
        }
        for (m, n, k) in [
            (1u32, 4096u32, 128u32),
            (64, 4096, 128),
            (64, 512, 512),
            (1, 1536, 7168),
            (32, 20480, 7168),
        ] {
            let s = ProblemShape::Dense { m, n, k };
            out.push(Box::new(move |model: &Model<'_>| {
                model.dense(&s).map(|p| p.us)
            }));
        }
        out
    }

    fn measure(truth: &CostParams) -> (Vec<FitPoint>, Vec<Point>) {
        let points = synthetic_points();
        let m = Model::with_params(&RTX_PRO_6000, truth.clone());
        let fit_points = points
            .iter()
            .enumerate()
            .map(|(i, f)| {
                // Deterministic ±1% noise.
                let noise = 1.0 + 0.01 * ((i * 7 % 5) as f64 - 2.0) / 2.0;
                FitPoint {
                    label: format!("point {i}"),
                    measured_us: f(&m).unwrap() * noise,
                }
            })
            .collect();
        (fit_points, points)
    }

    #[test]
    fn the_fit_recovers_known_parameters_from_noisy_measurements() {
        let truth = CostParams {
            stream_efficiency: 0.72,
            memory_latency_ns: 620.0,
            launch_us: 3.3,
            empty_wave_us: 0.9,
            emulation_slowdown: 16.0,
            compute_efficiency: 0.55,
        };
        let (fit_points, models) = measure(&truth);
        let start = CostParams::for_gpu(&RTX_PRO_6000);
        let fit = fit_cost_params(&fit_points, &start, |p, i| {
            models[i](&Model::with_params(&RTX_PRO_6000, p.clone()))
        })
        .unwrap();
        println!(
            "{} points, {} iterations, rms {:.4} (start {:.3}); fitted {:?}; held {:?}",
            fit_points.len(),
            fit.iterations,
            fit.rms(),
            fit.start_rms(),
            fit.params,
            fit.held
        );
        // Nothing emulated was measured: that parameter is held at its start.
        assert_eq!(fit.held, vec!["emulation_slowdown"]);
        assert_eq!(fit.params.emulation_slowdown, start.emulation_slowdown);
        let (got, want) = (to_vec(&fit.params), to_vec(&truth));
        for (j, name) in PARAMS.iter().enumerate() {
            assert!(
                (got[j] / want[j] - 1.0).abs() < 0.05,
                "{name}: fitted {} vs {}",
                got[j],
                want[j]
            );
        }
        // The ±1% noise is all that is left.
        assert!(fit.rms() < 0.015, "rms {}", fit.rms());
        assert!(fit.start_rms() > fit.rms());
    }

    #[test]
    fn degenerate_inputs_are_errors_not_nan() {
        let start = CostParams::for_gpu(&RTX_PRO_6000);
        let constant = |_: &CostParams, _: usize| Some(5.0);
        assert_eq!(
            fit_cost_params(&[], &start, constant),
            Err(FitError::NoPoints)
        );
        let p = |v: f64| FitPoint {
            label: "moe x".into(),
            measured_us: v,
        };
        for bad in [f64::NAN, f64::INFINITY, 0.0, -3.0] {
            assert!(
                matches!(
                    fit_cost_params(&[p(1.0), p(bad)], &start, constant),
                    Err(FitError::BadMeasurement { .. })
                ),
                "{bad}"
            );
        }
        // A model that ignores its parameters determines none of them.
        assert_eq!(
            fit_cost_params(&[p(1.0), p(2.0)], &start, constant),
            Err(FitError::Undetermined)
        );
        // A point the model cannot predict.
        assert!(matches!(
            fit_cost_params(&[p(1.0)], &start, |_, _| None),
            Err(FitError::NoPrediction { .. })
        ));
        assert!(matches!(
            fit_cost_params(&[p(1.0)], &start, |_, _| Some(f64::NAN)),
            Err(FitError::NoPrediction { .. })
        ));
        // Two parameters that both matter, one point.
        let two = |c: &CostParams, _: usize| Some(c.launch_us + 10.0 * c.stream_efficiency);
        assert_eq!(
            fit_cost_params(&[p(7.0)], &start, two),
            Err(FitError::TooFew {
                points: 1,
                parameters: 2
            })
        );
        // Enough points for them: a finite fit.
        let fit = fit_cost_params(&[p(7.0), p(7.1), p(6.9)], &start, two).unwrap();
        assert!(to_vec(&fit.params).iter().all(|v| v.is_finite()));
    }
}
