//! What a device run does with its measurements beyond the cache: refits the cost model
//! (`crate::fit`) over every measured kernel point, calibrates the all-reduce's link model
//! (`LinkParams::calibrate`) over the all-reduce points, and compares predicted with measured
//! figures wherever both exist — the gap table, whose widest entry per family the closing note
//! of a device session carries. The fitted parameters go into a sidecar file beside the cache
//! ([`CostModelFile`]), which `autotune step-time --cost-model FILE` reads.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use kernels::allreduce::LinkKind;
use kernels::allreduce::cost::{Host, LinkParams, Measurement};
use kernels::allreduce::tactic::AllReduceTactic;
use kernels::allreduce::topology::Topology;
use kernels::tactic::{KernelFamily, ProblemShape, Tactic};
use serde::{Deserialize, Serialize};

use crate::cost::{self, CostParams};
use crate::fit::{self, CostFit, FitPoint};
use crate::tune::{MeasuredPoint, Predictor, Report};

/// Format of [`CostModelFile`].
pub const COST_MODEL_FORMAT: u32 = 1;

/// The sidecar of a device run's cache: the cost model's parameters fitted to its
/// measurements, with the fit's residuals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModelFile {
    pub format: u32,
    /// Always `fitted to measurements`: the file exists only where a device measured.
    pub source: String,
    pub sm: String,
    /// The device that measured, and the GPU whose data-sheet figures the model uses.
    pub measured_on: String,
    pub model_gpu: String,
    pub driver_version: String,
    pub cuda_version: String,
    pub commit: String,
    pub kernels: Option<KernelFit>,
    pub allreduce: Option<AllReduceFit>,
    /// Why a part could not be fitted.
    pub notes: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KernelFit {
    pub params: CostParams,
    pub assumed: CostParams,
    pub determined: Vec<String>,
    pub held: Vec<String>,
    pub points: usize,
    /// `predicted / measured − 1`: root mean square and largest magnitude, fitted and assumed.
    pub rms_relative_residual: f64,
    pub max_relative_residual: f64,
    pub assumed_rms_relative_residual: f64,
    pub residuals: Vec<Residual>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Residual {
    pub family: String,
    pub tactic: String,
    pub bucket: String,
    pub measured_us: f64,
    pub fitted_us: f64,
    pub relative: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AllReduceFit {
    /// How the points were measured (ranks as streams of one GPU).
    pub measured_as: String,
    pub world: u32,
    pub points: usize,
    /// `launch_us`, `phase_sync_us`, `bandwidth_scale` fitted by `LinkParams::calibrate` on a
    /// host of `world` GPUs behind one switch with no hop latency (one device's memory).
    pub launch_us: f64,
    pub phase_sync_us: f64,
    pub bandwidth_scale: f64,
    pub rms_us: f64,
    /// What of the fit carries over to the PCIe host the step-time model prices: the
    /// kernels' own costs, not the links.
    pub used_by_step_time: Vec<String>,
}

impl CostModelFile {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the cost model file serializes") + "\n"
    }

    pub fn from_json(text: &str) -> Result<Self, String> {
        let f: CostModelFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if f.format != COST_MODEL_FORMAT {
            return Err(format!(
                "format {} (this build reads {COST_MODEL_FORMAT})",
                f.format
            ));
        }
        Ok(f)
    }

    /// The PCIe host's link parameters with this fit's kernel-side all-reduce costs.
    pub fn link_params(&self) -> LinkParams {
        let mut p = LinkParams::default();
        if let Some(a) = &self.allreduce {
            p.launch_us = a.launch_us;
            p.phase_sync_us = a.phase_sync_us;
        }
        p
    }
}

/// A host of `world` GPUs that share one device's memory, as the all-reduce ranks of one GPU
/// do: every pair behind one switch, and no hop latency (flags live in the same memory).
pub fn one_gpu_host(world: usize) -> (Host, LinkParams) {
    let links = (0..world)
        .map(|a| {
            (0..world)
                .map(|b| {
                    if a == b {
                        LinkKind::SelfLink
                    } else {
                        LinkKind::Pix
                    }
                })
                .collect()
        })
        .collect();
    let topo = Topology::from_links(links).expect("a full one-switch matrix is valid");
    let params = LinkParams {
        hop_latency_us: 0.0,
        writes_collapse: false,
        ..LinkParams::default()
    };
    (Host::new(topo), params)
}

/// One row of the gap table.
#[derive(Clone, Debug, PartialEq)]
pub struct Gap {
    pub family: KernelFamily,
    pub tactic: String,
    pub bucket: String,
    pub measured_us: f64,
    pub spread_us: f64,
    pub n: usize,
    pub predicted_us: f64,
    pub refit_us: Option<f64>,
}

impl Gap {
    /// The factor between predicted and measured (≥ 1), with its direction.
    pub fn factor(&self) -> f64 {
        gap_factor(self.predicted_us, self.measured_us)
    }
}

fn gap_factor(predicted: f64, measured: f64) -> f64 {
    let r = predicted / measured;
    if r >= 1.0 { r } else { 1.0 / r }
}

/// What [`refit`] found.
pub struct Refit {
    pub file: CostModelFile,
    pub gaps: Vec<Gap>,
}

/// Refits the cost model and the all-reduce link model to `report`'s measurements and builds
/// the gap table. `None` when nothing was measured.
pub fn refit(report: &Report, predictor: &Predictor<'_>, tp: u32) -> Option<Refit> {
    let device = report.device.as_ref()?;
    if report.measured.is_empty() {
        return None;
    }
    let mut notes = Vec::new();
    let kernel_points: Vec<&MeasuredPoint> = report
        .measured
        .iter()
        .filter(|m| m.family != KernelFamily::AllReduce && m.predicted_us.is_some())
        .collect();
    let label = |m: &MeasuredPoint| format!("{} {} {}", m.family, m.tactic, m.shape.bucket());
    let fit_points: Vec<FitPoint> = kernel_points
        .iter()
        .map(|m| FitPoint {
            label: label(m),
            measured_us: m.samples.median(),
        })
        .collect();
    let predict = |p: &CostParams, i: usize| {
        let m = kernel_points[i];
        predictor
            .with_params(p.clone())
            .predict_id(m.family, &m.tactic, &m.shape)
            .map(|x| x.us)
    };
    let kernel_fit = match fit::fit_cost_params(&fit_points, &predictor.model.params, predict) {
        Ok(f) => Some(f),
        Err(e) => {
            notes.push(format!("kernel cost model not refitted: {e}"));
            None
        }
    };
    let kernels = kernel_fit
        .as_ref()
        .map(|f| kernel_section(f, &kernel_points));
    let mut gaps: Vec<Gap> = kernel_points
        .iter()
        .enumerate()
        .map(|(i, m)| Gap {
            family: m.family,
            tactic: m.tactic.clone(),
            bucket: m.shape.bucket(),
            measured_us: m.samples.median(),
            spread_us: m.samples.spread(),
            n: m.samples.n(),
            predicted_us: m.predicted_us.expect("filtered above"),
            refit_us: kernel_fit
                .as_ref()
                .map(|f| m.samples.median() * (1.0 + f.residuals[i])),
        })
        .collect();
    let (allreduce, mut ar_gaps) = allreduce_fit(report, tp, &mut notes);
    gaps.append(&mut ar_gaps);
    let gpu = predictor.model.gpu;
    Some(Refit {
        file: CostModelFile {
            format: COST_MODEL_FORMAT,
            source: "fitted to measurements".into(),
            sm: predictor.sm.arch().to_string(),
            measured_on: device.name.clone(),
            model_gpu: gpu.name.to_string(),
            driver_version: device.driver_version.clone(),
            cuda_version: device.cuda_version.clone(),
            commit: report.cache.provenance.commit.clone(),
            kernels,
            allreduce,
            notes,
        },
        gaps,
    })
}

fn kernel_section(f: &CostFit, points: &[&MeasuredPoint]) -> KernelFit {
    KernelFit {
        params: f.params.clone(),
        assumed: f.start.clone(),
        determined: f.determined.iter().map(|s| s.to_string()).collect(),
        held: f.held.iter().map(|s| s.to_string()).collect(),
        points: points.len(),
        rms_relative_residual: f.rms(),
        max_relative_residual: f.residuals.iter().fold(0.0f64, |a, r| a.max(r.abs())),
        assumed_rms_relative_residual: f.start_rms(),
        residuals: points
            .iter()
            .zip(&f.residuals)
            .map(|(m, &r)| Residual {
                family: m.family.id().to_string(),
                tactic: m.tactic.clone(),
                bucket: m.shape.bucket(),
                measured_us: m.samples.median(),
                fitted_us: m.samples.median() * (1.0 + r),
                relative: r,
            })
            .collect(),
    }
}

/// `LinkParams::calibrate` over the all-reduce points (ranks as streams of one GPU), on the
/// host such ranks make; the gap rows compare the link model's prediction for that host, with
/// the assumed parameters and with the calibrated ones, to the measurement.
fn allreduce_fit(
    report: &Report,
    tp: u32,
    notes: &mut Vec<String>,
) -> (Option<AllReduceFit>, Vec<Gap>) {
    let points: Vec<(&MeasuredPoint, AllReduceTactic)> = report
        .measured
        .iter()
        .filter(|m| m.family == KernelFamily::AllReduce)
        .filter_map(|m| Some((m, AllReduceTactic::parse_id(&m.tactic).ok()?)))
        .collect();
    if points.is_empty() {
        return (None, Vec::new());
    }
    let (host, assumed) = one_gpu_host(tp as usize);
    let measurements: Vec<Measurement> = points
        .iter()
        .map(|(m, t)| Measurement {
            algorithm: t.algorithm,
            bytes: shape_bytes(&m.shape, t),
            latency_us: m.samples.median(),
        })
        .collect();
    let mut fitted = assumed.clone();
    let calibrated = match fitted.calibrate(&host, &measurements) {
        Ok(rms)
            if [
                fitted.launch_us,
                fitted.phase_sync_us,
                fitted.bandwidth_scale,
            ]
            .iter()
            .all(|v| v.is_finite()) =>
        {
            Some(rms)
        }
        Ok(_) => {
            notes.push("all-reduce link model not calibrated: the fit is not finite".into());
            None
        }
        Err(e) => {
            notes.push(format!("all-reduce link model not calibrated: {e}"));
            None
        }
    };
    let gaps = points
        .iter()
        .filter_map(|(m, t)| {
            let predicted = cost::allreduce(&host, &assumed, t, &m.shape)?.us;
            Some(Gap {
                family: KernelFamily::AllReduce,
                tactic: m.tactic.clone(),
                bucket: m.shape.bucket(),
                measured_us: m.samples.median(),
                spread_us: m.samples.spread(),
                n: m.samples.n(),
                predicted_us: predicted,
                refit_us: calibrated
                    .and_then(|_| cost::allreduce(&host, &fitted, t, &m.shape))
                    .map(|p| p.us),
            })
        })
        .collect();
    let fit = calibrated.map(|rms_us| AllReduceFit {
        measured_as: format!(
            "{tp} ranks as concurrent streams of one GPU (its memory, not PCIe links)"
        ),
        world: tp,
        points: measurements.len(),
        launch_us: fitted.launch_us,
        phase_sync_us: fitted.phase_sync_us,
        bandwidth_scale: fitted.bandwidth_scale,
        rms_us,
        used_by_step_time: vec!["launch_us".into(), "phase_sync_us".into()],
    });
    (fit, gaps)
}

fn shape_bytes(shape: &ProblemShape, t: &AllReduceTactic) -> usize {
    match shape {
        ProblemShape::AllReduce { elements, .. } => *elements as usize * t.dtype.size(),
        _ => 0,
    }
}

/// The gap table: per family the widest gap between predicted and measured (assumed and
/// refitted parameters), then every row.
pub fn gap_table(gaps: &[Gap], device: &str) -> String {
    let mut s = format!(
        "# Predicted vs MEASURED on {device}: factor = max(predicted/measured, measured/predicted)\n\
         # predicted = the cost model with its assumed parameters (all-reduce: the link model for \
         ranks sharing one GPU); refit = the same model after the fit to these measurements\n\n\
         widest gap per family\n{:<10} {:<44} {:<34} {:>11} {:>12} {:>8} {:>10} {:>8}\n",
        "family", "tactic", "bucket", "measured µs", "predicted µs", "factor", "refit µs", "factor"
    );
    let mut widest: BTreeMap<KernelFamily, &Gap> = BTreeMap::new();
    for g in gaps {
        let w = widest.entry(g.family).or_insert(g);
        if g.factor() > w.factor() {
            *w = g;
        }
    }
    // One row; `every` adds the spread and count.
    let row = |g: &Gap, every: bool| {
        let (r, rf) = g.refit_us.map_or(("-".to_string(), "-".to_string()), |r| {
            (
                format!("{r:.2}"),
                format!("{:.2}", gap_factor(r, g.measured_us)),
            )
        });
        let samples = if every {
            format!(" {:>9.2} {:>3}", g.spread_us, g.n)
        } else {
            String::new()
        };
        format!(
            "{:<10} {:<44} {:<34} {:>11.2}{samples} {:>12.2} {:>8.2} {:>10} {:>8}\n",
            g.family.id(),
            g.tactic,
            g.bucket,
            g.measured_us,
            g.predicted_us,
            g.factor(),
            r,
            rf
        )
    };
    for g in widest.values() {
        s += &row(g, false);
    }
    let _ = writeln!(
        s,
        "\nevery point ({})\n{:<10} {:<44} {:<34} {:>11} {:>9} {:>3} {:>12} {:>8} {:>10} {:>8}",
        gaps.len(),
        "family",
        "tactic",
        "bucket",
        "measured µs",
        "spread",
        "n",
        "predicted µs",
        "factor",
        "refit µs",
        "factor"
    );
    for g in gaps {
        s += &row(g, true);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::allreduce::Algorithm;

    #[test]
    fn the_one_gpu_host_calibrates_from_its_own_predictions() {
        let (host, assumed) = one_gpu_host(8);
        let truth = LinkParams {
            launch_us: 5.5,
            phase_sync_us: 1.2,
            bandwidth_scale: 4.0,
            ..assumed.clone()
        };
        let mut ms = Vec::new();
        for algorithm in Algorithm::ALL {
            for bytes in [14_336usize, 114_688, 458_752, 917_504] {
                ms.push(Measurement {
                    algorithm,
                    bytes,
                    latency_us: host.predict_us(algorithm, bytes, &truth),
                });
            }
        }
        let mut fitted = assumed;
        let rms = fitted.calibrate(&host, &ms).unwrap();
        assert!(rms < 1e-6, "{rms}");
        assert!((fitted.launch_us - 5.5).abs() < 1e-6, "{fitted:?}");
        assert!((fitted.phase_sync_us - 1.2).abs() < 1e-6, "{fitted:?}");
        assert!((fitted.bandwidth_scale - 4.0).abs() < 1e-6, "{fitted:?}");
    }

    #[test]
    fn the_widest_gap_is_reported_per_family_both_ways() {
        let g = |family, tactic: &str, measured, predicted| Gap {
            family,
            tactic: tactic.into(),
            bucket: "b".into(),
            measured_us: measured,
            spread_us: 0.1,
            n: 10,
            predicted_us: predicted,
            refit_us: Some(measured),
        };
        let gaps = vec![
            g(KernelFamily::MoeGemm, "slow", 10.0, 30.0),
            g(KernelFamily::MoeGemm, "fast", 40.0, 10.0),
            g(KernelFamily::MlaDecode, "m", 5.0, 5.5),
        ];
        assert_eq!(gaps[1].factor(), 4.0);
        let t = gap_table(&gaps, "test GPU");
        let widest: Vec<&str> = t
            .lines()
            .skip_while(|l| !l.starts_with("widest"))
            .skip(2)
            .take(2)
            .collect();
        assert!(
            widest[0].starts_with("moe_gemm") && widest[0].contains("fast"),
            "{t}"
        );
        assert!(widest[1].starts_with("mla"), "{t}");
    }
}
