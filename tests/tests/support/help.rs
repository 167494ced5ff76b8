//! `BINARY --help` for every binary of the workspace: usage on stdout and exit 0, with no side
//! effect — nothing written into the working directory, the model cache or the repository.
//! Each crate's `tests/help.rs` includes this file (`#[path]`) and runs it on its binaries
//! (`CARGO_BIN_EXE_*` exist only for a test's own package).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Longest a `--help` may take: one that starts the work it describes is caught, not waited
/// for.
const HELP_TIMEOUT: Duration = Duration::from_secs(60);

/// `git status --porcelain` of `root`, untracked files included; `None` where git is not
/// installed or `root` is not a checkout (a source tarball): that part of the check is
/// skipped there.
pub fn git_status(root: &Path) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["status", "--porcelain", "--untracked-files=all"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Every entry under `dir`, recursively (empty folders included).
fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let path = e.path();
        if path.is_dir() {
            out.extend(entries(&path));
        }
        out.push(path);
    }
    out
}

/// Runs `exe --help` from an empty working directory with an empty model cache and home, and
/// checks: exit status 0 within [`HELP_TIMEOUT`], a usage text naming `name` on stdout,
/// nothing created in either folder, `git status` of `repo` unchanged.
pub fn check_help(exe: &Path, name: &str, repo: &Path) {
    let scratch = std::env::temp_dir().join(format!("help-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (cwd, home) = (scratch.join("cwd"), scratch.join("home"));
    std::fs::create_dir_all(&cwd).unwrap();
    std::fs::create_dir_all(&home).unwrap();
    let before = git_status(repo);
    let mut child = Command::new(exe)
        .arg("--help")
        .current_dir(&cwd)
        .env("HOME", &home)
        .env("XDG_CACHE_HOME", &home)
        // gpu-check's and allreduce-gpu-check's results folder.
        .env_remove("OUT")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{name}: {}: {e}", exe.display()));
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > HELP_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name} --help still ran after {HELP_TIMEOUT:?}: it does work");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{name} --help: {}\n{stdout}{stderr}",
        out.status
    );
    assert!(
        stdout.to_lowercase().contains("usage:") && stdout.contains(name),
        "{name} --help printed no usage naming it:\n{stdout}{stderr}"
    );
    for dir in [&cwd, &home] {
        let created = entries(dir);
        assert!(created.is_empty(), "{name} --help wrote {created:?}");
    }
    if let Some(before) = before {
        assert_eq!(
            git_status(repo).as_deref(),
            Some(before.as_str()),
            "{name} --help changed the repository"
        );
    }
    std::fs::remove_dir_all(&scratch).unwrap();
}

/// The workspace root of a crate whose manifest folder is `manifest_dir`.
pub fn workspace_root(manifest_dir: &str) -> PathBuf {
    Path::new(manifest_dir).parent().unwrap().to_path_buf()
}
