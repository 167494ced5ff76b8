//! The `cuda` backend end to end on the stand-in CUDA driver (`kernels-rs/cuda-stub`): the
//! trained `kimi-chat-tiny` decoded greedily by `model run --backend cuda` — `GpuContext`, the
//! device executor, graph capture and replay of every decode step — prints the CPU backend's
//! tokens; so does `--tp 2`, two rank processes summing over the CUDA IPC all-reduce, on one
//! device shared by both and on two SM90 devices. And `GpuContext` used from threads other
//! than the one that made it: the driver needs the context current on each. And the server:
//! `model serve --backend cuda --tensor-parallel-size 2` answers a chat completion as the CPU
//! server does.

use std::process::Command;

use kernels::cuda::{GpuContext, default_ptx_dir};
use kernels::device::{Device, DeviceExt, DeviceMemory, KernelParams, LaunchConfig};
use project_tests::golden_path;
use project_tests::stub_driver::{StubDriver, is_child};
use serde_json::Value;

// `model serve` as a child process: the model crate's test harness, shared.
#[allow(dead_code)]
#[path = "../../model/tests/common/server.rs"]
mod server;
use server::Server;

/// The first golden chat prompt's token ids.
fn prompt() -> String {
    let golden: Value = serde_json::from_str(
        &std::fs::read_to_string(golden_path("serving").join("chat_model_golden.json")).unwrap(),
    )
    .unwrap();
    golden["cases"][0]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Runs `model run` with `extra` arguments; its `sequence` lines, and its log.
fn run(mut cmd: Command, extra: &[&str]) -> (Vec<String>, String) {
    let dir = golden_path("models").join("kimi-chat-tiny");
    let out = cmd
        .arg("run")
        .arg("--checkpoint")
        .arg(&dir)
        .args(["--prompt", &prompt(), "--max-new-tokens", "24"])
        .args(extra)
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "model run {extra:?}:\n{log}");
    let lines = log
        .lines()
        .filter(|l| l.starts_with("sequence"))
        .map(str::to_string)
        .collect();
    (lines, log)
}

/// What a run is, its arguments and its environment.
type Case = (
    &'static str,
    &'static [&'static str],
    &'static [(&'static str, &'static str)],
);

#[test]
fn greedy_decode_on_the_cuda_backend_prints_the_cpus_tokens() {
    let stub = StubDriver::get();
    let (cpu, _) = run(stub.model_without_driver(), &["--backend", "cpu"]);
    assert_eq!(cpu.len(), 1, "one sequence: {cpu:?}");
    let cases: [Case; 3] = [
        ("one RTX PRO 6000", &["--backend", "cuda"], &[]),
        (
            "--tp 2 on one device",
            &["--backend", "cuda", "--tp", "2"],
            &[],
        ),
        (
            "--tp 2 on two H100s",
            &["--backend", "cuda", "--tp", "2"],
            &[
                ("CUDA_STUB_DEVICE", "h100"),
                ("CUDA_STUB_DEVICE_COUNT", "2"),
            ],
        ),
    ];
    for (what, args, env) in cases {
        let mut cmd = stub.model();
        cmd.envs(env.iter().copied());
        let (cuda, log) = run(cmd, args);
        // It ran on the stand-in's device, not on a fallback.
        assert!(
            log.contains("(cuda-stub)"),
            "{what}: no stand-in device in\n{log}"
        );
        assert_eq!(
            cuda, cpu,
            "{what}: the device's greedy tokens differ from the CPU's"
        );
    }
}

#[test]
fn a_gpu_context_binds_its_context_on_every_thread_that_calls_the_driver() {
    const TEST: &str = "a_gpu_context_binds_its_context_on_every_thread_that_calls_the_driver";
    if !is_child() {
        let out = StubDriver::get().this_test(TEST).output().unwrap();
        assert!(
            out.status.success(),
            "{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let gpu = GpuContext::new(0, default_ptx_dir()).unwrap();
    let kernel = gpu
        .load_kernel("layers", "default", "argmax_rows", 0)
        .unwrap();
    let logits: Vec<f32> = (0..1000).map(|i| ((i * 7919) % 1009) as f32).collect();
    let d_logits = gpu.upload(&logits).unwrap();
    let mut ids = gpu.alloc_elements::<i32>(1).unwrap();
    // Each call on a thread of its own, which has never had a context current.
    std::thread::scope(|s| {
        s.spawn(|| gpu.fill_prefix(&mut ids, 4, 0xff).unwrap())
            .join()
            .unwrap()
    });
    std::thread::scope(|s| {
        s.spawn(|| {
            let (pl, vocab, pi) = (d_logits.device_ptr(), 1000i32, ids.device_ptr());
            let mut p = KernelParams::new();
            p.arg(&pl).arg(&vocab).arg(&pi);
            let cfg = LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argmax_rows(const float*, int, int*) with a row of 1000 values and one id.
            unsafe { gpu.launch(&kernel, cfg, &p) }.unwrap();
        })
        .join()
        .unwrap()
    });
    let best = logits.iter().cloned().fold(f32::MIN, f32::max);
    let want = logits.iter().position(|&x| x == best).unwrap() as i32;
    assert_eq!(gpu.download::<i32>(&ids).unwrap(), [want]);
}

#[test]
fn an_all_reduce_whose_policy_picks_nccl_runs_without_it() {
    const TEST: &str = "an_all_reduce_whose_policy_picks_nccl_runs_without_it";
    if !is_child() {
        let out = StubDriver::get().this_test(TEST).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert!(
            stderr.contains("NCCL is unavailable"),
            "no line saying so:\n{stderr}"
        );
        return;
    }
    use kernels::allreduce::cost::Choice;
    use kernels::allreduce::cuda::{CudaIpcCommunicator, CudaIpcConfig};
    use kernels::allreduce::tactic::ChoicePolicy;
    use kernels::allreduce::testing::rank_input;
    use kernels::allreduce::{AllReduce, Islands, reference_reduce};
    let config = CudaIpcConfig {
        policy: ChoicePolicy::fixed(Choice::Nccl),
        islands: Some(Islands::contiguous(&[1, 1]).unwrap()),
        ..CudaIpcConfig::default()
    };
    let mut comms = CudaIpcCommunicator::in_process_group(2, config).unwrap();
    let inputs: Vec<Vec<f32>> = (0..2).map(|r| rank_input(5, r, 1000)).collect();
    let refs: Vec<&[f32]> = inputs.iter().map(Vec::as_slice).collect();
    let used = comms[0].choose(4000);
    let Choice::Custom(algorithm) = used else {
        panic!("the policy still picks {used:?}");
    };
    let expected = reference_reduce(algorithm, &refs, None, comms[0].islands());
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter_mut()
            .zip(&inputs)
            .map(|(c, x)| {
                s.spawn(move || {
                    let mut d = x.clone();
                    c.all_reduce_f32(&mut d, None).unwrap();
                    d
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for out in outs {
        assert!(out == expected, "{algorithm}: not the reference sum");
    }
}

/// `(reasoning, content)` of the seeds' greedy question to `model serve` started by `cmd` with
/// `extra` arguments, and the server's log.
fn serve_one_chat(mut cmd: Command, extra: &[&str]) -> ((String, String), String) {
    let logs = tempfile::tempdir().unwrap();
    let log_path = logs.path().join("serve.log");
    cmd.stderr(std::fs::File::create(&log_path).unwrap());
    let mut args = vec!["--max-model-len", "256", "--max-num-seqs", "2"];
    args.extend_from_slice(extra);
    let server = Server::start_with(cmd, &args);
    let request = r#"{"messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}], "max_tokens": 48, "temperature": 0}"#;
    let (status, body) = server.post("/v1/chat/completions", request);
    drop(server);
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert_eq!(status, 200, "{body}\n{log}");
    let reply: Value = serde_json::from_str(&body).unwrap();
    let message = &reply["choices"][0]["message"];
    let field = |f: &str| message[f].as_str().unwrap_or_default().to_string();
    ((field("reasoning"), field("content")), log)
}

#[test]
fn serve_on_the_cuda_backend_over_two_ranks_answers_as_the_cpu_server_does() {
    let stub = StubDriver::get();
    let (on_cpu, _) = serve_one_chat(stub.model_without_driver(), &[]);
    // The server fills --gpu-memory-utilization of each GPU with the latent cache: two
    // stand-in GPUs of 512 MiB, which this host's memory backs.
    let mut on_two_gpus = stub.model();
    on_two_gpus.envs([
        ("CUDA_STUB_DEVICE_COUNT", "2"),
        ("CUDA_STUB_MEMORY_MIB", "512"),
    ]);
    let (on_cuda, log) = serve_one_chat(
        on_two_gpus,
        &["--backend", "cuda", "--tensor-parallel-size", "2"],
    );
    assert!(log.contains("(cuda-stub)"), "no stand-in device in\n{log}");
    assert!(
        !on_cpu.1.is_empty(),
        "the CPU server said nothing: {on_cpu:?}"
    );
    assert_eq!(on_cuda, on_cpu, "the CPU server's answer");
}
