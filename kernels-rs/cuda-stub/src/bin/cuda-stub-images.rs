//! Writes the stand-in driver's kernel images: at the path of every cubin the compile gate
//! builds (`ptx/<family>/<sm>/<tactic>.cubin`, per `ptx/manifest.json`, plus the layers and
//! probe images the gate script builds for both SMs), an image that names its (family,
//! tactic, SM) and carries the manifest's figures for its kernels. The stand-in driver loads
//! it as the host execution layer's build of the same source. The manifest is copied beside
//! them, so the folder serves as `KIMI_PTX_DIR` (the tuning lab reads the manifest there).
//!
//! ```sh
//! cuda-stub-images --manifest ptx/manifest.json --out target/stub-driver/ptx
//! ```

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::{Value, json};

/// The header the stand-in driver reads (`cuda_stub::module::MAGIC`).
const MAGIC: &str = "CUDA-STUB-IMAGE 1 ";
/// Families the gate script builds for both SMs outside the manifest.
const UNLISTED: [(&str, &str); 2] = [("layers", "default"), ("ptx_probe", "default")];
const SMS: [&str; 2] = ["sm_90a", "sm_120a"];

fn write_if_changed(path: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    if std::fs::read(path).is_ok_and(|old| old == bytes) {
        return Ok(false);
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, bytes)?;
    Ok(true)
}

fn image(family: &str, tactic: &str, sm: &str, kernels: &Value) -> Vec<u8> {
    let body =
        json!({"family": family, "tactic": tactic, "sm": sm, "kernels": kernels}).to_string();
    let mut out = format!("{MAGIC}{}\n", body.len()).into_bytes();
    out.extend_from_slice(body.as_bytes());
    out
}

fn run(manifest: &Path, out: &Path) -> Result<(usize, usize), String> {
    let text =
        std::fs::read_to_string(manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let m: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let entries = m["entries"]
        .as_array()
        .ok_or_else(|| format!("{}: no `entries` array", manifest.display()))?;
    let mut images = Vec::new();
    for e in entries {
        let field = |k: &str| {
            e[k].as_str()
                .ok_or_else(|| format!("{}: an entry without `{k}`: {e}", manifest.display()))
        };
        let (family, tactic, sm) = (field("family")?, field("tactic")?, field("sm")?);
        images.push((
            family.to_string(),
            tactic.to_string(),
            sm.to_string(),
            e["kernels"].clone(),
        ));
    }
    for (family, tactic) in UNLISTED {
        for sm in SMS {
            images.push((family.into(), tactic.into(), sm.into(), json!({})));
        }
    }
    let (mut written, mut total) = (0, 0);
    for (family, tactic, sm, kernels) in &images {
        // An image without a host build would load nowhere: the manifest and the host layer's
        // tactic lists disagree, which is an error of the build, not of the run.
        cuda_host::Module::find(family, tactic).map_err(|e| e.to_string())?;
        let path = out.join(family).join(sm).join(format!("{tactic}.cubin"));
        let bytes = image(family, tactic, sm, kernels);
        if write_if_changed(&path, &bytes).map_err(|e| format!("{}: {e}", path.display()))? {
            written += 1;
        }
        total += 1;
    }
    write_if_changed(&out.join("manifest.json"), text.as_bytes())
        .map_err(|e| format!("{}: {e}", out.display()))?;
    Ok((written, total))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(PathBuf::from)
    };
    let (Some(manifest), Some(out)) = (value("--manifest"), value("--out")) else {
        eprintln!("usage: cuda-stub-images --manifest ptx/manifest.json --out DIR");
        return ExitCode::from(2);
    };
    match run(&manifest, &out) {
        Ok((written, total)) => {
            println!(
                "cuda-stub-images: {total} images in {} ({written} written)",
                out.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cuda-stub-images: {e}");
            ExitCode::FAILURE
        }
    }
}
