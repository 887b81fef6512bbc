//! [`Backend`]: where a rank's KV lives and how it moves, and the one place that probes for CUDA
//! ([`Backend::resolve`]), before any rank is built.

use serde::{Deserialize, Serialize};

use super::cuda;

/// Where a rank's KV lives and how it moves.
#[derive(Clone, Copy, Debug, Default, Eq, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// The "GPU" arena and the offload pool are host memory; copies are `memcpy`.
    #[default]
    Host,
    /// A CUDA device arena per rank (device 0) and a pinned host pool; fails when there is no
    /// CUDA driver or device.
    Cuda,
    /// `cuda` when a driver and a device are present, else `host` (said on stderr).
    Auto,
}

impl Backend {
    /// `host` or `cuda`, never `auto`: probes the CUDA driver when asked to. `Err` is the reason
    /// `cuda` cannot be used.
    pub fn resolve(self) -> Result<Self, String> {
        match self {
            Self::Host => Ok(Self::Host),
            Self::Cuda => cuda::probe().map(|_| Self::Cuda),
            Self::Auto => match cuda::probe() {
                Ok(_) => Ok(Self::Cuda),
                Err(why) => {
                    eprintln!("backend auto: using host memory ({why})");
                    Ok(Self::Host)
                }
            },
        }
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Host => "host",
            Self::Cuda => "cuda",
            Self::Auto => "auto",
        }
    }
}
