//! What `--checkpoint` names: a folder (or, for `inspect` and `quantize`, a file), else a
//! Hugging Face repository id (`nvidia/Kimi-K2.5-NVFP4`) found in the local Hugging Face cache.
//!
//! Nothing is downloaded. The cache is the one `hf download` fills: `HF_HUB_CACHE`, else
//! `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` (the
//! order `huggingface_hub` documents). Inside it, `models--OWNER--NAME/refs/main` holds the
//! commit whose files are in `snapshots/COMMIT/` (symbolic links into `blobs/`, which the
//! loader follows); `hf-hub`'s offline cache lookup reads that layout.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::CheckpointError;

/// The file whose presence marks a snapshot as a checkpoint.
const MARKER_FILE: &str = "config.json";

/// Where `--checkpoint` (or `flag`) points: `arg` itself when it exists and can be read,
/// else the snapshot of the Hugging Face repository `arg` names. A path that does not exist
/// and is no repository id, one that cannot be read, and a repository that is not in the
/// cache are refused (exit 2), naming `flag` and `arg`.
pub fn resolve_checkpoint(flag: &'static str, arg: &Path) -> Result<PathBuf, CheckpointError> {
    let missing = |why: String| CheckpointError::Missing {
        flag,
        path: arg.to_path_buf(),
        why,
    };
    match std::fs::metadata(arg) {
        Ok(meta) => {
            // Opening a FIFO would wait for a writer: only folders and files are opened.
            let readable = if meta.is_dir() {
                std::fs::read_dir(arg).map(drop)
            } else if meta.is_file() {
                std::fs::File::open(arg).map(drop)
            } else {
                return Err(missing("is neither a folder nor a regular file".into()));
            };
            readable.map_err(|e| missing(format!("cannot be read: {e}")))?;
            Ok(arg.to_path_buf())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let Some(repo) = repo_id(arg) else {
                return Err(missing("no such file or folder".into()));
            };
            let Some(cache) = hub_cache_dir(|name| std::env::var_os(name)) else {
                return Err(CheckpointError::NotInHubCache {
                    flag,
                    repo: repo.to_string(),
                    looked_in: "no cache folder: set HF_HUB_CACHE or HF_HOME".into(),
                });
            };
            find_in_cache(&cache, repo).ok_or_else(|| CheckpointError::NotInHubCache {
                flag,
                repo: repo.to_string(),
                looked_in: format!("looked in {}", cache.display()),
            })
        }
        Err(e) => Err(missing(format!("cannot be read: {e}"))),
    }
}

/// `arg` as a Hugging Face repository id: `OWNER/NAME`, each part letters, digits, `-`, `_`
/// and `.`, not starting with `.` or `-`, without `--` or `..` (the rules the Hub applies).
pub fn repo_id(arg: &Path) -> Option<&str> {
    let text = arg.to_str()?;
    let (owner, name) = text.split_once('/')?;
    let part_ok = |part: &str| {
        !part.is_empty()
            && part.len() <= 96
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && !part.starts_with(['.', '-'])
            && !part.contains("--")
            && !part.contains("..")
    };
    (part_ok(owner) && part_ok(name)).then_some(text)
}

/// The Hugging Face cache folder `env` (an environment lookup) points to, in the order
/// `huggingface_hub` applies; `None` when no variable locates it.
pub fn hub_cache_dir(env: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| {
        env(name)
            .filter(|value| !value.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = set("HF_HUB_CACHE") {
        return Some(dir);
    }
    if let Some(home) = set("HF_HOME") {
        return Some(home.join("hub"));
    }
    let cache = set("XDG_CACHE_HOME").or_else(|| set("HOME").map(|home| home.join(".cache")))?;
    Some(cache.join("huggingface").join("hub"))
}

/// The snapshot folder of `repo`'s `main` revision in the cache at `cache`, when it holds the
/// checkpoint's `config.json`.
pub fn find_in_cache(cache: &Path, repo: &str) -> Option<PathBuf> {
    let marker = hf_hub::Cache::new(cache.to_path_buf())
        .model(repo.to_string())
        .get(MARKER_FILE)?;
    marker.parent().map(Path::to_path_buf)
}

/// How a checkpoint argument is named to the user: the repository id it was given as, else
/// the folder's path.
pub fn display_name(arg: &Path, resolved: &Path) -> String {
    match repo_id(arg) {
        Some(repo) if arg != resolved => repo.to_string(),
        _ => resolved.display().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repository_ids_are_owner_slash_name_and_paths_are_not() {
        for id in [
            "nvidia/Kimi-K2.5-NVFP4",
            "moonshotai/Kimi-K2.5",
            "a/b",
            "x_y/v1.2",
        ] {
            assert_eq!(repo_id(Path::new(id)), Some(id), "{id}");
        }
        for path in [
            "/abs/path",
            "./dir/x",
            "../x/y",
            "a/b/c",
            "dir/",
            "/x",
            "single",
            "a--b/c",
            "a/b..c",
            "a/.hidden",
            "-a/b",
            "a b/c",
        ] {
            assert_eq!(repo_id(Path::new(path)), None, "{path}");
        }
    }

    #[test]
    fn the_cache_folder_follows_the_documented_order() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let all = &[
            ("HF_HUB_CACHE", "/h/cache"),
            ("HF_HOME", "/h/home"),
            ("XDG_CACHE_HOME", "/h/xdg"),
            ("HOME", "/h/user"),
        ];
        assert_eq!(hub_cache_dir(env(all)), Some("/h/cache".into()));
        assert_eq!(
            hub_cache_dir(env(&all[1..])),
            Some(PathBuf::from("/h/home").join("hub"))
        );
        assert_eq!(
            hub_cache_dir(env(&all[2..])),
            Some(PathBuf::from("/h/xdg/huggingface/hub"))
        );
        assert_eq!(
            hub_cache_dir(env(&all[3..])),
            Some(PathBuf::from("/h/user/.cache/huggingface/hub"))
        );
        // An empty variable is an unset one.
        assert_eq!(
            hub_cache_dir(env(&[("HF_HUB_CACHE", ""), ("HF_HOME", "/h/home")])),
            Some(PathBuf::from("/h/home/hub"))
        );
        assert_eq!(hub_cache_dir(env(&[])), None);
    }

    /// A cache as `hf download` leaves it: the files in `blobs/`, the snapshot's names
    /// symbolic links to them, `refs/main` the commit.
    #[test]
    fn a_cached_repository_resolves_to_its_main_snapshot() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache.path().join("models--owner--tiny");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        let snapshot = repo.join("snapshots").join(commit);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::write(repo.join("blobs").join("c0ffee"), "{}").unwrap();
        std::os::unix::fs::symlink("../../blobs/c0ffee", snapshot.join("config.json")).unwrap();
        // No ref yet: not in the cache.
        assert_eq!(find_in_cache(cache.path(), "owner/tiny"), None);
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs").join("main"), commit).unwrap();
        assert_eq!(find_in_cache(cache.path(), "owner/tiny"), Some(snapshot));
        assert_eq!(find_in_cache(cache.path(), "owner/other"), None);
        // A ref to a commit whose snapshot lacks the config is no checkpoint.
        std::fs::write(repo.join("refs").join("main"), "ffff").unwrap();
        assert_eq!(find_in_cache(cache.path(), "owner/tiny"), None);
    }

    #[test]
    fn an_existing_path_wins_over_a_repository_id_and_a_missing_one_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("owner");
        std::fs::create_dir_all(folder.join("name")).unwrap();
        let resolved = resolve_checkpoint("--checkpoint", &folder.join("name")).unwrap();
        assert_eq!(resolved, folder.join("name"));
        let fifo = dir.path().join("fifo");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let text = resolve_checkpoint("--checkpoint", &fifo)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("is neither a folder nor a regular file"),
            "{text}"
        );
        let missing = dir.path().join("nothing");
        let err = resolve_checkpoint("--checkpoint", &missing).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("--checkpoint {}", missing.display()))
                && text.contains("no such file or folder"),
            "{text}"
        );
    }
}
