//! The stand-in driver called directly through cudarc's raw bindings: what the real driver
//! refuses, it refuses with the same code (capture on the legacy stream, allocation and
//! synchronous calls during a capture, a launch over 48 KB of dynamic shared memory without
//! the opt-in, a call without a current context), and what it allows runs in the driver's
//! order (copies, memsets and launches on a stream, the legacy stream against blocking and
//! non-blocking streams, events, capture → instantiate → launch → update).
//!
//! Each test runs its body in a child process that loads the stand-in (see `support`).

mod support;

use std::ffi::c_void;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cudarc::driver::sys::{
    self, CUfunction_attribute as Attr, CUresult as E, CUstreamCaptureMode as Mode,
};
use support::{child, expect, expect_success, function, load_module, ok, primary_context, role};

const NON_BLOCKING: u32 = 1;

fn stream(flags: u32) -> sys::CUstream {
    let mut s = null_mut();
    // SAFETY: out-parameter call.
    ok("cuStreamCreate", unsafe {
        sys::cuStreamCreate(&mut s, flags)
    });
    s
}

fn alloc(bytes: usize) -> u64 {
    let mut p = 0;
    // SAFETY: out-parameter call.
    ok("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut p, bytes) });
    p
}

fn download<T: Copy + Default>(src: u64, n: usize) -> Vec<T> {
    let mut v = vec![T::default(); n];
    // SAFETY: `v` holds n values; `src` is device memory of at least that many bytes.
    ok("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src, n * size_of::<T>())
    });
    v
}

fn end_capture(s: sys::CUstream) -> (E, sys::CUgraph) {
    let mut g = 0x1 as sys::CUgraph;
    // SAFETY: out-parameter call.
    let r = unsafe { sys::cuStreamEndCapture(s, &mut g) };
    (r, g)
}

#[test]
fn refusals_carry_the_real_drivers_codes() {
    if role().is_none() {
        expect_success(
            "child",
            &mut child("refusals_carry_the_real_drivers_codes", "run"),
        );
        return;
    }
    // SAFETY (whole body): raw driver calls with valid out-pointers and handles made here.
    unsafe {
        ok("cuInit", sys::cuInit(0));
        let mut p = 0;
        // A thread without a current context.
        expect(
            "cuMemAlloc without a context",
            sys::cuMemAlloc_v2(&mut p, 256),
            E::CUDA_ERROR_INVALID_CONTEXT,
        );
        let mut s = null_mut();
        expect(
            "cuStreamCreate without a context",
            sys::cuStreamCreate(&mut s, 0),
            E::CUDA_ERROR_INVALID_CONTEXT,
        );
        let (dev, ctx) = primary_context(0);
        let mut major = 0;
        ok(
            "compute capability",
            sys::cuDeviceGetAttribute(
                &mut major,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            ),
        );
        let sm = if major == 12 { "sm_120a" } else { "sm_90a" };

        // Capture may not begin on the legacy stream.
        expect(
            "capture on the legacy stream",
            sys::cuStreamBeginCapture_v2(null_mut(), Mode::CU_STREAM_CAPTURE_MODE_GLOBAL),
            E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        );

        // Allocation during a global capture is refused and invalidates it.
        let nb = stream(NON_BLOCKING);
        ok(
            "begin capture",
            sys::cuStreamBeginCapture_v2(nb, Mode::CU_STREAM_CAPTURE_MODE_GLOBAL),
        );
        expect(
            "cuMemAlloc during a capture",
            sys::cuMemAlloc_v2(&mut p, 256),
            E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        );
        let (r, g) = end_capture(nb);
        expect(
            "end of an invalidated capture",
            r,
            E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        );
        assert!(g.is_null(), "an invalidated capture gives no graph");

        // A synchronous memset (legacy stream) on the capturing thread, thread-local mode.
        let buf = alloc(1024);
        ok(
            "begin capture",
            sys::cuStreamBeginCapture_v2(nb, Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        );
        expect(
            "cuMemsetD8 during a capture",
            sys::cuMemsetD8_v2(buf, 0, 1024),
            E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        );
        expect(
            "end",
            end_capture(nb).0,
            E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        );

        // Another thread: a GLOBAL capture forbids its unsafe calls unless its own mode is
        // THREAD_LOCAL or RELAXED.
        ok(
            "begin capture",
            sys::cuStreamBeginCapture_v2(nb, Mode::CU_STREAM_CAPTURE_MODE_GLOBAL),
        );
        let ctx_addr = ctx as usize;
        let (refused, allowed) = std::thread::spawn(move || {
            ok("bind", sys::cuCtxSetCurrent(ctx_addr as sys::CUcontext));
            let mut q = 0;
            let refused = sys::cuMemAlloc_v2(&mut q, 64);
            let mut mode = Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            ok(
                "exchange mode",
                sys::cuThreadExchangeStreamCaptureMode(&mut mode),
            );
            (refused, sys::cuMemAlloc_v2(&mut q, 64))
        })
        .join()
        .unwrap();
        expect(
            "cuMemAlloc on another thread during a GLOBAL capture",
            refused,
            E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        );
        ok("cuMemAlloc on a THREAD_LOCAL thread", allowed);
        expect(
            "end",
            end_capture(nb).0,
            E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        );

        // Synchronizing the capturing stream, or the context, is refused too.
        ok(
            "begin capture",
            sys::cuStreamBeginCapture_v2(nb, Mode::CU_STREAM_CAPTURE_MODE_RELAXED),
        );
        expect(
            "cuCtxSynchronize during a capture",
            sys::cuCtxSynchronize(),
            E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        );
        expect(
            "end",
            end_capture(nb).0,
            E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        );

        // The legacy stream while a blocking stream captures.
        let blocking = stream(0);
        ok(
            "begin capture",
            sys::cuStreamBeginCapture_v2(blocking, Mode::CU_STREAM_CAPTURE_MODE_RELAXED),
        );
        expect(
            "memset on the legacy stream",
            sys::cuMemsetD8Async(buf, 0, 16, null_mut()),
            E::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        );
        expect(
            "end",
            end_capture(blocking).0,
            E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        );
        expect(
            "ending a capture that is not under way",
            end_capture(blocking).0,
            E::CUDA_ERROR_ILLEGAL_STATE,
        );

        // Dynamic shared memory above 48 KB needs the function's opt-in.
        let m = load_module("layers", "default", sm);
        let f = function(m, "route_noaux_tc");
        let max = |f| {
            let mut v = 0;
            ok(
                "max dynamic shared",
                sys::cuFuncGetAttribute(
                    &mut v,
                    Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    f,
                ),
            );
            v
        };
        assert_eq!(
            max(f),
            48 << 10,
            "the default limit (no static shared memory)"
        );
        // One row of 8 experts' router logits, top 2 of 1 group.
        let logits: [f32; 8] = [0.1, 2.0, -1.0, 0.5, 3.0, 0.0, 1.0, -2.0];
        let (d_logits, d_bias, d_ids, d_weights) = (alloc(32), alloc(32), alloc(8), alloc(8));
        ok(
            "upload",
            sys::cuMemcpyHtoD_v2(d_logits, logits.as_ptr().cast(), 32),
        );
        ok("bias", sys::cuMemsetD32Async(d_bias, 0, 8, nb));
        let (mut a0, mut a1, mut a8, mut a9) = (d_logits, d_bias, d_ids, d_weights);
        let (mut experts, mut groups, mut topk_group, mut top_k, mut norm) =
            (8i32, 1i32, 1i32, 2i32, 1i32);
        let mut scale = 1.0f32;
        let mut args: [*mut c_void; 10] = [
            (&mut a0 as *mut u64).cast(),
            (&mut a1 as *mut u64).cast(),
            (&mut experts as *mut i32).cast(),
            (&mut groups as *mut i32).cast(),
            (&mut topk_group as *mut i32).cast(),
            (&mut top_k as *mut i32).cast(),
            (&mut norm as *mut i32).cast(),
            (&mut scale as *mut f32).cast(),
            (&mut a8 as *mut u64).cast(),
            (&mut a9 as *mut u64).cast(),
        ];
        let launch = |bytes: u32, block: u32, args: &mut [*mut c_void; 10]| {
            sys::cuLaunchKernel(
                f,
                1,
                1,
                1,
                block,
                1,
                1,
                bytes,
                nb,
                args.as_mut_ptr(),
                null_mut(),
            )
        };
        expect(
            "a launch with 64 KB of dynamic shared memory without the opt-in",
            launch(64 << 10, 256, &mut args),
            E::CUDA_ERROR_INVALID_VALUE,
        );
        let mut optin = 0;
        ok(
            "opt-in limit",
            sys::cuDeviceGetAttribute(
                &mut optin,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                dev,
            ),
        );
        expect(
            "opting into more than the device allows",
            sys::cuFuncSetAttribute(
                f,
                Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                optin + 1,
            ),
            E::CUDA_ERROR_INVALID_VALUE,
        );
        ok(
            "opting into 64 KB",
            sys::cuFuncSetAttribute(
                f,
                Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                64 << 10,
            ),
        );
        assert_eq!(max(f), 64 << 10);
        expect(
            "a block of 2048 threads",
            launch(0, 2048, &mut args),
            E::CUDA_ERROR_INVALID_VALUE,
        );
        ok(
            "the same launch after the opt-in",
            launch(64 << 10, 256, &mut args),
        );
        ok("sync", sys::cuStreamSynchronize(nb));
        let ids: Vec<i32> = download(d_ids, 2);
        assert_eq!(ids, [4, 1], "the router's top 2 of {logits:?}");

        // A real cubin.
        let elf = [0x7fu8, b'E', b'L', b'F', 0, 0, 0, 0];
        let mut m2 = null_mut();
        expect(
            "a cubin on the stand-in",
            sys::cuModuleLoadData(&mut m2, elf.as_ptr().cast()),
            E::CUDA_ERROR_NO_BINARY_FOR_GPU,
        );

        // Error names and descriptions.
        let mut text = std::ptr::null();
        ok(
            "cuGetErrorName",
            sys::cuGetErrorName(E::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, &mut text),
        );
        assert_eq!(
            std::ffi::CStr::from_ptr(text).to_str().unwrap(),
            "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"
        );
        ok(
            "cuGetErrorString",
            sys::cuGetErrorString(E::CUDA_ERROR_INVALID_CONTEXT, &mut text),
        );
        assert_eq!(
            std::ffi::CStr::from_ptr(text).to_str().unwrap(),
            "invalid device context"
        );
    }
}

/// Host functions that wait for and set flags, to observe which stream waits for which.
static FLAGS: [AtomicU32; 4] = [const { AtomicU32::new(0) }; 4];

unsafe extern "C" fn set_flag(i: *mut c_void) {
    FLAGS[i as usize].store(1, Ordering::Release);
}

/// Waits (up to 2 s) for flag `i >> 8`, then sets flag `i & 0xff` to 1 if it came, 2 if not.
unsafe extern "C" fn wait_then_set(i: *mut c_void) {
    let (wait, set) = ((i as usize) >> 8, (i as usize) & 0xff);
    let t = Instant::now();
    while FLAGS[wait].load(Ordering::Acquire) == 0 && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let came = FLAGS[wait].load(Ordering::Acquire) != 0;
    FLAGS[set].store(if came { 1 } else { 2 }, Ordering::Release);
}

/// Sets flag `i & 0xff` to 1 if flag `i >> 8` is already set, 2 if not.
unsafe extern "C" fn check_then_set(i: *mut c_void) {
    let (check, set) = ((i as usize) >> 8, (i as usize) & 0xff);
    let was = FLAGS[check].load(Ordering::Acquire) != 0;
    FLAGS[set].store(if was { 1 } else { 2 }, Ordering::Release);
}

unsafe extern "C" fn sleep_50ms(_: *mut c_void) {
    std::thread::sleep(Duration::from_millis(50));
}

#[test]
fn streams_events_and_graphs_run_in_the_drivers_order() {
    if role().is_none() {
        expect_success(
            "child",
            &mut child("streams_events_and_graphs_run_in_the_drivers_order", "run"),
        );
        return;
    }
    // SAFETY (whole body): raw driver calls with valid out-pointers and handles made here;
    // host buffers outlive the copies that read them (each is waited for).
    unsafe {
        let (dev, _) = primary_context(0);
        let mut major = 0;
        ok(
            "compute capability",
            sys::cuDeviceGetAttribute(
                &mut major,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            ),
        );
        let sm = if major == 12 { "sm_120a" } else { "sm_90a" };
        let s = stream(NON_BLOCKING);

        // Copy, memset and launch on one stream: each sees the previous one's result.
        let (rows, vocab) = (3usize, 1000usize);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 7919) % 1009) as f32)
            .collect();
        let d_logits = alloc(logits.len() * 4);
        let d_ids = alloc(rows * 4);
        ok(
            "upload",
            sys::cuMemcpyHtoDAsync_v2(d_logits, logits.as_ptr().cast(), logits.len() * 4, s),
        );
        // Row 1's maximum overwritten after the upload, before the kernel reads it.
        ok(
            "memset",
            sys::cuMemsetD32Async(d_logits + 4 * (vocab as u64 + 17), 0x4f00_0000, 1, s),
        );
        let m = load_module("layers", "default", sm);
        let f = function(m, "argmax_rows");
        let (mut pl, mut v, mut pi) = (d_logits, vocab as i32, d_ids);
        let mut params = [
            (&mut pl as *mut u64).cast::<c_void>(),
            (&mut v as *mut i32).cast(),
            (&mut pi as *mut u64).cast(),
        ];
        ok(
            "launch",
            sys::cuLaunchKernel(
                f,
                rows as u32,
                1,
                1,
                256,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                null_mut(),
            ),
        );
        ok("sync", sys::cuStreamSynchronize(s));
        let ids: Vec<i32> = download(d_ids, rows);
        let mut expected: Vec<i32> = (0..rows)
            .map(|r| {
                let row = &logits[r * vocab..(r + 1) * vocab];
                let best = row.iter().cloned().fold(f32::MIN, f32::max);
                row.iter().position(|&x| x == best).unwrap() as i32
            })
            .collect();
        expected[1] = 17; // 0x4f000000 = 2^31, above every value
        assert_eq!(ids, expected, "argmax after the ordered upload and memset");

        // The legacy stream waits for a blocking stream's earlier work, not for a
        // non-blocking stream's.
        let blocking = stream(0);
        ok(
            "slow",
            sys::cuLaunchHostFunc(blocking, Some(sleep_50ms), null_mut()),
        );
        ok(
            "flag 0",
            sys::cuLaunchHostFunc(blocking, Some(set_flag), 0 as _),
        );
        // On the legacy stream: flag 0 must already be set (ordered after the blocking work).
        ok(
            "legacy",
            sys::cuLaunchHostFunc(null_mut(), Some(check_then_set), 1 as _),
        );
        ok("sync legacy", sys::cuStreamSynchronize(null_mut()));
        assert_eq!(FLAGS[1].load(Ordering::Acquire), 1);
        // The legacy stream waits for flag 2, which only a later non-blocking item sets: it
        // arrives only if that stream is not ordered behind the legacy one.
        ok(
            "legacy waits",
            sys::cuLaunchHostFunc(null_mut(), Some(wait_then_set), ((2 << 8) | 3) as _),
        );
        ok(
            "non-blocking sets",
            sys::cuLaunchHostFunc(s, Some(set_flag), 2 as _),
        );
        ok("sync", sys::cuCtxSynchronize());
        assert_eq!(
            FLAGS[3].load(Ordering::Acquire),
            1,
            "non-blocking ran alongside legacy"
        );

        // Events: not ready while the stream is busy, then an elapsed time the work took.
        let (mut e0, mut e1) = (null_mut(), null_mut());
        ok("event", sys::cuEventCreate(&mut e0, 0));
        ok("event", sys::cuEventCreate(&mut e1, 0));
        ok("record", sys::cuEventRecord(e0, s));
        ok(
            "slow",
            sys::cuLaunchHostFunc(s, Some(sleep_50ms), null_mut()),
        );
        ok("record", sys::cuEventRecord(e1, s));
        expect(
            "query while busy",
            sys::cuEventQuery(e1),
            E::CUDA_ERROR_NOT_READY,
        );
        ok("event sync", sys::cuEventSynchronize(e1));
        ok("query", sys::cuEventQuery(e1));
        let mut ms = 0f32;
        ok("elapsed", sys::cuEventElapsedTime_v2(&mut ms, e0, e1));
        assert!(ms >= 49.0, "elapsed {ms} ms over a 50 ms host function");

        // Capture → instantiate → launch: nothing runs while capturing; each launch runs the
        // captured memset and kernel on what the buffers hold then.
        ok(
            "begin capture",
            sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        );
        ok(
            "captured memset",
            sys::cuMemsetD32Async(d_ids, 0xffff_ffff, rows, s),
        );
        ok(
            "captured launch",
            sys::cuLaunchKernel(
                f,
                rows as u32,
                1,
                1,
                256,
                1,
                1,
                0,
                s,
                params.as_mut_ptr(),
                null_mut(),
            ),
        );
        let (r, graph) = end_capture(s);
        ok("end capture", r);
        assert_eq!(
            download::<i32>(d_ids, rows),
            expected,
            "capture ran nothing"
        );
        let mut exec = null_mut();
        ok(
            "instantiate",
            sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0),
        );
        for round in 0..2 {
            let mut next = logits.clone();
            for r in 0..rows {
                next[r * vocab + 100 + round] = 1e9;
            }
            ok(
                "upload",
                sys::cuMemcpyHtoDAsync_v2(d_logits, next.as_ptr().cast(), next.len() * 4, s),
            );
            ok("graph launch", sys::cuGraphLaunch(exec, s));
            ok("sync", sys::cuStreamSynchronize(s));
            assert_eq!(download::<i32>(d_ids, rows), vec![100 + round as i32; rows]);
        }
        // An update with another topology is refused.
        ok(
            "begin",
            sys::cuStreamBeginCapture_v2(s, Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
        );
        ok("captured memset", sys::cuMemsetD32Async(d_ids, 0, rows, s));
        let (r, other) = end_capture(s);
        ok("end capture", r);
        let mut info: sys::CUgraphExecUpdateResultInfo = std::mem::zeroed();
        expect(
            "update with another topology",
            sys::cuGraphExecUpdate_v2(exec, other, &mut info),
            E::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
        );
        assert_eq!(
            info.result,
            sys::CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED
        );
    }
}

/// A memset on the legacy stream (asynchronous to the host) and a kernel on a non-blocking
/// stream reading the same memory: nothing orders them, and the stand-in stops the process
/// saying so; an event wait orders them, and it runs.
#[test]
fn an_unordered_memset_stops_the_process_an_event_orders_it() {
    const TEST: &str = "an_unordered_memset_stops_the_process_an_event_orders_it";
    let Some(role) = role() else {
        let out = child(TEST, "unordered").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains("RACE: kernel argmax_rows"),
            "the unordered memset was not reported ({}):\n{stderr}",
            out.status
        );
        expect_success("the ordered child", &mut child(TEST, "ordered"));
        return;
    };
    // SAFETY (whole body): raw driver calls with valid out-pointers and handles made here.
    unsafe {
        let (dev, _) = primary_context(0);
        let mut major = 0;
        ok(
            "compute capability",
            sys::cuDeviceGetAttribute(
                &mut major,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            ),
        );
        let sm = if major == 12 { "sm_120a" } else { "sm_90a" };
        let f = function(load_module("layers", "default", sm), "argmax_rows");
        let s = stream(NON_BLOCKING);
        let (logits, ids) = (alloc(4096), alloc(4));
        ok("memset", sys::cuMemsetD32_v2(logits, 0, 1024));
        if role == "ordered" {
            let mut ev = null_mut();
            ok("event", sys::cuEventCreate(&mut ev, 0));
            ok(
                "record on the legacy stream",
                sys::cuEventRecord(ev, null_mut()),
            );
            ok("wait", sys::cuStreamWaitEvent(s, ev, 0));
        }
        let (mut pl, mut v, mut pi) = (logits, 1024i32, ids);
        let mut params = [
            (&mut pl as *mut u64).cast::<c_void>(),
            (&mut v as *mut i32).cast(),
            (&mut pi as *mut u64).cast(),
        ];
        ok(
            "launch",
            sys::cuLaunchKernel(f, 1, 1, 1, 256, 1, 1, 0, s, params.as_mut_ptr(), null_mut()),
        );
        ok("sync", sys::cuStreamSynchronize(s));
        assert_eq!(download::<i32>(ids, 1), [0], "all zeros: the first index");
    }
}
