//! The configuration a check runs: a model's preset (`--config`) with the flags' overrides, and
//! the `key = value` lines that show it on stderr before the run.
//!
//! [`super::run`] calls [`system`] or [`completion`] once the flags are known to fit the model;
//! an override the model cannot take (a fault for another connector, two scheduler-side
//! faults, `--pd-role` without `--connector pd`) is a [`CheckError`] here, and what the model
//! itself refuses is reported when it is built. The lines name each setting as its flag does
//! (`gpu_blocks = 4` for `--gpu-blocks 4`) and print its effective value, so that a run can be
//! repeated from them.

use kvrelay_core::{Mode, PolicyKind};
use kvrelay_model_check::{
    CompletionConfig, CoreFault, MultiFault, PdFault, SchedFault, SystemConfig, TierModel,
};

use super::args::{
    CheckArgs, ConnectorArg, FaultArg, ModeArg, ModelArg, PdRoleArg, PolicyArg, Preset, value_name,
};
use super::error::CheckError;

/// One `key = value` line: the setting's flag name in snake case, and its value as the flag
/// takes it.
pub(super) type Line = (&'static str, String);

/// The system model's configuration and the connector pair it runs with.
#[derive(Debug)]
pub(super) struct SystemSetup {
    /// `--config`.
    pub(super) preset: Preset,
    /// `--connector`.
    pub(super) connector: ConnectorArg,
    /// `--pd-role` (the P/D connector's; the multi connectors fix their children's roles).
    pub(super) pd_role: PdRoleArg,
    /// `--pd-silent-remote`.
    pub(super) pd_silent_remote: bool,
    /// `--pd-lease` (strict mode's lease, in steps).
    pub(super) pd_lease: u32,
    /// The model's configuration, faults of the step and of the core scheduler included.
    pub(super) config: SystemConfig,
    /// A scheduler-side fault of the offloading connector (`--connector offloading`, `multi`).
    pub(super) sched_fault: Option<SchedFault>,
    /// A fault of the P/D connector (`--connector pd`).
    pub(super) pd_fault: Option<PdFault>,
    /// A fault of the MultiConnector (`--connector multi-senders`).
    pub(super) multi_fault: Option<MultiFault>,
    /// `--partial-order` (default: on for `deep`, off for `ci`).
    pub(super) partial_order: bool,
}

/// `--model system`: the preset with the flags' overrides, the faults, the connector.
pub(super) fn system(a: &CheckArgs) -> Result<SystemSetup, CheckError> {
    let mut c = match a.config {
        Preset::Ci => SystemConfig::ci(),
        Preset::Deep => SystemConfig::deep(),
    };
    let set = |field: &mut u32, flag: Option<u32>| {
        if let Some(v) = flag {
            *field = v;
        }
    };
    set(&mut c.ranks, a.ranks);
    set(&mut c.requests, a.requests);
    set(&mut c.gpu_blocks, a.gpu_blocks);
    set(&mut c.block_size, a.block_size);
    set(&mut c.cpu_chunks, a.cpu_chunks);
    set(&mut c.blocks_per_chunk, a.blocks_per_chunk);
    set(&mut c.prompt_tokens, a.prompt_tokens);
    set(&mut c.shared_tokens, a.shared_tokens);
    set(&mut c.max_tokens, a.max_tokens);
    set(&mut c.max_batched_tokens, a.max_batched_tokens);
    set(&mut c.async_depth, a.async_depth);
    set(&mut c.aborts, a.aborts);
    set(&mut c.resets, a.resets);
    set(&mut c.idle_steps, a.idle_steps);
    if let Some(m) = a.mode {
        c.mode = mode(m);
    }
    if let Some(p) = a.policy {
        c.policy = match p {
            PolicyArg::Lru => PolicyKind::Lru,
            PolicyArg::Arc => PolicyKind::Arc,
        };
    }
    if a.sliding_window.is_some() {
        c.sliding_window = a.sliding_window;
    }
    if a.unordered_completions {
        c.ordered_completions = false;
    }
    if a.no_prefix_caching {
        c.prefix_caching = false;
    }
    set(&mut c.load_failures, a.load_failures);
    set(&mut c.store_failures, a.store_failures);
    let connector = a.connector.unwrap_or(ConnectorArg::Offloading);
    if matches!(connector, ConnectorArg::Pd | ConnectorArg::Multi) && a.load_failures.is_none() {
        c.load_failures = 1;
    }
    let invalid = |reason: String| CheckError::InvalidConfig {
        model: ModelArg::System,
        reason,
    };
    let mut sched_fault = None;
    let mut pd_fault = None;
    let mut multi_fault = None;
    for &f in &a.fault {
        match f {
            FaultArg::BindFirst => c.faults.bind_first = true,
            FaultArg::SkipHandlePreemptions => c.faults.skip_handle_preemptions = true,
            FaultArg::OneRankOutput => c.faults.one_rank_output = true,
            FaultArg::FreeAbortedWhileLoading => {
                c.faults.scheduler = Some(CoreFault::FreeAbortedWhileLoading);
            }
            FaultArg::ClaimHitsGroupByGroup => {
                c.faults.scheduler = Some(CoreFault::ClaimHitsGroupByGroup);
            }
            FaultArg::DropZeroExternalAlloc | FaultArg::LookupIgnoresJobs => match sched_fault {
                Some(other) if other != f => {
                    return Err(invalid(format!(
                        "at most one scheduler-side --fault can be injected, not both {} and {}",
                        value_name(other),
                        value_name(f)
                    )));
                }
                _ => sched_fault = Some(f),
            },
            FaultArg::SwallowLoadFailures => pd_fault = Some(PdFault::SwallowLoadFailures),
            FaultArg::StripExtraSaves => multi_fault = Some(MultiFault::StripExtraSaves),
        }
    }
    if let Some(&f) = a
        .fault
        .iter()
        .find(|f| !f.connectors().contains(&connector))
    {
        let names: Vec<String> = f.connectors().iter().map(|c| value_name(*c)).collect();
        return Err(invalid(format!(
            "--fault {} applies to --connector {}, not {}",
            value_name(f),
            names.join(", "),
            value_name(connector)
        )));
    }
    connector_flags(a, &c, connector).map_err(invalid)?;
    c.tier = tier(a, &c, connector).map_err(invalid)?;
    Ok(SystemSetup {
        preset: a.config,
        connector,
        pd_role: a.pd_role.unwrap_or(PdRoleArg::Both),
        pd_silent_remote: a.pd_silent_remote,
        pd_lease: a.pd_lease.unwrap_or(2),
        partial_order: a
            .partial_order
            .unwrap_or(a.config == Preset::Deep && c.tier.is_none()),
        config: c,
        sched_fault: sched_fault.map(|f| {
            if f == FaultArg::DropZeroExternalAlloc {
                SchedFault::DropZeroExternalAlloc
            } else {
                SchedFault::LookupIgnoresJobs
            }
        }),
        pd_fault,
        multi_fault,
    })
}

impl SystemSetup {
    /// What is checked, in a few words: `system model of the offloading connector`.
    pub(super) fn title(&self) -> String {
        format!(
            "system model of the {} connector",
            value_name(self.connector)
        )
    }

    /// One line per setting, in the order of `kvrelay check --help`.
    pub(super) fn lines(&self) -> Vec<Line> {
        let c = &self.config;
        let mut lines = vec![
            ("model", value_name(ModelArg::System)),
            ("config", value_name(self.preset)),
            ("ranks", c.ranks.to_string()),
            ("requests", c.requests.to_string()),
            ("mode", mode_name(c.mode)),
            ("connector", value_name(self.connector)),
        ];
        if self.connector == ConnectorArg::Pd {
            lines.push(("pd_role", value_name(self.pd_role)));
            lines.push(("pd_silent_remote", self.pd_silent_remote.to_string()));
            lines.push(("pd_lease", self.pd_lease.to_string()));
        }
        lines.extend([
            ("gpu_blocks", c.gpu_blocks.to_string()),
            ("block_size", c.block_size.to_string()),
            ("no_prefix_caching", (!c.prefix_caching).to_string()),
            ("cpu_chunks", c.cpu_chunks.to_string()),
            ("blocks_per_chunk", c.blocks_per_chunk.to_string()),
            ("prompt_tokens", c.prompt_tokens.to_string()),
            ("shared_tokens", c.shared_tokens.to_string()),
            ("max_tokens", c.max_tokens.to_string()),
            ("max_batched_tokens", c.max_batched_tokens.to_string()),
            ("async_depth", c.async_depth.to_string()),
            ("aborts", c.aborts.to_string()),
            ("resets", c.resets.to_string()),
            ("load_failures", c.load_failures.to_string()),
            ("store_failures", c.store_failures.to_string()),
            ("idle_steps", c.idle_steps.to_string()),
            ("policy", policy_name(c.policy)),
            ("sliding_window", optional(c.sliding_window)),
            (
                "unordered_completions",
                (!c.ordered_completions).to_string(),
            ),
            (
                "tier",
                self.config
                    .tier
                    .map_or("none".to_owned(), |t| format!("{t:?}")),
            ),
            ("faults", list(&self.faults())),
            ("partial_order", self.partial_order.to_string()),
        ]);
        lines
    }

    /// The faults injected, as `--fault` names them, in the order of its help.
    fn faults(&self) -> Vec<FaultArg> {
        let f = &self.config.faults;
        let mut out = Vec::new();
        for (on, fault) in [
            (f.bind_first, FaultArg::BindFirst),
            (f.skip_handle_preemptions, FaultArg::SkipHandlePreemptions),
            (f.one_rank_output, FaultArg::OneRankOutput),
        ] {
            if on {
                out.push(fault);
            }
        }
        out.extend(self.sched_fault.map(|s| match s {
            SchedFault::DropZeroExternalAlloc => FaultArg::DropZeroExternalAlloc,
            SchedFault::LookupIgnoresJobs => FaultArg::LookupIgnoresJobs,
        }));
        out.extend(self.pd_fault.map(|p| match p {
            PdFault::SwallowLoadFailures => FaultArg::SwallowLoadFailures,
        }));
        out.extend(self.multi_fault.map(|m| match m {
            MultiFault::StripExtraSaves => FaultArg::StripExtraSaves,
        }));
        out.extend(f.scheduler.map(|s| match s {
            CoreFault::FreeAbortedWhileLoading => FaultArg::FreeAbortedWhileLoading,
            CoreFault::ClaimHitsGroupByGroup => FaultArg::ClaimHitsGroupByGroup,
        }));
        out
    }
}

/// `--model completion`: the preset with the flags' overrides, validated.
pub(super) fn completion(a: &CheckArgs) -> Result<CompletionConfig, CheckError> {
    let mut c = match a.config {
        Preset::Ci => CompletionConfig::ci(),
        Preset::Deep => CompletionConfig::deep(),
    };
    if let Some(w) = a.ranks {
        c.ranks = w;
    }
    if let Some(r) = a.requests {
        c.requests = r;
    }
    if let Some(m) = a.mode {
        c.mode = mode(m);
    }
    if let Some(f) = a.failures {
        c.failures = f;
    }
    c.faulty_double_report |= a.faulty_double_report;
    c.faulty_bind_first |= a.faulty_bind_first;
    c.validate().map_err(|reason| CheckError::InvalidConfig {
        model: ModelArg::Completion,
        reason,
    })?;
    Ok(c)
}

/// The completion model's settings, one line each, in the order of `kvrelay check --help`.
pub(super) fn completion_lines(preset: Preset, c: &CompletionConfig) -> Vec<Line> {
    vec![
        ("model", value_name(ModelArg::Completion)),
        ("config", value_name(preset)),
        ("ranks", c.ranks.to_string()),
        ("requests", c.requests.to_string()),
        ("mode", mode_name(c.mode)),
        ("failures", c.failures.to_string()),
        ("faulty_double_report", c.faulty_double_report.to_string()),
        ("faulty_bind_first", c.faulty_bind_first.to_string()),
    ]
}

/// The core's mode for `--mode`.
fn mode(m: ModeArg) -> Mode {
    match m {
        ModeArg::Compat => Mode::Compat,
        ModeArg::Strict => Mode::Strict,
    }
}

/// A mode as `--mode` takes it.
fn mode_name(m: Mode) -> String {
    value_name(match m {
        Mode::Compat => ModeArg::Compat,
        Mode::Strict => ModeArg::Strict,
    })
}

/// A replacement policy as `--policy` takes it.
fn policy_name(p: PolicyKind) -> String {
    value_name(match p {
        PolicyKind::Lru => PolicyArg::Lru,
        PolicyKind::Arc => PolicyArg::Arc,
    })
}

/// An optional number: the number, or `none`.
pub(super) fn optional<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "none".to_owned(), |v| v.to_string())
}

/// Names joined by `, `, or `none`.
fn list(items: &[FaultArg]) -> String {
    if items.is_empty() {
        return "none".to_owned();
    }
    items
        .iter()
        .map(|&f| value_name(f))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The flags that apply to one connector only.
fn connector_flags(a: &CheckArgs, c: &SystemConfig, connector: ConnectorArg) -> Result<(), String> {
    if c.store_failures > 0 && connector != ConnectorArg::Offloading {
        return Err(format!(
            "--store-failures applies to --connector offloading (the {} connector's stores \
             cannot fail in the model)",
            value_name(connector)
        ));
    }
    if (a.pd_role.is_some() || a.pd_silent_remote || a.pd_lease.is_some())
        && connector != ConnectorArg::Pd
    {
        return Err(
            "--pd-role, --pd-silent-remote and --pd-lease apply to --connector pd (the multi \
             connectors fix their children's)"
                .to_owned(),
        );
    }
    if a.pd_lease == Some(0) {
        return Err("--pd-lease must be at least 1 step".to_owned());
    }
    Ok(())
}

/// `--tier` and its budgets: the shared tier's model, `None` without `--tier`.
fn tier(
    a: &CheckArgs,
    c: &SystemConfig,
    connector: ConnectorArg,
) -> Result<Option<TierModel>, String> {
    let budgets = [a.tier_vanish, a.tier_failures, a.tier_lost];
    if !a.tier {
        return match budgets.iter().any(Option::is_some) {
            true => Err("--tier-vanish, --tier-failures and --tier-lost need --tier".to_owned()),
            false => Ok(None),
        };
    }
    if connector != ConnectorArg::Offloading {
        return Err(format!(
            "--tier applies to --connector offloading (the shared tier sits behind its CPU \
             tier), not {}",
            value_name(connector)
        ));
    }
    let mut t = TierModel::adversarial(c.mode);
    t.vanish = a.tier_vanish.unwrap_or(t.vanish);
    t.failures = a.tier_failures.unwrap_or(t.failures);
    t.lost = a.tier_lost.unwrap_or(t.lost);
    Ok(Some(t))
}
