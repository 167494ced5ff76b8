//! POSIX shared-memory segments (`shm_open` + `mmap`), the CPU stand-in for CUDA IPC buffers.
//!
//! The creator unlinks the name as soon as every rank has mapped the segment, so a rank killed
//! afterwards cannot leak `/dev/shm` entries: the memory lives only as long as some mapping
//! does. [`SharedSegment`]'s `Drop` unlinks too, for the paths that never got that far.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;

/// Prefix of every segment name this module creates, so tests can look for leaks.
pub const SEGMENT_PREFIX: &str = "kernels-allreduce-";

/// A name no other live segment has: prefix, a caller tag, pid, time and a counter.
pub fn unique_segment_name(tag: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{SEGMENT_PREFIX}{tag}-{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )
}

/// Removes `name` from `/dev/shm` if it is there: for a launcher cleaning up after rank
/// processes it had to kill, whatever state they died in.
pub fn remove_segment(name: &str) -> io::Result<()> {
    let cname = c_name(name)?;
    // SAFETY: valid C string.
    if unsafe { libc::shm_unlink(cname.as_ptr()) } != 0 {
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::NotFound {
            return Err(e);
        }
    }
    Ok(())
}

/// Why [`create_or_join`] failed.
#[derive(Debug)]
pub enum JoinError {
    /// A shared-memory call failed (`op` is "create" or "open").
    Io { op: &'static str, source: io::Error },
    /// The creator had not published the segment by the deadline.
    NotPublished,
}

/// The rendezvous every communicator starts with. Rank 0 creates `name` (`len` bytes), lets
/// `init` write the header, then publishes `magic` at offset `magic_at` with a release store,
/// so a joiner that sees the magic sees the header. Other ranks retry opening until they see
/// it or `deadline` passes.
pub fn create_or_join(
    name: &str,
    rank: usize,
    len: usize,
    magic_at: usize,
    magic: u64,
    deadline: std::time::Instant,
    init: impl FnOnce(&SharedSegment),
) -> Result<SharedSegment, JoinError> {
    if rank == 0 {
        let segment = SharedSegment::create(name, len).map_err(|source| JoinError::Io {
            op: "create",
            source,
        })?;
        init(&segment);
        segment.atomic(magic_at).store(magic, Ordering::Release);
        return Ok(segment);
    }
    loop {
        match SharedSegment::open(name) {
            Ok(s) if s.atomic(magic_at).load(Ordering::Acquire) == magic => return Ok(s),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::UnexpectedEof
                ) => {}
            Err(source) => return Err(JoinError::Io { op: "open", source }),
        }
        if std::time::Instant::now() > deadline {
            return Err(JoinError::NotPublished);
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// A mapped shared-memory segment.
pub struct SharedSegment {
    name: String,
    map: MmapRaw,
    /// Only the creator unlinks; joiners never remove a name they did not make.
    unlink_on_drop: bool,
}

fn c_name(name: &str) -> io::Result<CString> {
    if name.contains('/') || name.is_empty() || name.len() > 200 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad shared-memory name {name:?}"),
        ));
    }
    CString::new(format!("/{name}")).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

impl SharedSegment {
    /// Creates a new zero-filled segment of `len` bytes; fails if the name exists.
    pub fn create(name: &str, len: usize) -> io::Result<Self> {
        let cname = c_name(name)?;
        // SAFETY: cname is a valid NUL-terminated string; the flags and mode are plain ints.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just returned by shm_open and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        // From here on the name exists: unlink it on every error path.
        let mapped = file
            .set_len(len as u64)
            .and_then(|()| MmapRaw::map_raw(&file));
        match mapped {
            Ok(map) => Ok(SharedSegment {
                name: name.to_string(),
                map,
                unlink_on_drop: true,
            }),
            Err(e) => {
                // SAFETY: valid C string.
                unsafe { libc::shm_unlink(cname.as_ptr()) };
                Err(e)
            }
        }
    }

    /// Opens and maps an existing segment. Fails with `NotFound` until the creator has made it,
    /// and with `UnexpectedEof` while it is still zero-sized.
    pub fn open(name: &str) -> io::Result<Self> {
        let cname = c_name(name)?;
        // SAFETY: as in `create`.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is ours.
        let file = unsafe { File::from_raw_fd(fd) };
        if file.metadata()?.len() == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "segment not sized yet",
            ));
        }
        Ok(SharedSegment {
            name: name.to_string(),
            map: MmapRaw::map_raw(&file)?,
            unlink_on_drop: false,
        })
    }

    /// Removes the name from `/dev/shm`; mappings stay valid. Idempotent.
    pub fn unlink(&mut self) -> io::Result<()> {
        if !self.unlink_on_drop {
            return Ok(());
        }
        self.unlink_on_drop = false;
        let cname = c_name(&self.name)?;
        // SAFETY: valid C string.
        if unsafe { libc::shm_unlink(cname.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::NotFound {
                return Err(e);
            }
        }
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    /// Base of the mapping. Shared with other processes: all access goes through the protocol's
    /// atomics or through ranges the protocol hands to one writer at a time.
    pub fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// The atomic u64 at byte `offset` (must be 8-aligned and in bounds).
    pub fn atomic(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.len(),
            "atomic at {offset} outside segment of {}",
            self.len()
        );
        // SAFETY: in bounds and aligned (the mapping is page aligned); the mapping lives as long
        // as &self, and every access to flag words is atomic.
        unsafe { AtomicU64::from_ptr(self.base().add(offset).cast()) }
    }
}

impl Drop for SharedSegment {
    fn drop(&mut self) {
        let _ = self.unlink();
    }
}

/// Names of segments with this module's prefix currently in `/dev/shm` (for leak checks).
pub fn live_segments(containing: &str) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
                .filter(|n| n.starts_with(SEGMENT_PREFIX) && n.contains(containing))
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_share_and_unlink() {
        let name = unique_segment_name("shm-unit");
        let mut a = SharedSegment::create(&name, 8192).unwrap();
        assert!(SharedSegment::create(&name, 8192).is_err(), "O_EXCL");
        let b = SharedSegment::open(&name).unwrap();
        a.atomic(64).store(42, Ordering::Release);
        assert_eq!(b.atomic(64).load(Ordering::Acquire), 42);
        assert_eq!(live_segments(&name), vec![name.clone()]);
        a.unlink().unwrap();
        assert!(live_segments(&name).is_empty());
        // Mappings outlive the name.
        b.atomic(0).store(7, Ordering::Release);
        assert_eq!(a.atomic(0).load(Ordering::Acquire), 7);
        assert_eq!(
            SharedSegment::open(&name).err().map(|e| e.kind()),
            Some(io::ErrorKind::NotFound)
        );
    }

    #[test]
    fn drop_unlinks_the_creators_name() {
        let name = unique_segment_name("shm-drop");
        drop(SharedSegment::create(&name, 4096).unwrap());
        assert!(live_segments(&name).is_empty());
    }
}
