//! A checkpoint compiled into the binary (the default chat model), unpacked into a cache folder
//! on first use and checked against the embedded bytes on every later one: a cache that lost a
//! file or its `.complete` marker, or whose bytes changed on disk, is unpacked again (saying so
//! on stderr) instead of failing or being used as it is.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::checkpoint::writer::{OutputKind, StagedOutput};

/// One file of an embedded checkpoint: its name in the folder and its bytes.
pub type EmbeddedFile<'a> = (&'a str, &'a [u8]);

/// Marks a folder whose every file was written; holds the checkpoint's checksum.
const COMPLETE_MARKER: &str = ".complete";

/// The folder `NAME-CHECKSUM` under `cache`, holding `files` as embedded: unpacked when it is
/// missing, and unpacked again when it is damaged. Processes that unpack the same model at once
/// wait for each other.
pub fn unpack(cache: &Path, name: &str, files: &[EmbeddedFile<'_>]) -> Result<PathBuf> {
    let checksum = checksum_of_all(files);
    let dir = cache.join(format!("{name}-{checksum:016x}"));
    let Some(found) = damage(&dir, files) else {
        return Ok(dir);
    };
    let stage = StagedOutput::new_waiting(&dir, &[], OutputKind::Folder, true)
        .with_context(|| format!("unpacking the default model into {}", dir.display()))?;
    if damage(&dir, files).is_none() {
        // Another process unpacked it while this one waited.
        return Ok(dir);
    }
    if let Damage::Damaged(why) = found {
        eprintln!(
            "the cached default model {} is damaged ({why}); unpacking it again",
            dir.display()
        );
    }
    for (file, bytes) in files {
        let path = stage.path().join(file);
        std::fs::write(&path, bytes).with_context(|| format!("writing {}", path.display()))?;
    }
    let marker = stage.path().join(COMPLETE_MARKER);
    std::fs::write(&marker, format!("{checksum:016x}\n"))
        .with_context(|| format!("writing {}", marker.display()))?;
    stage
        .commit()
        .with_context(|| format!("unpacking the default model into {}", dir.display()))?;
    Ok(dir)
}

enum Damage {
    Missing,
    Damaged(String),
}

/// What is wrong with the unpacked folder `dir`, or `None` when it holds every file as
/// embedded.
fn damage(dir: &Path, files: &[EmbeddedFile<'_>]) -> Option<Damage> {
    if !dir.exists() {
        return Some(Damage::Missing);
    }
    if !dir.join(COMPLETE_MARKER).exists() {
        return Some(Damage::Damaged(format!(
            "no `{COMPLETE_MARKER}` marker: an unpacking that did not finish"
        )));
    }
    files.iter().find_map(|(file, bytes)| {
        let path = dir.join(file);
        let expected = checksum(bytes);
        // One byte over the embedded size is enough to tell a longer file.
        match kernels::files::read_bounded(&path, bytes.len() as u64 + 1) {
            Ok(found) if found.len() == bytes.len() && checksum(&found) == expected => None,
            Ok(found) => Some(Damage::Damaged(format!(
                "{file} has checksum {:016x}, expected {expected:016x}",
                checksum(&found)
            ))),
            Err(e) => Some(Damage::Damaged(e.to_string())),
        }
    })
}

/// FNV-1a 64 over every file's name and bytes: the folder's name, so that a changed model
/// unpacks into a new folder.
fn checksum_of_all(files: &[EmbeddedFile<'_>]) -> u64 {
    files.iter().fold(FNV_OFFSET, |hash, (name, bytes)| {
        fnv1a(fnv1a(hash, name.as_bytes()), bytes)
    })
}

fn checksum(bytes: &[u8]) -> u64 {
    fnv1a(FNV_OFFSET, bytes)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::writer::tests::staged_names as hidden_entries;

    const FILES: [EmbeddedFile<'static>; 2] = [("a.json", b"{}"), ("w.bin", b"weights")];

    #[test]
    fn the_folder_name_is_the_checksum_the_cli_always_used() {
        let dir = tempfile::tempdir().unwrap();
        let unpacked = unpack(dir.path(), "m", &FILES).unwrap();
        // The hash `default_chat_checkpoint` named its folders with before, so that caches
        // already unpacked stay valid.
        let mut old: u64 = 0xcbf2_9ce4_8422_2325;
        for (name, bytes) in FILES {
            for &b in name.as_bytes().iter().chain(bytes) {
                old = (old ^ b as u64).wrapping_mul(0x0100_0000_01b3);
            }
        }
        assert_eq!(unpacked, dir.path().join(format!("m-{old:016x}")));
        assert_eq!(std::fs::read(unpacked.join("w.bin")).unwrap(), b"weights");
        assert!(hidden_entries(dir.path()).is_empty());
    }

    #[test]
    fn a_damaged_cache_is_unpacked_again() {
        let dir = tempfile::tempdir().unwrap();
        let unpacked = unpack(dir.path(), "m", &FILES).unwrap();
        std::fs::remove_file(unpacked.join(COMPLETE_MARKER)).unwrap();
        assert!(matches!(
            damage(&unpacked, &FILES),
            Some(Damage::Damaged(_))
        ));
        assert_eq!(unpack(dir.path(), "m", &FILES).unwrap(), unpacked);
        assert!(damage(&unpacked, &FILES).is_none());

        std::fs::write(unpacked.join("w.bin"), b"weightz").unwrap();
        let Some(Damage::Damaged(why)) = damage(&unpacked, &FILES) else {
            panic!("a changed byte is damage");
        };
        assert!(why.contains("w.bin has checksum"), "{why}");
        unpack(dir.path(), "m", &FILES).unwrap();
        assert_eq!(std::fs::read(unpacked.join("w.bin")).unwrap(), b"weights");

        std::fs::write(unpacked.join("w.bin"), b"weights and more").unwrap();
        assert!(damage(&unpacked, &FILES).is_some());
        std::fs::remove_file(unpacked.join("a.json")).unwrap();
        assert!(damage(&unpacked, &FILES).is_some());
        unpack(dir.path(), "m", &FILES).unwrap();
        assert!(damage(&unpacked, &FILES).is_none());
        assert!(hidden_entries(dir.path()).is_empty());
    }

    #[test]
    fn processes_unpacking_at_once_wait_for_each_other() {
        let dir = tempfile::tempdir().unwrap();
        let unpacked: Vec<PathBuf> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..4)
                .map(|_| s.spawn(|| unpack(dir.path(), "m", &FILES).unwrap()))
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        assert!(unpacked.windows(2).all(|w| w[0] == w[1]));
        assert!(damage(&unpacked[0], &FILES).is_none());
        assert!(hidden_entries(dir.path()).is_empty());
    }
}
