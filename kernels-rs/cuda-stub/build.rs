//! The library answers to the driver's soname, so that a process that loaded it as
//! `libcuda.so.1` and asks for that name again gets it back.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
