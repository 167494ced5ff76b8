//! Running a test's body in a child process that loads the stand-in driver: the loader reads
//! `LD_LIBRARY_PATH` once, at start, so the driver library can only be chosen for a new
//! process. Each test re-runs its own binary, filtered to itself, with `CUDA_STUB_CHILD` set
//! to the role the child plays.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

pub const CHILD: &str = "CUDA_STUB_CHILD";

/// The role this process plays, when it is a child.
pub fn role() -> Option<String> {
    std::env::var(CHILD).ok()
}

/// A folder holding `libcuda.so.1` (and `libcuda.so`) that is the stand-in driver built
/// beside this test binary, and the stand-in's kernel images.
pub fn stub_dirs() -> &'static (tempfile::TempDir, PathBuf) {
    static DIRS: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    DIRS.get_or_init(|| {
        let exe = std::env::current_exe().unwrap();
        let lib = exe.parent().unwrap().join("libcuda_stub.so");
        assert!(
            lib.is_file(),
            "{} is missing: the stand-in driver is built with the crate's tests (cargo test -p \
             cuda-stub)",
            lib.display()
        );
        let dir = tempfile::tempdir().unwrap();
        for name in ["libcuda.so.1", "libcuda.so"] {
            std::os::unix::fs::symlink(&lib, dir.path().join(name)).unwrap();
        }
        let images = dir.path().join("ptx");
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ptx/manifest.json");
        let out = Command::new(env!("CARGO_BIN_EXE_cuda-stub-images"))
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
        (dir, images)
    })
}

/// The environment a process needs to run on the stand-in driver.
pub fn stub_env(cmd: &mut Command) -> &mut Command {
    let (dir, images) = stub_dirs();
    let path = match std::env::var_os("LD_LIBRARY_PATH") {
        Some(old) => {
            let mut p = dir.path().as_os_str().to_owned();
            p.push(":");
            p.push(old);
            p
        }
        None => dir.path().as_os_str().to_owned(),
    };
    cmd.env("LD_LIBRARY_PATH", path)
        // The host execution layer's initial-exec TLS (a block's shared memory) exceeds what
        // glibc reserves for libraries loaded at run time by default.
        .env("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=0x100000")
        .env("KIMI_PTX_DIR", images)
}

/// This test binary, filtered to `test`, as a child playing `role`.
pub fn child(test: &str, role: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([test, "--exact", "--nocapture", "--test-threads", "1"])
        .env(CHILD, role)
        .stdin(Stdio::null());
    stub_env(&mut cmd);
    cmd
}

/// Runs `cmd` and fails the test with its output unless it succeeded.
pub fn expect_success(what: &str, cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Asserts a driver call's result, naming the call.
#[track_caller]
pub fn expect(what: &str, got: CUresult, want: CUresult) {
    assert_eq!(
        got, want,
        "{what}: got {got:?}, the driver returns {want:?}"
    );
}

#[track_caller]
pub fn ok(what: &str, got: CUresult) {
    expect(what, got, CUresult::CUDA_SUCCESS);
}

/// `cuInit`, then device `ordinal`'s primary context made current on this thread.
pub fn primary_context(ordinal: i32) -> (sys::CUdevice, sys::CUcontext) {
    // SAFETY: plain driver calls with valid out-pointers.
    unsafe {
        ok("cuInit", sys::cuInit(0));
        let mut dev = 0;
        ok("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal));
        let mut ctx = std::ptr::null_mut();
        ok(
            "cuDevicePrimaryCtxRetain",
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
        );
        ok("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx));
        (dev, ctx)
    }
}

/// Loads the stand-in image of `family`/`tactic` for the device's SM.
pub fn load_module(family: &str, tactic: &str, sm: &str) -> sys::CUmodule {
    let path = stub_images()
        .join(family)
        .join(sm)
        .join(format!("{tactic}.cubin"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut m = std::ptr::null_mut();
    // SAFETY: the image's bytes outlive the call.
    ok("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut m, bytes.as_ptr().cast())
    });
    m
}

/// In a child: the images folder the parent made (`KIMI_PTX_DIR`).
pub fn stub_images() -> PathBuf {
    PathBuf::from(std::env::var_os("KIMI_PTX_DIR").expect("set by the parent"))
}

pub fn function(m: sys::CUmodule, name: &str) -> sys::CUfunction {
    let c = std::ffi::CString::new(name).unwrap();
    let mut f = std::ptr::null_mut();
    // SAFETY: valid module and name.
    ok("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut f, m, c.as_ptr())
    });
    f
}
