//! The API key (`--api-key`, `VLLM_API_KEY`) and how a request's header is checked against it.

use axum::http::HeaderValue;

/// The key clients of `/v1/*` must send (`Authorization: Bearer KEY`). Its `Debug` does not
/// show it: the key appears in no log and no error.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<hidden>)")
    }
}

impl std::str::FromStr for ApiKey {
    type Err = String;

    fn from_str(key: &str) -> Result<Self, String> {
        if key.is_empty() {
            // vLLM reads an empty key as none; refused here, so that `--api-key "$KEY"` with
            // `KEY` unset does not open the server to everyone.
            return Err("the API key is empty (unset VLLM_API_KEY and leave out --api-key to serve without one)".into());
        }
        if key.chars().any(|c| c.is_control() || c.is_whitespace()) {
            // A client's `Authorization` header could not carry it as given.
            return Err("the API key contains whitespace or a control character".into());
        }
        Ok(Self(key.to_string()))
    }
}

/// Parses `--api-key` / `VLLM_API_KEY` without echoing a refused value, as clap's errors
/// otherwise do.
#[derive(Clone, Copy, Debug)]
pub struct ApiKeyParser;

impl clap::builder::TypedValueParser for ApiKeyParser {
    type Value = ApiKey;

    fn parse_ref(
        &self,
        _command: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<ApiKey, clap::Error> {
        let flag = arg.map_or("--api-key".to_string(), |a| a.to_string());
        let refuse = |why: &str| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for '{flag}': {why}\n"),
            )
        };
        value
            .to_str()
            .ok_or_else(|| refuse("the API key is not UTF-8"))?
            .parse()
            .map_err(|why: String| refuse(&why))
    }
}

impl clap::builder::ValueParserFactory for ApiKey {
    type Parser = ApiKeyParser;

    fn value_parser() -> ApiKeyParser {
        ApiKeyParser
    }
}

impl ApiKey {
    /// Whether `given` is the key, in time that depends on the key's length only: how long a
    /// refusal takes tells a client nothing of how much of its guess was right.
    pub(super) fn matches(&self, given: &[u8]) -> bool {
        let key = self.0.as_bytes();
        let mut differ = u8::from(given.len() != key.len());
        for (i, k) in key.iter().enumerate() {
            differ |= k ^ given.get(i).copied().unwrap_or(0);
        }
        std::hint::black_box(differ) == 0
    }

    /// Whether a request's `Authorization` header carries the key (`Bearer`, in any case).
    pub(super) fn authorizes(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(value) = authorization.map(HeaderValue::as_bytes) else {
            return false;
        };
        let scheme = b"bearer ";
        value.len() >= scheme.len()
            && value[..scheme.len()].eq_ignore_ascii_case(scheme)
            && self.matches(&value[scheme.len()..])
    }
}
