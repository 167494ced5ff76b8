//! What `scripts/gpu-check.sh` asks of a machine before it spends device time: the driver's
//! CUDA version, each device's name, compute capability, compute mode and free memory, peer
//! access between the devices, and whether the vendor libraries (cuBLASLt, NCCL) open. One
//! `key=value` line each, for the script, after a human-readable summary on stderr.
//!
//! Exit status: 0 with a usable device, 2 without a driver or device (the lines say which).

use std::process::ExitCode;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::CUdevice_attribute as A;
use kernels::cuda::{GpuContext, cublaslt_present, default_ptx_dir, driver_present};

const USAGE: &str = "usage: gpu-preflight
What a GPU check needs of this machine (driver, devices, peer access, vendor libraries): one
key=value line each on stdout, a summary on stderr. Exit status: 0 with a usable device, 2
without a driver or device.";

fn compute_mode(v: i32) -> &'static str {
    match v {
        0 => "default",
        2 => "prohibited",
        3 => "exclusive-process",
        _ => "unknown",
    }
}

/// Whether one of `names` opens (dlopen): the vendor libraries are opened at run time.
fn library_opens(names: &[&str]) -> bool {
    names.iter().any(|n| {
        let c = std::ffi::CString::new(*n).unwrap();
        // SAFETY: a NUL-terminated name; the handle is closed at once.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if h.is_null() {
                return false;
            }
            libc::dlclose(h);
            true
        }
    })
}

fn main() -> ExitCode {
    // Asking for help runs nothing.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!("{USAGE}");
        return ExitCode::SUCCESS;
    }
    if !driver_present() {
        println!("driver=absent");
        eprintln!("gpu-preflight: {}", kernels::device::DeviceError::NoDriver);
        return ExitCode::from(2);
    }
    let gpu = match GpuContext::new(0, default_ptx_dir()) {
        Ok(g) => g,
        Err(e) => {
            println!("driver=present");
            println!("devices=0");
            eprintln!("gpu-preflight: {e}");
            return ExitCode::from(2);
        }
    };
    let info = gpu.info();
    let version = info.driver_version;
    println!("driver_version={version}");
    let count = CudaContext::device_count().unwrap_or(0);
    println!("devices={count}");
    let ctx = gpu.context();
    let mode = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)
        .unwrap_or(-1);
    let (free, total) = ctx.mem_get_info().unwrap_or((0, 0));
    println!("device0_name={}", info.name);
    println!(
        "device0_compute_capability={}.{}",
        info.compute_capability.0, info.compute_capability.1
    );
    println!(
        "device0_sm={}",
        info.sm.map_or("none".into(), |s| s.to_string())
    );
    println!("device0_compute_mode={}", compute_mode(mode));
    println!("device0_free_mib={}", free >> 20);
    println!("device0_total_mib={}", total >> 20);
    let mut peers = 0;
    for d in 1..count {
        let mut can = 0;
        // SAFETY: out-parameter call with two valid ordinals.
        let r = unsafe { cudarc::driver::sys::cuDeviceCanAccessPeer(&mut can, 0, d) };
        if r == cudarc::driver::sys::CUresult::CUDA_SUCCESS && can != 0 {
            peers += 1;
        }
    }
    println!("device0_peers={peers}");
    let lt = cublaslt_present();
    println!("cublaslt={}", if lt { "present" } else { "absent" });
    let nccl = library_opens(&["libnccl.so.2", "libnccl.so"]);
    println!("nccl={}", if nccl { "present" } else { "absent" });
    eprintln!(
        "gpu-preflight: CUDA {}.{} driver, {count} device(s); device 0 {} ({}.{}), compute mode \
         {}, {} of {} MiB free, {peers} peer(s); cuBLASLt {}, NCCL {}",
        version / 1000,
        version % 1000 / 10,
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        compute_mode(mode),
        free >> 20,
        total >> 20,
        if lt { "present" } else { "absent" },
        if nccl { "present" } else { "absent" },
    );
    ExitCode::SUCCESS
}
