//! CUDA IPC across two processes on the stand-in driver: one exports a `cuMemAlloc`
//! allocation, the other opens the handle, reads what the first wrote and writes back, and the
//! first sees it. Also the driver's refusals: a stream-ordered allocation cannot be exported,
//! a process cannot open its own handle.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;

use cudarc::driver::sys::{self, CUresult as E};
use support::{child, expect, ok, primary_context, role};

const TEST: &str = "a_handle_opens_the_same_memory_in_another_process";
const WORDS: usize = 1024;

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn read_words(ptr: u64) -> Vec<u32> {
    let mut v = vec![0u32; WORDS];
    // SAFETY: `ptr` is device memory of WORDS words; `v` holds as many.
    ok("download", unsafe {
        sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), ptr, WORDS * 4)
    });
    v
}

/// The exporting side: prints its handle, waits for the importer, checks its writes.
fn exporter() {
    primary_context(0);
    // SAFETY (whole body): raw driver calls with valid out-pointers and handles made here.
    unsafe {
        let mut ptr = 0;
        ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut ptr, WORDS * 4));
        ok("fill", sys::cuMemsetD32_v2(ptr, 0x1111_1111, WORDS));
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        let mut pooled = 0;
        ok(
            "cuMemAllocAsync",
            sys::cuMemAllocAsync(&mut pooled, 256, std::ptr::null_mut()),
        );
        expect(
            "exporting a stream-ordered allocation",
            sys::cuIpcGetMemHandle(&mut handle, pooled),
            E::CUDA_ERROR_INVALID_VALUE,
        );
        ok(
            "cuIpcGetMemHandle",
            sys::cuIpcGetMemHandle(&mut handle, ptr),
        );
        let mut own = 0;
        expect(
            "opening this process's own handle",
            sys::cuIpcOpenMemHandle_v2(&mut own, handle, 1),
            E::CUDA_ERROR_INVALID_CONTEXT,
        );
        let bytes: Vec<u8> = handle.reserved.iter().map(|&c| c as u8).collect();
        println!("HANDLE {}", hex(&bytes));
        std::io::stdout().flush().unwrap();
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "written", "the parent's signal");
        let words = read_words(ptr);
        assert!(
            words[..256].iter().all(|&w| w == 0x2222_2222),
            "the importer's writes"
        );
        assert!(
            words[256..].iter().all(|&w| w == 0x1111_1111),
            "the rest untouched"
        );
        ok("cuMemFree", sys::cuMemFree_v2(ptr));
    }
}

/// The importing side: opens the handle (twice: the same address), reads, writes, closes.
fn importer(handle: &str) {
    primary_context(0);
    let bytes = unhex(handle);
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(&bytes) {
        *d = *s as _;
    }
    // SAFETY (whole body): raw driver calls with valid out-pointers.
    unsafe {
        let (mut p, mut q) = (0, 0);
        ok(
            "cuIpcOpenMemHandle",
            sys::cuIpcOpenMemHandle_v2(&mut p, h, 1),
        );
        ok("open again", sys::cuIpcOpenMemHandle_v2(&mut q, h, 1));
        assert_eq!(p, q, "a handle opened twice maps once");
        assert!(
            read_words(p).iter().all(|&w| w == 0x1111_1111),
            "the exporter's data"
        );
        ok("write", sys::cuMemsetD32_v2(p, 0x2222_2222, 256));
        ok("sync", sys::cuCtxSynchronize());
        ok("close", sys::cuIpcCloseMemHandle(p));
        ok("close the second open", sys::cuIpcCloseMemHandle(q));
        expect(
            "a third close",
            sys::cuIpcCloseMemHandle(p),
            E::CUDA_ERROR_INVALID_VALUE,
        );
    }
}

#[test]
fn a_handle_opens_the_same_memory_in_another_process() {
    match role().as_deref() {
        Some("export") => return exporter(),
        Some("import") => return importer(&std::env::var("HANDLE").unwrap()),
        _ => {}
    }
    let mut exp = child(TEST, "export")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        // Its refusals are expected: quiet, so the harness's output stays the test's.
        .env("CUDA_STUB_QUIET", "1")
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(exp.stdout.take().unwrap());
    let handle = loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the exporter ended without a handle"
        );
        // The harness may have begun the line with the test's name.
        if let Some(at) = line.find("HANDLE ") {
            break line[at + "HANDLE ".len()..].trim().to_string();
        }
    };
    let imp = child(TEST, "import")
        .env("HANDLE", &handle)
        .output()
        .unwrap();
    assert!(
        imp.status.success(),
        "importer: {}\n{}",
        String::from_utf8_lossy(&imp.stdout),
        String::from_utf8_lossy(&imp.stderr)
    );
    writeln!(exp.stdin.as_mut().unwrap(), "written").unwrap();
    let status = exp.wait().unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    assert!(status.success(), "exporter: {rest}");
}
