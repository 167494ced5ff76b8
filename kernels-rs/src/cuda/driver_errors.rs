//! Driver failures as the device seam's errors: a failed call names what was being done
//! ([`Context::during`]), and a panic inside cudarc (its library or a symbol missing) comes
//! back as an error instead of aborting the caller ([`no_panic`]). Shared by the runtime and
//! its cuBLASLt products.

use cudarc::driver::DriverError;

use crate::device::{DeviceError, Result};

/// Attaches a description of the operation to a driver error.
pub(super) trait Context<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, DriverError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|err| DeviceError::Driver {
            what: what(),
            detail: err.to_string(),
        })
    }
}

/// Runs `f`, turning a panic inside cudarc (missing library or symbol) into an error, so a
/// broken driver installation is reported instead of aborting the caller.
pub(super) fn no_panic<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let detail = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(DeviceError::DriverPanic {
                what: what.into(),
                detail,
            })
        }
    }
}
