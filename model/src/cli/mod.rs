//! The `model` command's subcommands.

pub mod compare;
pub mod serving;
