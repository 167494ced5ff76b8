//! Scratch buffers the CPU kernels keep per thread between calls: taken out of a
//! thread-local for a call (a nested call finds it empty and just allocates), grown when a
//! call needs more, put back after.

/// The first `n` elements of `v`, growing it if needed (new elements are `T::default()`; the
/// others keep what the last call left, for callers that overwrite what they read).
pub(crate) fn sized<T: Clone + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    if v.len() < n {
        v.resize(n, T::default());
    }
    &mut v[..n]
}
