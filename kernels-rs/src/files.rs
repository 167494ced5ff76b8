//! Opening and reading the files a program is given, so that an odd path cannot stall or
//! exhaust it: a FIFO would block `open` until a writer appears (forever, for a checkpoint
//! folder), and `/dev/zero` or a runaway file would be read until memory runs out. Every file
//! is opened without blocking and checked to be a regular file, and reads stop at a limit the
//! caller states; the errors name the file (and the limit).

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// The most read from a file of settings or metadata: `config.json`, a checkpoint's index,
/// a tokenizer's ranks, a chat template, a tactic cache, a manifest. The largest real one,
/// Kimi-K2.5's index, is about 10 MiB.
pub const TEXT_FILE_LIMIT: u64 = 64 << 20;

#[derive(Debug, Error)]
pub enum FileError {
    #[error("{}: cannot open: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a regular file but {kind}", path.display())]
    NotRegular { path: PathBuf, kind: &'static str },
    #[error(
        "{}: larger than {}, the most read from such a file",
        path.display(),
        human_bytes(*limit)
    )]
    TooLarge { path: PathBuf, limit: u64 },
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not UTF-8 text (byte {offset})", path.display())]
    NotUtf8 { path: PathBuf, offset: usize },
}

impl FileError {
    pub fn path(&self) -> &Path {
        match self {
            Self::Open { path, .. }
            | Self::NotRegular { path, .. }
            | Self::TooLarge { path, .. }
            | Self::Read { path, .. }
            | Self::NotUtf8 { path, .. } => path,
        }
    }

    /// Whether the file does not exist (which some readers take as "use the defaults").
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Open { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
}

/// Opens `path` (following symbolic links) for reading, refusing what is not a regular file
/// without blocking on it. For files that are memory-mapped rather than read.
pub fn open_regular(path: &Path) -> Result<(File, Metadata), FileError> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // Without it, opening a FIFO waits for a writer; on a regular file it changes nothing.
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|source| FileError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let metadata = file.metadata().map_err(|source| FileError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    refuse_irregular(path, &metadata)?;
    Ok((file, metadata))
}

/// Checks, without opening it, that `path` is a regular file of at most `limit` bytes; for
/// command-line values, refused where they enter.
pub fn check_regular(path: &Path, limit: u64) -> Result<(), FileError> {
    let metadata = std::fs::metadata(path).map_err(|source| FileError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    refuse_irregular(path, &metadata)?;
    if metadata.len() > limit {
        return Err(FileError::TooLarge {
            path: path.to_path_buf(),
            limit,
        });
    }
    Ok(())
}

/// The bytes of the regular file `path`, refused when there are more than `limit`. A file that
/// grows while read is cut off at the limit and refused too; one that says it is empty (as
/// `/proc` files do) is read to its end, within the limit.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, FileError> {
    let (file, metadata) = open_regular(path)?;
    let too_large = || FileError::TooLarge {
        path: path.to_path_buf(),
        limit,
    };
    if metadata.len() > limit {
        return Err(too_large());
    }
    let mut bytes = Vec::with_capacity(metadata.len() as usize);
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|source| FileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
    if bytes.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(bytes)
}

/// [`read_bounded`] for a text file, which must be UTF-8.
pub fn read_text_bounded(path: &Path, limit: u64) -> Result<String, FileError> {
    String::from_utf8(read_bounded(path, limit)?).map_err(|e| FileError::NotUtf8 {
        path: path.to_path_buf(),
        offset: e.utf8_error().valid_up_to(),
    })
}

fn refuse_irregular(path: &Path, metadata: &Metadata) -> Result<(), FileError> {
    let file_type = metadata.file_type();
    if file_type.is_file() {
        return Ok(());
    }
    let kind = if file_type.is_dir() {
        "a folder"
    } else {
        irregular_kind(&file_type)
    };
    Err(FileError::NotRegular {
        path: path.to_path_buf(),
        kind,
    })
}

#[cfg(unix)]
fn irregular_kind(file_type: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if file_type.is_fifo() {
        "a FIFO (named pipe)"
    } else if file_type.is_char_device() {
        "a character device"
    } else if file_type.is_block_device() {
        "a block device"
    } else if file_type.is_socket() {
        "a socket"
    } else {
        "something else"
    }
}

#[cfg(not(unix))]
fn irregular_kind(_: &std::fs::FileType) -> &'static str {
    "something else"
}

fn human_bytes(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "kernels-files-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn regular_files_are_read_within_their_limit() {
        let dir = temp_dir();
        let path = dir.join("small.json");
        std::fs::write(&path, b"{\"a\": 1}").unwrap();
        assert_eq!(read_text_bounded(&path, 8).unwrap(), "{\"a\": 1}");
        let err = read_bounded(&path, 7).unwrap_err().to_string();
        assert!(
            err.contains("small.json") && err.contains("7 bytes"),
            "{err}"
        );
        std::fs::write(&path, [b'a', 0xff]).unwrap();
        let err = read_text_bounded(&path, 8).unwrap_err().to_string();
        assert!(err.contains("not UTF-8 text (byte 1)"), "{err}");
        let missing = read_bounded(&dir.join("none"), 8).unwrap_err();
        assert!(missing.is_not_found());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn devices_folders_and_fifos_are_refused_without_blocking() {
        let err = read_bounded(Path::new("/dev/zero"), TEXT_FILE_LIMIT).unwrap_err();
        assert!(err.to_string().contains("a character device"), "{err}");
        let err = open_regular(&std::env::temp_dir()).unwrap_err();
        assert!(err.to_string().contains("a folder"), "{err}");
        let dir = temp_dir();
        let fifo = dir.join("fifo");
        let name = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let err = read_bounded(&fifo, TEXT_FILE_LIMIT).unwrap_err();
        assert!(err.to_string().contains("FIFO"), "{err}");
        assert!(check_regular(&fifo, 1).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn proc_files_that_claim_no_size_are_read_to_their_end() {
        let text = read_text_bounded(Path::new("/proc/self/status"), TEXT_FILE_LIMIT).unwrap();
        assert!(text.contains("Pid:"));
        assert_eq!(human_bytes(TEXT_FILE_LIMIT), "64 MiB");
    }
}
