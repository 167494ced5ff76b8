//! The CPU backend.

pub mod backend;
pub mod choice;
pub mod heap;
pub mod profile;
