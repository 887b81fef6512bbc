//! Why `kvrelay check` cannot run as asked: a flag for another model, an invalid model
//! configuration, a bad search or output flag. Each is reported on stderr with exit status 2,
//! before any checking.

use std::path::PathBuf;

use kvrelay_model_check::ExploreError;

use super::args::ModelArg;

/// A `kvrelay check` flag or configuration that cannot run.
#[derive(Debug)]
pub(super) enum CheckError {
    /// A flag that does not apply to the chosen model.
    NotForModel {
        flag: &'static str,
        model: ModelArg,
        applies_to: &'static [ModelArg],
        why: Option<&'static str>,
    },
    /// The model's configuration is invalid.
    InvalidConfig { model: ModelArg, reason: String },
    /// `--threads 0`.
    ZeroThreads,
    /// `--max-depth 0`.
    ZeroDepth,
    /// `--diagram-of NAME` matches no property of the model.
    UnknownProperty {
        name: String,
        available: Vec<&'static str>,
    },
    /// `--diagram-of NAME` matches several properties.
    AmbiguousProperty {
        name: String,
        matches: Vec<&'static str>,
    },
    /// `--diagram FILE` cannot be written (its folder does not exist), found before the run.
    TraceOutFolder { path: PathBuf },
    /// `--explore ADDR` refused or failed.
    Explore(ExploreError),
}

impl std::fmt::Display for CheckError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CheckError::NotForModel {
                flag,
                model,
                applies_to,
                why,
            } => {
                write!(f, "{flag} does not apply to --model {}", model.name())?;
                if applies_to.is_empty() {
                    write!(f, " (no model supports it yet)")?;
                } else {
                    let names: Vec<String> = applies_to.iter().map(|m| m.name()).collect();
                    write!(f, " (only to --model {})", names.join(", "))?;
                }
                if let Some(why) = why {
                    write!(f, ": {why}")?;
                }
                Ok(())
            }
            CheckError::InvalidConfig { model, reason } => {
                write!(
                    f,
                    "invalid configuration of the {} model: {reason}",
                    model.name()
                )
            }
            CheckError::ZeroThreads => write!(f, "--threads must be at least 1"),
            CheckError::ZeroDepth => write!(f, "--max-depth must be at least 1"),
            CheckError::UnknownProperty { name, available } => write!(
                f,
                "--diagram-of {name:?} matches no property of this model; its properties are: {}",
                quoted(available)
            ),
            CheckError::AmbiguousProperty { name, matches } => write!(
                f,
                "--diagram-of {name:?} matches several properties: {}; give more of the name",
                quoted(matches)
            ),
            CheckError::TraceOutFolder { path } => write!(
                f,
                "--diagram {}: the folder it would be written to does not exist",
                path.display()
            ),
            CheckError::Explore(e) => write!(f, "--explore: {e}"),
        }
    }
}

impl std::error::Error for CheckError {}

fn quoted(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}
