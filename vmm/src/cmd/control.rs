//! `kpin attach`, `kpin detach`, `kpin status`: one request to a running guest's control
//! socket (`RUN/control.sock`); the exit status is the client's.

use std::collections::BTreeMap;
use std::path::Path;

use vmm::control::{self, protocol::Request};
use vmm::input_check::UsageError;

/// `kpin attach RUN --tool T [--tool-option K=V]...`.
pub(crate) fn attach(run: &Path, tool: String, tool_option: &[String]) -> anyhow::Result<u8> {
    let options = parse_tool_options(tool_option)?;
    Ok(control::client::command(
        run,
        &Request::Attach { tool, options },
    ))
}

/// `kpin detach RUN`.
pub(crate) fn detach(run: &Path) -> u8 {
    control::client::command(run, &Request::Detach)
}

/// `kpin status RUN`.
pub(crate) fn status(run: &Path) -> u8 {
    control::client::command(run, &Request::Status)
}

/// `--tool-option` KEY=VALUE pairs of `kpin attach`, as the request's map.
fn parse_tool_options(raw: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    raw.iter()
        .map(|o| match o.split_once('=') {
            Some((k, v)) if !k.is_empty() && !o.contains(' ') => Ok((k.to_owned(), v.to_owned())),
            _ => Err(UsageError(format!(
                "bad --tool-option {o:?}: expected KEY=VALUE without spaces"
            ))
            .into()),
        })
        .collect()
}
