//! Writes tensors as sharded safetensors with `model.safetensors.index.json`, the layout
//! Hugging Face checkpoints (and NVIDIA's NVFP4 releases) use, and stages every output
//! ([`StagedOutput`]) so that no writer destroys its input or leaves a half-written result.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;

use crate::checkpoint::INDEX_FILE;
use crate::cleanup;
use crate::input::InvalidInput;

/// One tensor to write.
pub struct OwnedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl OwnedTensor {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) -> Self {
        let tensor = Self {
            name: name.into(),
            dtype,
            shape,
            bytes,
        };
        debug_assert_eq!(
            tensor.bytes.len() * 8,
            tensor.shape.iter().product::<usize>() * tensor.dtype.bitsize(),
            "{}",
            tensor.name
        );
        tensor
    }

    pub fn f32_scalar(name: impl Into<String>, value: f32) -> Self {
        Self::new(name, Dtype::F32, vec![], value.to_le_bytes().to_vec())
    }

    pub fn bf16(name: impl Into<String>, shape: Vec<usize>, values: &[half::bf16]) -> Self {
        Self::new(
            name,
            Dtype::BF16,
            shape,
            bytemuck::cast_slice(values).to_vec(),
        )
    }

    pub fn f32(name: impl Into<String>, shape: Vec<usize>, values: &[f32]) -> Self {
        Self::new(
            name,
            Dtype::F32,
            shape,
            bytemuck::cast_slice(values).to_vec(),
        )
    }
}

/// Writes `tensors` as one safetensors file.
pub fn write_file(path: &Path, tensors: &[OwnedTensor]) -> Result<()> {
    let views = tensors
        .iter()
        .map(|t| {
            Ok((
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    safetensors::serialize_to_file(views, None, path)
        .with_context(|| format!("writing {}", path.display()))?;
    sync_file(path)
}

/// Flushes a written file to the disk, so that a rename that publishes it never publishes a
/// file whose data is still only in the page cache.
fn sync_file(path: &Path) -> Result<()> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("flushing {}", path.display()))
}

/// Writes `bytes` to `path` through a temporary sibling and a rename, so `path` holds either
/// its old content or all of the new.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().to_string());
    let temp = path.with_file_name(format!(
        ".{}.partial-{}",
        name.unwrap_or_default(),
        std::process::id()
    ));
    let _registration = cleanup::register_path(&temp);
    let written = std::fs::write(&temp, bytes)
        .map_err(anyhow::Error::from)
        .and_then(|()| sync_file(&temp))
        .and_then(|()| std::fs::rename(&temp, path).map_err(anyhow::Error::from));
    if written.is_err() {
        let _ = std::fs::remove_file(&temp);
    }
    written.with_context(|| format!("writing {}", path.display()))
}

/// Splits `tensors` into shards of at most `max_shard_bytes` (in the given order) and writes
/// them with their index into `dir`.
pub fn write_sharded(dir: &Path, tensors: Vec<OwnedTensor>, max_shard_bytes: usize) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut shards: Vec<Vec<OwnedTensor>> = vec![Vec::new()];
    let mut current = 0usize;
    for tensor in tensors {
        if current > 0 && current + tensor.bytes.len() > max_shard_bytes {
            shards.push(Vec::new());
            current = 0;
        }
        current += tensor.bytes.len();
        shards.last_mut().expect("one shard").push(tensor);
    }
    let count = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0usize;
    let progress = crate::checkpoint::progress_bar(count as u64, "writing shards");
    for (i, shard) in shards.iter().enumerate() {
        let file_name = format!("model-{:05}-of-{:05}.safetensors", i + 1, count);
        let path = dir.join(&file_name);
        write_file(&path, shard)?;
        for t in shard {
            total_size += t.bytes.len();
            weight_map.insert(t.name.clone(), file_name.clone());
        }
        progress.inc(1);
    }
    progress.finish_and_clear();
    let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
    write_atomic(
        &dir.join(INDEX_FILE),
        serde_json::to_string_pretty(&index)?.as_bytes(),
    )
}

/// What a [`StagedOutput`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// A checkpoint folder.
    Folder,
    /// One file.
    File,
}

/// An output written under a temporary sibling name (`.NAME.partial-PID`) and moved into place
/// by [`StagedOutput::commit`], so that a run that stops early leaves either the old output or
/// none, never a half-written one that loads. The temporary is removed on error (drop) and on
/// interruption (see [`crate::cleanup`]); one left by a killed process is swept by the next
/// writer into the same folder.
pub struct StagedOutput {
    target: PathBuf,
    staging: PathBuf,
    committed: bool,
    _registration: cleanup::Registration,
    // Dropped after the staging is gone, so the next writer finds a settled output.
    _lock: OutputLock,
}

impl StagedOutput {
    /// Checks `output` against `inputs` and prepares the staging place. Refuses, as
    /// [`InvalidInput`], an output that is one of the inputs, lies inside one or contains one
    /// (after resolving `.`, `..` and symbolic links), an existing output that is not an
    /// empty folder unless `force` is given (then it is replaced as a whole at commit), and an
    /// output another writer is writing.
    pub fn new(output: &Path, inputs: &[&Path], kind: OutputKind, force: bool) -> Result<Self> {
        Self::create(output, inputs, kind, force, LockWait::Refuse)
    }

    /// As [`StagedOutput::new`], but waits while another writer writes `output` instead of
    /// refusing: for a cache that any number of processes may fill at once, where the caller
    /// checks, once this returns, whether the other writer already filled it.
    pub fn new_waiting(
        output: &Path,
        inputs: &[&Path],
        kind: OutputKind,
        force: bool,
    ) -> Result<Self> {
        Self::create(output, inputs, kind, force, LockWait::Wait)
    }

    fn create(
        output: &Path,
        inputs: &[&Path],
        kind: OutputKind,
        force: bool,
        wait: LockWait,
    ) -> Result<Self> {
        let target = resolve(output)
            .with_context(|| format!("resolving the output path {}", output.display()))?;
        for input in inputs {
            let input_real = input
                .canonicalize()
                .with_context(|| format!("resolving the input path {}", input.display()))?;
            let (out, inp) = (output.display(), input.display());
            if target == input_real {
                return Err(InvalidInput(format!(
                    "the output {out} is the input {inp}; write to a new folder"
                ))
                .into());
            }
            if target.starts_with(&input_real) {
                return Err(InvalidInput(format!(
                    "the output {out} lies inside the input {inp}; write outside it"
                ))
                .into());
            }
            if input_real.starts_with(&target) {
                return Err(InvalidInput(format!(
                    "the input {inp} lies inside the output {out}, which would be replaced"
                ))
                .into());
            }
        }
        let (parent, name) = match (target.parent(), target.file_name()) {
            (Some(parent), Some(name)) => {
                (parent.to_path_buf(), name.to_string_lossy().to_string())
            }
            _ => {
                return Err(InvalidInput(format!(
                    "the output {} is not a file path",
                    output.display()
                ))
                .into());
            }
        };
        std::fs::create_dir_all(&parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        // Taken before the output is looked at: of two writers racing to a new output, both
        // would find it absent and the second would replace the first's finished output.
        let lock = OutputLock::take(output, &parent, &name, wait)?;
        if let Ok(meta) = std::fs::symlink_metadata(&target) {
            let empty_folder = kind == OutputKind::Folder
                && meta.is_dir()
                && std::fs::read_dir(&target)
                    .with_context(|| format!("reading {}", target.display()))?
                    .next()
                    .is_none();
            if !empty_folder && !force {
                return Err(InvalidInput(format!(
                    "the output {} already exists{}; pass --force to replace it as a whole",
                    output.display(),
                    if meta.is_dir() {
                        " and is not empty"
                    } else {
                        ""
                    }
                ))
                .into());
            }
        }
        sweep_dead_stagings(&parent, &name);
        let staging = parent.join(staging_name(&name, "partial", std::process::id()));
        let registration = cleanup::register_path(&staging);
        cleanup::remove_path(&staging);
        if kind == OutputKind::Folder {
            std::fs::create_dir(&staging)
                .with_context(|| format!("creating {}", staging.display()))?;
        }
        Ok(Self {
            target,
            staging,
            committed: false,
            _registration: registration,
            _lock: lock,
        })
    }

    /// Where to write: the staging folder (or file).
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// Moves the staged output into place, replacing what was there as a whole.
    pub fn commit(mut self) -> Result<()> {
        let moved = if std::fs::symlink_metadata(&self.target).is_ok() {
            self.replace_existing()
        } else {
            std::fs::rename(&self.staging, &self.target)
        };
        moved.with_context(|| {
            format!(
                "moving {} to {}",
                self.staging.display(),
                self.target.display()
            )
        })?;
        self.committed = true;
        if let Some(parent) = self.target.parent() {
            // Makes the rename durable; some filesystems cannot sync a folder, which is fine.
            let _ = std::fs::File::open(parent).and_then(|f| f.sync_all());
        }
        Ok(())
    }

    /// Swaps the staged output with the existing one in one step where the kernel can
    /// (`renameat2(RENAME_EXCHANGE)`), else in two renames through `.NAME.old-PID`; then removes
    /// the old one.
    fn replace_existing(&mut self) -> std::io::Result<()> {
        if exchange(&self.staging, &self.target).is_ok() {
            // The staging name now holds the old output; it stays registered until removed.
            cleanup::remove_path(&self.staging);
            return Ok(());
        }
        let parent = self.target.parent().unwrap_or(Path::new("."));
        let name = self
            .target
            .file_name()
            .unwrap_or_default()
            .to_string_lossy();
        let old = parent.join(staging_name(&name, "old", std::process::id()));
        let _registration = cleanup::register_path(&old);
        cleanup::remove_path(&old);
        std::fs::rename(&self.target, &old)?;
        std::fs::rename(&self.staging, &self.target)?;
        cleanup::remove_path(&old);
        Ok(())
    }
}

impl Drop for StagedOutput {
    fn drop(&mut self) {
        if !self.committed {
            cleanup::remove_path(&self.staging);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LockWait {
    Refuse,
    Wait,
}

/// One writer's hold on an output: an advisory lock (`flock`) on `.NAME.lock` beside it, held
/// from the checks to the commit. The kernel lets go of it when its process ends, however it
/// ends, so the file a killed writer leaves blocks no one: the next writer takes the lock on
/// it and removes it when done.
struct OutputLock {
    path: PathBuf,
    _file: std::fs::File,
    _registration: cleanup::Registration,
}

impl OutputLock {
    fn take(output: &Path, parent: &Path, name: &str, wait: LockWait) -> Result<Self> {
        let path = parent.join(format!(".{name}.lock"));
        loop {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .with_context(|| format!("creating the lock file {}", path.display()))?;
            match wait {
                LockWait::Wait => file.lock(),
                LockWait::Refuse => file.try_lock().map_err(|e| match e {
                    std::fs::TryLockError::WouldBlock => std::io::ErrorKind::WouldBlock.into(),
                    std::fs::TryLockError::Error(e) => e,
                }),
            }
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock => anyhow::Error::new(InvalidInput(format!(
                    "the output {} is being written by another writer, which holds {}; wait \
                     for it to finish or write elsewhere",
                    output.display(),
                    path.display()
                ))),
                _ => anyhow::Error::new(e).context(format!("locking {}", path.display())),
            })?;
            // A writer that was done removed the file before letting go, so the lock may be
            // on a file no longer at the path, which guards nothing: take the one there now.
            if same_file(&file, &path) {
                return Ok(Self {
                    _registration: cleanup::register_path(&path),
                    path,
                    _file: file,
                });
            }
        }
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        // Removed while still held (the file closes after this), so a writer waiting on it
        // sees that it is gone and takes a new one.
        let _ = std::fs::remove_file(&self.path);
    }
}

fn same_file(file: &std::fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(open), Ok(named)) => open.dev() == named.dev() && open.ino() == named.ino(),
        _ => false,
    }
}

fn staging_name(name: &str, what: &str, pid: u32) -> String {
    format!(".{name}.{what}-{pid}")
}

/// Removes `.NAME.partial-PID` and `.NAME.old-PID` siblings whose process no longer exists:
/// what a killed writer left.
fn sweep_dead_stagings(parent: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().to_string();
        let pid = ["partial", "old"].iter().find_map(|what| {
            file_name
                .strip_prefix(&format!(".{name}.{what}-"))
                .and_then(|pid| pid.parse::<u32>().ok())
        });
        if let Some(pid) = pid
            && pid != std::process::id()
            && !cleanup::process_alive(pid)
        {
            cleanup::remove_path(&entry.path());
        }
    }
}

/// The absolute path `path` names, with symbolic links resolved in the part that exists and
/// `.`/`..` resolved in the part that does not yet.
fn resolve(path: &Path) -> std::io::Result<PathBuf> {
    let absolute = std::env::current_dir()?.join(path);
    let mut existing = absolute.as_path();
    let mut missing = Vec::new();
    let mut resolved = loop {
        match existing.canonicalize() {
            Ok(real) => break real,
            Err(e) => match (existing.parent(), existing.file_name()) {
                (Some(parent), Some(name)) => {
                    missing.push(name.to_os_string());
                    existing = parent;
                }
                // `..` or `.` last: let the lexical pass below handle it.
                (Some(parent), None) => {
                    missing.push(
                        existing
                            .components()
                            .next_back()
                            .map_or_else(Default::default, |c| c.as_os_str().to_os_string()),
                    );
                    existing = parent;
                }
                (None, _) => return Err(e),
            },
        }
    };
    for name in missing.iter().rev() {
        match Path::new(name).components().next() {
            Some(Component::ParentDir) => {
                resolved.pop();
            }
            Some(Component::CurDir) | None => {}
            Some(_) => resolved.push(name),
        }
    }
    Ok(resolved)
}

#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (a, b) = (c(a)?, c(b)?);
    // SAFETY: two valid NUL-terminated paths; renameat2 reads them and touches nothing else.
    let result = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Names starting with `.` in `dir`: staging folders and lock files.
    pub(crate) fn staged_names(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with('.'))
            .collect()
    }

    #[test]
    fn a_dropped_stage_leaves_nothing_and_a_commit_replaces_the_whole_output() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("old-shard"), b"old").unwrap();
        let refused = StagedOutput::new(&out, &[], OutputKind::Folder, false).err();
        let refused = refused
            .expect("a non-empty output needs --force")
            .to_string();
        assert!(refused.contains("--force"), "{refused}");

        let stage = StagedOutput::new(&out, &[], OutputKind::Folder, true).unwrap();
        std::fs::write(stage.path().join("new-shard"), b"new").unwrap();
        drop(stage);
        assert!(staged_names(dir.path()).is_empty());
        assert_eq!(std::fs::read(out.join("old-shard")).unwrap(), b"old");

        let stage = StagedOutput::new(&out, &[], OutputKind::Folder, true).unwrap();
        std::fs::write(stage.path().join("new-shard"), b"new").unwrap();
        stage.commit().unwrap();
        assert!(staged_names(dir.path()).is_empty());
        assert!(!out.join("old-shard").exists(), "replaced as a whole");
        assert_eq!(std::fs::read(out.join("new-shard")).unwrap(), b"new");
    }

    #[test]
    fn outputs_that_are_or_hold_or_sit_inside_the_input_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("in");
        std::fs::create_dir(&input).unwrap();
        std::fs::write(input.join("config.json"), b"{}").unwrap();
        std::os::unix::fs::symlink(&input, dir.path().join("link")).unwrap();
        let cases = [
            (input.clone(), "is the input"),
            (input.join("."), "is the input"),
            (dir.path().join("link"), "is the input"),
            (dir.path().join("in/../in/"), "is the input"),
            (input.join("sub/new"), "inside the input"),
            (dir.path().join("link/sub"), "inside the input"),
            (dir.path().to_path_buf(), "lies inside the output"),
        ];
        for (output, expected) in cases {
            let err = StagedOutput::new(&output, &[&input], OutputKind::Folder, true)
                .err()
                .unwrap_or_else(|| panic!("{} accepted", output.display()))
                .to_string();
            assert!(err.contains(expected), "{}: {err}", output.display());
        }
        assert_eq!(std::fs::read(input.join("config.json")).unwrap(), b"{}");
    }

    #[test]
    fn a_second_writer_is_refused_and_a_stale_lock_file_blocks_no_one() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let first = StagedOutput::new(&out, &[], OutputKind::Folder, false).unwrap();
        let err = StagedOutput::new(&out, &[], OutputKind::Folder, true)
            .err()
            .expect("refused while the first writes");
        assert!(err.is::<InvalidInput>(), "{err}");
        assert!(err.to_string().contains("another writer"), "{err}");
        drop(first);
        assert!(staged_names(dir.path()).is_empty(), "no lock file left");

        // What a killed writer leaves: the file, without the lock.
        std::fs::write(dir.path().join(".out.lock"), b"").unwrap();
        let stage = StagedOutput::new(&out, &[], OutputKind::Folder, false).unwrap();
        stage.commit().unwrap();
        assert_eq!(staged_names(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn stagings_of_dead_processes_are_swept() {
        let dir = tempfile::tempdir().unwrap();
        // Pids above the kernel's limit (at most 2^22) never exist.
        let dead = dir.path().join(staging_name("out", "partial", 1 << 23));
        std::fs::create_dir(&dead).unwrap();
        let alive = dir.path().join(staging_name("out", "partial", 1));
        std::fs::create_dir(&alive).unwrap();
        let stage = StagedOutput::new(&dir.path().join("out"), &[], OutputKind::File, false);
        std::fs::write(stage.unwrap().path(), b"x").unwrap();
        assert!(!dead.exists());
        assert!(alive.exists(), "pid 1 is alive");
    }

    #[test]
    fn atomic_writes_replace_the_whole_file_and_leave_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let index = dir.path().join(INDEX_FILE);
        write_atomic(&index, b"{\"old\": true}").unwrap();
        write_atomic(&index, b"{}").unwrap();
        assert_eq!(std::fs::read(&index).unwrap(), b"{}");
        assert!(staged_names(dir.path()).is_empty());
        let missing_folder = dir.path().join("none").join(INDEX_FILE);
        assert!(write_atomic(&missing_folder, b"{}").is_err());
        assert!(staged_names(dir.path()).is_empty());
    }

    #[test]
    fn relative_and_dotted_paths_resolve_lexically_where_they_do_not_exist() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        assert_eq!(
            resolve(&dir.path().join("a/./b/../c")).unwrap(),
            real.join("a/c")
        );
        assert_eq!(resolve(&dir.path().join(".")).unwrap(), real);
    }
}
