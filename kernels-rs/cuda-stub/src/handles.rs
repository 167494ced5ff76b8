//! Handles given to the caller (`CUstream`, `CUevent`, `CUmodule`, ...) are the addresses of
//! the stand-in's objects; a registry per type keeps the live ones, so a stale or foreign
//! handle is refused with the driver's code instead of being dereferenced.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

pub struct Registry<T> {
    live: Mutex<HashMap<usize, Arc<T>>>,
}

impl<T> Default for Registry<T> {
    fn default() -> Self {
        Self {
            live: Mutex::new(HashMap::new()),
        }
    }
}

impl<T> Registry<T> {
    /// Registers `value`; its handle is its address.
    pub fn insert<H>(&self, value: Arc<T>) -> *mut H {
        let key = Arc::as_ptr(&value) as usize;
        self.live.lock().unwrap().insert(key, value);
        key as *mut H
    }

    pub fn get<H>(&self, handle: *mut H) -> Option<Arc<T>> {
        self.live
            .lock()
            .unwrap()
            .get(&(handle as *mut c_void as usize))
            .cloned()
    }

    pub fn remove<H>(&self, handle: *mut H) -> Option<Arc<T>> {
        self.live
            .lock()
            .unwrap()
            .remove(&(handle as *mut c_void as usize))
    }

    /// Removes every entry `gone` selects (a context's objects when it is destroyed).
    pub fn remove_where(&self, gone: impl Fn(&T) -> bool) -> Vec<Arc<T>> {
        let mut live = self.live.lock().unwrap();
        let keys: Vec<usize> = live
            .iter()
            .filter(|(_, v)| gone(v))
            .map(|(&k, _)| k)
            .collect();
        keys.iter().filter_map(|k| live.remove(k)).collect()
    }
}

/// The handle of an object that is not in a registry (primary contexts live for the process).
pub fn handle_of<T, H>(value: &Arc<T>) -> *mut H {
    Arc::as_ptr(value) as *mut H
}
