//! Processes on the stand-in CUDA driver (`kernels-rs/cuda-stub`): the driver-facing code —
//! `GpuContext`, streams, graph capture, IPC — run in `cargo test` without a GPU.
//!
//! The driver library is chosen when a process starts (the loader reads `LD_LIBRARY_PATH`
//! once), so the stand-in is always a child process: [`StubDriver::command`] gives one with
//! the environment `scripts/stub-driver.sh` sets. The stand-in and the `model` binary are the
//! workspace's builds beside this test's binary (`cargo test --workspace` builds both); run
//! alone, the test builds what is missing.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Set in a test's child process (see [`StubDriver::this_test`]).
pub const CHILD: &str = "KIMI_STUB_CHILD";

/// Whether this process is a test's child on the stand-in.
pub fn is_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

pub struct StubDriver {
    /// Holds `libcuda.so.1` and `libcuda.so`, links to the stand-in.
    libs: tempfile::TempDir,
    images: PathBuf,
    bin: PathBuf,
}

/// The most recently written of `paths` that exists.
fn newest<const N: usize>(paths: [PathBuf; N]) -> Option<PathBuf> {
    paths
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
}

fn build_dir() -> PathBuf {
    // target/<profile>/deps/<test binary>
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

impl StubDriver {
    pub fn get() -> &'static StubDriver {
        static STUB: OnceLock<StubDriver> = OnceLock::new();
        STUB.get_or_init(Self::new)
    }

    fn new() -> Self {
        let bin = build_dir();
        // A test build leaves the library in deps/ (cuda-stub's tests build it); `cargo build`
        // in the build folder itself.
        let lib = || {
            newest([
                bin.join("deps/libcuda_stub.so"),
                bin.join("libcuda_stub.so"),
            ])
        };
        let (images_bin, model) = (bin.join("cuda-stub-images"), bin.join("model"));
        if lib().is_none() || !images_bin.is_file() || !model.is_file() {
            let status = Command::new(env!("CARGO"))
                .args(["build", "--quiet", "-p", "cuda-stub", "-p", "model"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .unwrap();
            assert!(status.success(), "building the stand-in driver and model");
        }
        let lib = lib().expect("built above");
        let libs = tempfile::tempdir().unwrap();
        for name in ["libcuda.so.1", "libcuda.so"] {
            std::os::unix::fs::symlink(&lib, libs.path().join(name)).unwrap();
        }
        let images = libs.path().join("ptx");
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ptx/manifest.json");
        let out = Command::new(&images_bin)
            .arg("--manifest")
            .arg(&manifest)
            .arg("--out")
            .arg(&images)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "cuda-stub-images: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self { libs, images, bin }
    }

    /// The stand-in's kernel images (`KIMI_PTX_DIR`).
    pub fn images(&self) -> &Path {
        &self.images
    }

    /// `program` as a process on the stand-in driver (one RTX PRO 6000 unless the caller sets
    /// `CUDA_STUB_DEVICE` / `CUDA_STUB_DEVICE_COUNT`).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let mut path = self.libs.path().as_os_str().to_owned();
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
            path.push(":");
            path.push(old);
        }
        cmd.env("LD_LIBRARY_PATH", path)
            // Room for the host execution layer's initial-exec TLS in a library loaded at run
            // time (see scripts/stub-driver.sh).
            .env("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=0x100000")
            .env("KIMI_PTX_DIR", &self.images)
            .env_remove("CUDA_STUB_DEVICE")
            .env_remove("CUDA_STUB_DEVICE_COUNT");
        cmd
    }

    /// The calling test binary, filtered to `test`, on the stand-in, with [`CHILD`] set: the
    /// test's body runs there (see [`is_child`]).
    pub fn this_test(&self, test: &str) -> Command {
        let mut cmd = self.command(std::env::current_exe().unwrap());
        cmd.args([test, "--exact", "--nocapture"]).env(CHILD, "1");
        cmd
    }

    /// The workspace's `model` binary, on the stand-in.
    pub fn model(&self) -> Command {
        self.command(self.bin.join("model"))
    }

    /// The same binary without the stand-in (the CPU backend's reference run).
    pub fn model_without_driver(&self) -> Command {
        Command::new(self.bin.join("model"))
    }
}
