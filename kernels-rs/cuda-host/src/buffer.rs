//! "Device memory" of the host execution layer: host memory laid out so that a kernel reading
//! or writing past either end faults (and the runtime turns the fault into a launch error).

use std::ptr::NonNull;

use crate::{HostError, Result};

/// An allocation whose bytes end at an inaccessible guard page and start one page after
/// another. The start is 16-byte aligned (kernels load 16-byte vectors from element 0, as CUDA's
/// 256-byte aligned allocations allow), so lengths are padded to 16 bytes; the padding reads
/// as 0xFF. Addresses handed to
/// kernels are [`ptr`](DeviceBuffer::ptr) values, like CUDA device pointers.
pub struct DeviceBuffer {
    map: NonNull<u8>,
    map_len: usize,
    data: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its mapping; access goes through &/&mut or through kernels the
// caller synchronizes with (a launch returns only when the kernel is done).
unsafe impl Send for DeviceBuffer {}
// SAFETY: as above.
unsafe impl Sync for DeviceBuffer {}

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

impl DeviceBuffer {
    /// `len` zero bytes (a zero-length buffer still has a valid, inaccessible address).
    pub fn zeroed(len: usize) -> Result<Self> {
        let p = page();
        let padded = len.div_ceil(16) * 16;
        let body = padded.div_ceil(p) * p;
        let map_len = body + 2 * p;
        // SAFETY: anonymous private mapping, checked below.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(HostError::Memory(format!(
                "cannot map {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        let map = map.cast::<u8>();
        // SAFETY: [p, p + body) lies inside the mapping.
        let rc =
            unsafe { libc::mprotect(map.add(p).cast(), body, libc::PROT_READ | libc::PROT_WRITE) };
        if rc != 0 {
            // SAFETY: unmapping what was just mapped.
            unsafe { libc::munmap(map.cast(), map_len) };
            return Err(HostError::Memory(format!(
                "cannot protect {len} bytes: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: the data region ends at p + body, right before the trailing guard page.
        let data = unsafe { map.add(p + body - padded) };
        // The up-to-15 bytes between the end and the guard page read as NaN (0xFF), so an
        // over-read inside the last 16-byte granule still poisons what it touches.
        // SAFETY: [data + len, data + padded) is inside the writable region.
        unsafe { std::ptr::write_bytes(data.add(len), 0xFF, padded - len) };
        Ok(Self {
            map: NonNull::new(map).expect("mmap result is not null"),
            map_len,
            data: NonNull::new(data).expect("inside the mapping"),
            len,
        })
    }

    /// A buffer holding `values`.
    pub fn from_slice<T: bytemuck::Pod>(values: &[T]) -> Result<Self> {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        let mut b = Self::zeroed(bytes.len())?;
        b.bytes_mut().copy_from_slice(bytes);
        Ok(b)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address kernels see.
    pub fn ptr(&self) -> u64 {
        self.data.as_ptr() as u64
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `len` initialized bytes at `data`, owned by self.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr(), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_ptr(), self.len) }
    }

    pub fn fill(&mut self, byte: u8) {
        self.bytes_mut().fill(byte);
    }

    pub fn write<T: bytemuck::Pod>(&mut self, values: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(values);
        if bytes.len() != self.len {
            return Err(HostError::Memory(format!(
                "writing {} bytes into a buffer of {}",
                bytes.len(),
                self.len
            )));
        }
        self.bytes_mut().copy_from_slice(bytes);
        Ok(())
    }

    /// The contents as `T`s (copied: the data region is only 16-byte aligned at its start when
    /// its length is a multiple of 16).
    pub fn to_vec<T: bytemuck::Pod>(&self) -> Vec<T> {
        let n = self.len / std::mem::size_of::<T>();
        let mut out = vec![T::zeroed(); n];
        bytemuck::cast_slice_mut::<T, u8>(&mut out)
            .copy_from_slice(&self.bytes()[..n * std::mem::size_of::<T>()]);
        out
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: unmapping our own mapping.
        unsafe { libc::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer({} bytes at {:#x})", self.len, self.ptr())
    }
}
