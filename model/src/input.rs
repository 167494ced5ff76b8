//! Checks on what enters the engine from outside, made once where it enters: token lists,
//! sizes against the host's memory, paths. Their errors are [`InvalidInput`], which the `model`
//! command reports with exit code 2 (bad input) rather than 1 (a failure while working).

use std::str::FromStr;

use thiserror::Error;

/// Input the engine refuses before doing any work: a value out of range, a size that does not
/// fit, an output that would destroy an input.
#[derive(Debug, Error)]
#[error("{0}")]
pub struct InvalidInput(pub String);

/// Comma-separated token ids, as `--tokens` and `--prompt` take them: `1,2,3`, spaces around
/// items allowed, no empty items.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenIds(pub Vec<u32>);

/// Parses a comma-separated list of token ids, naming the first item that is not one.
pub fn parse_token_list(text: &str) -> Result<Vec<u32>, String> {
    if text.trim().is_empty() {
        return Err("no token ids (expected comma-separated numbers such as 1,2,3)".into());
    }
    text.split(',')
        .enumerate()
        .map(|(i, item)| {
            let item = item.trim();
            if item.is_empty() {
                return Err(format!("item {} is empty (expected 1,2,3)", i + 1));
            }
            item.parse::<u32>().map_err(|_| {
                let shown: String = item.chars().take(24).collect();
                format!(
                    "item {} `{shown}` is not a token id (a whole number from 0 to {})",
                    i + 1,
                    u32::MAX
                )
            })
        })
        .collect()
}

impl FromStr for TokenIds {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        parse_token_list(text).map(TokenIds)
    }
}

/// Bytes of memory the kernel says a new allocation can get without swapping (`MemAvailable`
/// of `/proc/meminfo`); `None` where that is unknown.
pub fn available_memory_bytes() -> Option<u64> {
    let meminfo = std::path::Path::new("/proc/meminfo");
    mem_available_in(
        &kernels::files::read_text_bounded(meminfo, kernels::files::TEXT_FILE_LIMIT).ok()?,
    )
}

/// `MemAvailable` of `/proc/meminfo`'s text, in bytes.
pub fn mem_available_in(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

pub const GIB: f64 = (1u64 << 30) as f64;

/// Refuses `needed` bytes for `what` when they exceed the memory available now. `fits` turns
/// the available bytes into advice on what would fit ("--batch 3 fits").
pub fn check_memory(
    what: &str,
    needed: u64,
    fits: impl FnOnce(u64) -> String,
) -> Result<(), InvalidInput> {
    match available_memory_bytes() {
        Some(available) if needed > available => Err(InvalidInput(format!(
            "{what} needs {:.2} GiB, but {:.2} GiB of memory is available: {}",
            needed as f64 / GIB,
            available as f64 / GIB,
            fits(available)
        ))),
        _ => Ok(()),
    }
}

/// The largest `n` in `1..=upper` for which `fits(n)` holds, where `fits` holds up to some
/// point and fails beyond it; `None` when not even 1 fits.
pub fn largest_fitting(upper: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if upper == 0 || !fits(1) {
        return None;
    }
    let (mut good, mut bad) = (1usize, upper.saturating_add(1));
    if fits(upper) {
        return Some(upper);
    }
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Some(good)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_parse_and_name_the_bad_item() {
        assert_eq!(parse_token_list("1,2, 3 ").unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_token_list("4294967295").unwrap(), vec![u32::MAX]);
        let err = parse_token_list("1,x,3").unwrap_err();
        assert!(err.contains("item 2 `x`"), "{err}");
        assert!(
            parse_token_list("1,,3")
                .unwrap_err()
                .contains("item 2 is empty")
        );
        assert!(parse_token_list("").is_err());
        assert!(parse_token_list("-1").is_err());
        assert!(parse_token_list("4294967296").is_err());
    }

    #[test]
    fn largest_fitting_finds_the_boundary() {
        assert_eq!(largest_fitting(1000, |n| n * n <= 500), Some(22));
        assert_eq!(largest_fitting(10, |_| true), Some(10));
        assert_eq!(largest_fitting(10, |_| false), None);
        assert_eq!(largest_fitting(usize::MAX, |n| n <= 7), Some(7));
    }

    #[test]
    fn memory_check_refuses_what_cannot_fit() {
        if let Some(available) = available_memory_bytes() {
            assert!(available > 0);
            let err = check_memory("the test", u64::MAX, |_| "nothing fits".into())
                .unwrap_err()
                .to_string();
            assert!(err.contains("the test needs") && err.contains("nothing fits"));
            check_memory("one byte", 1, |_| unreachable!()).unwrap();
        }
    }
}
