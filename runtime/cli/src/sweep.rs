//! `kvrelay sweep`: one workload run under a grid of configurations (CPU pool × eviction
//! policy × GPU pool), in parallel, reported as a table, as JSON and as a plot.
//!
//! Each configuration is a whole `kvrelay run` (its own engine, ranks and current-thread tokio
//! runtime, [`kvrelay_engine::run()`]) on a thread of its own; at most `--jobs` run at once. The
//! requests are read once and shared. Runs are deterministic, so a row is the same on every
//! sweep for a seed, whatever ran beside it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use clap::Args;
use kvrelay_core::PolicyKind;
use serde::Serialize;

use kvrelay_engine::report::bytes;
use kvrelay_engine::{Report, RunConfig};

use crate::plot::{self, PlotFormat, PlotPoint};
use crate::run::{EngineArgs, policy};

/// The long help's epilogue of `kvrelay sweep --help`.
pub(crate) const HELP: &str = "\
What-if sweeps: how much would a bigger CPU pool, or ARC instead of LRU, buy on this trace?
Runs the same requests once per configuration of the grid --cpu-blocks × --policy ×
--gpu-blocks (each a comma-separated list), each run a whole `kvrelay run` on its virtual
clock, and reports per configuration: prefix reuse (prompt tokens found in the GPU prefix
cache, and loaded from the CPU pool), tokens the forward passes computed, bytes stored to and
loaded from the CPU pool, preemptions, and time to first token (median, p99) and per output
token (median) on the virtual clock.

Use it to size the CPU offload pool and to choose the eviction policy for a workload before
running it for real; use `kvrelay run` to look at one configuration closely (its timeline,
its checks). Every other flag is `kvrelay run`'s and applies to every configuration.

Runs are deterministic: a row is the same on every sweep for a seed. Configurations run in
parallel, one thread each, as many at once as there are cores (--jobs); each run needs the
memory of its pools (GPU and CPU blocks × layers × block bytes × ranks).

Output: a table on stdout (--json: the rows as JSON instead), a line on stderr per finished
configuration, and with --plot OUT.svg or OUT.png a chart of prefix reuse (%) and tokens
computed against the CPU pool (blocks; a log axis when the pools span 8× or more), one line per
policy (and GPU pool).

Example:
  kvrelay sweep --trace conversation_trace.jsonl.gz --requests 300 \\
      --cpu-blocks 1024,4096,16384,65536 --policy lru,arc --plot sweep.svg

Exit status: 0 when every configuration finished every request, 1 when one stopped on an error
or left requests unfinished (the others are still reported), 2 on bad flags or files.";

/// `kvrelay sweep` flags: the grid, the outputs, and [`EngineArgs`] for everything else.
#[derive(Args, Debug, Clone)]
pub(crate) struct SweepArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// CPU offload blocks per rank to try, comma-separated (the plot's x axis).
    #[arg(
        long,
        required = true,
        value_name = "N,N,..",
        value_delimiter = ',',
        value_parser = cpu_blocks
    )]
    pub cpu_blocks: Vec<u32>,
    /// CPU eviction policies to try, comma-separated.
    #[arg(
        long,
        value_name = "lru,arc",
        value_delimiter = ',',
        default_value = "lru",
        value_parser = ["lru", "arc"]
    )]
    pub policy: Vec<String>,
    /// GPU blocks per rank to try, comma-separated [default: one pool, `kvrelay run`'s
    /// default].
    #[arg(long, value_name = "N,N,..", value_delimiter = ',', value_parser = gpu_blocks)]
    pub gpu_blocks: Vec<u32>,
    /// Draw prefix reuse and tokens computed against the CPU pool into this file (SVG or
    /// PNG, by its extension).
    #[arg(long, value_name = "OUT.svg|OUT.png")]
    pub plot: Option<PathBuf>,
    /// Print the rows as JSON on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Configurations run at once [default: the number of cores].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub jobs: Option<u32>,
}

/// A `--cpu-blocks` value: a positive block count.
fn cpu_blocks(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(0) => Err(
            "0 CPU blocks: the engine always offloads, its CPU pool needs at least one \
                      block (try a small pool, such as 16)"
                .into(),
        ),
        Ok(n) => Ok(n),
        Err(_) if s.trim().is_empty() => {
            Err("an empty value: give block counts separated by commas, e.g. 1024,4096".into())
        }
        Err(e) => Err(format!("not a block count: {e}")),
    }
}

/// A `--gpu-blocks` value: a block count of two or more (the null block and one more).
fn gpu_blocks(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(n) if n >= 2 => Ok(n),
        Ok(n) => Err(format!(
            "{n} GPU blocks: the pool needs the null block and at least one more"
        )),
        Err(_) if s.trim().is_empty() => {
            Err("an empty value: give block counts separated by commas, e.g. 320,640".into())
        }
        Err(e) => Err(format!("not a block count: {e}")),
    }
}

/// One configuration of the grid.
#[derive(Clone, Debug)]
struct Cell {
    policy: PolicyKind,
    /// `None`: the run's default pool.
    gpu_blocks: Option<u32>,
    cpu_blocks: u32,
}

impl Cell {
    fn policy_name(&self) -> &'static str {
        match self.policy {
            PolicyKind::Lru => "lru",
            PolicyKind::Arc => "arc",
        }
    }
}

/// What one configuration did: the figures a sweep compares.
#[derive(Clone, Debug, PartialEq, Serialize)]
struct Figures {
    requests: u64,
    finished: u64,
    refused: u64,
    prompt_tokens: u64,
    generated_tokens: u64,
    /// Prompt tokens not computed: GPU prefix hits plus tokens loaded from the CPU pool.
    reused_tokens: u64,
    /// `reused_tokens` as a percentage of `prompt_tokens`.
    reuse_pct: f64,
    gpu_prefix_hit_tokens: u64,
    cpu_loaded_tokens: u64,
    tokens_computed: u64,
    bytes_stored: u64,
    bytes_loaded: u64,
    preemptions: u64,
    ttft_ms_median: f64,
    ttft_ms_p99: f64,
    tpot_ms_median: f64,
    wall_s: f64,
}

impl Figures {
    fn of(r: &Report, wall_s: f64) -> Self {
        let reuse_pct = if r.prompt_tokens == 0 {
            0.0
        } else {
            100.0 * r.reused_tokens as f64 / r.prompt_tokens as f64
        };
        Self {
            requests: r.requests,
            finished: r.finished,
            refused: r.refused,
            prompt_tokens: r.prompt_tokens,
            generated_tokens: r.generated_tokens,
            reused_tokens: r.reused_tokens,
            reuse_pct,
            gpu_prefix_hit_tokens: r.gpu_prefix_hit_tokens,
            cpu_loaded_tokens: r.cpu_loaded_tokens,
            tokens_computed: r.tokens_computed,
            bytes_stored: r.bytes_stored,
            bytes_loaded: r.bytes_loaded,
            preemptions: r.preemptions,
            ttft_ms_median: r.ttft_ms_median,
            ttft_ms_p99: r.ttft_ms_p99,
            tpot_ms_median: r.tpot_ms_median,
            wall_s,
        }
    }

    fn unfinished(&self) -> u64 {
        self.requests - self.finished - self.refused
    }
}

/// One row of the output: a configuration and its figures, or the error that stopped it.
#[derive(Clone, Debug, Serialize)]
struct Row {
    policy: &'static str,
    /// As resolved by the run (its default when the sweep gave none); as asked on an error.
    gpu_blocks: Option<u32>,
    cpu_blocks: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(flatten)]
    figures: Option<Figures>,
}

/// The JSON of `kvrelay sweep --json`.
#[derive(Debug, Serialize)]
struct SweepJson<'a> {
    trace: Option<&'a Path>,
    requests: usize,
    jobs: usize,
    wall_s: f64,
    rows: &'a [Row],
}

/// `kvrelay sweep`: see [`HELP`].
pub(crate) fn run(args: &SweepArgs) -> ExitCode {
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("kvrelay sweep: {e}");
        ExitCode::from(2)
    };
    let mut base = match args.engine.config() {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let format = match args.plot.as_deref().map(plot_format).transpose() {
        Ok(f) => f,
        Err(e) => return fail(&e),
    };
    let cells = match grid(args, &base) {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let records = match kvrelay_engine::requests_of_run(&mut base) {
        Ok(r) => r,
        Err(e) => return fail(&e),
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let jobs = args
        .jobs
        .map_or(cores, |j| j as usize)
        .clamp(1, cells.len());
    let source = match &base.trace {
        Some(p) => p.display().to_string(),
        None => "the generated workload".to_owned(),
    };
    eprintln!(
        "kvrelay sweep: {} configurations of {} requests ({source}), {jobs} at a time",
        cells.len(),
        records.len()
    );
    let started = Instant::now();
    let rows = run_grid(&base, &records, &cells, jobs);
    let wall_s = started.elapsed().as_secs_f64();

    if args.json {
        let json = SweepJson {
            trace: base.trace.as_deref(),
            requests: records.len(),
            jobs,
            wall_s,
            rows: &rows,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&json).expect("the rows serialize")
        );
    } else {
        print!("{}", table(&rows));
        println!(
            "{} configurations in {wall_s:.1} s, {jobs} at a time",
            rows.len()
        );
    }
    let mut status = ExitCode::SUCCESS;
    if let (Some(path), Some(format)) = (&args.plot, format) {
        let name = match base.trace.as_deref().and_then(Path::file_name) {
            Some(n) => n.to_string_lossy().into_owned(),
            None => source.clone(),
        };
        let mut gpus: Vec<Option<u32>> = rows.iter().map(|r| r.gpu_blocks).collect();
        gpus.dedup();
        let title = match gpus.as_slice() {
            [Some(g)] => format!(
                "kvrelay sweep: {} requests of {name}, {g} GPU blocks per rank",
                records.len()
            ),
            _ => format!("kvrelay sweep: {} requests of {name}", records.len()),
        };
        match plot::write(path, format, &title, &points(&rows)) {
            Ok(()) => eprintln!("kvrelay sweep: plot written to {}", path.display()),
            Err(e) => {
                eprintln!("kvrelay sweep: plot {}: {e}", path.display());
                status = ExitCode::from(1);
            }
        }
    }
    for r in &rows {
        let what = match (&r.error, &r.figures) {
            (Some(e), _) => format!("stopped: {e}"),
            (None, Some(f)) if f.unfinished() > 0 => {
                format!("{} of {} requests unfinished", f.unfinished(), f.requests)
            }
            _ => continue,
        };
        eprintln!("kvrelay sweep: {}: {what}", label(r));
        status = ExitCode::from(1);
    }
    status
}

/// The plot's format, from the file's extension.
fn plot_format(path: &Path) -> Result<PlotFormat, String> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let format = match ext.to_ascii_lowercase().as_str() {
        "svg" => PlotFormat::Svg,
        "png" => PlotFormat::Png,
        _ => {
            return Err(format!(
                "--plot {}: the file must end in .svg or .png",
                path.display()
            ));
        }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && !dir.is_dir()
    {
        return Err(format!(
            "--plot {}: no folder {}",
            path.display(),
            dir.display()
        ));
    }
    Ok(format)
}

/// The configurations: every policy × GPU pool × CPU pool, in that order (CPU pools
/// ascending, duplicates once).
fn grid(args: &SweepArgs, base: &RunConfig) -> Result<Vec<Cell>, String> {
    let mut cpus = args.cpu_blocks.clone();
    cpus.sort_unstable();
    cpus.dedup();
    let mut gpus: Vec<Option<u32>> = Vec::new();
    for &g in &args.gpu_blocks {
        if !gpus.contains(&Some(g)) {
            gpus.push(Some(g));
        }
    }
    if gpus.is_empty() {
        gpus.push(None);
    }
    let mut policies: Vec<PolicyKind> = Vec::new();
    for p in &args.policy {
        let p = policy(p).ok_or_else(|| format!("--policy {p}: lru or arc"))?;
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    if cpus.is_empty() || policies.is_empty() {
        return Err("an empty grid: give --cpu-blocks (and --policy) at least one value".into());
    }
    let per = base.blocks_per_chunk.max(1);
    if let Some(c) = cpus.iter().find(|&&c| !c.is_multiple_of(per)) {
        return Err(format!(
            "--cpu-blocks {c}: not a multiple of blocks_per_chunk ({per})"
        ));
    }
    let mut cells = Vec::new();
    for &policy in &policies {
        for &gpu_blocks in &gpus {
            for &cpu_blocks in &cpus {
                cells.push(Cell {
                    policy,
                    gpu_blocks,
                    cpu_blocks,
                });
            }
        }
    }
    Ok(cells)
}

/// Runs every cell, `jobs` at a time, each on a thread of its own; rows in the cells' order.
/// Prints a line on stderr as each finishes.
fn run_grid(
    base: &RunConfig,
    records: &[kvrelay_engine::workload::TraceRecord],
    cells: &[Cell],
    jobs: usize,
) -> Vec<Row> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let rows: Mutex<Vec<Option<Row>>> = Mutex::new(vec![None; cells.len()]);
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(cell) = cells.get(i) else {
                        return;
                    };
                    let row = run_cell(base, records, cell);
                    let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                    eprintln!(
                        "kvrelay sweep: [{n}/{}] {}: {}",
                        cells.len(),
                        label(&row),
                        summary(&row)
                    );
                    rows.lock().expect("no thread panics holding the rows")[i] = Some(row);
                }
            });
        }
    });
    rows.into_inner()
        .expect("no thread panics holding the rows")
        .into_iter()
        .map(|r| r.expect("every cell ran"))
        .collect()
}

/// One configuration, run to its end.
fn run_cell(
    base: &RunConfig,
    records: &[kvrelay_engine::workload::TraceRecord],
    cell: &Cell,
) -> Row {
    let config = RunConfig {
        policy: cell.policy,
        gpu_blocks: cell.gpu_blocks.or(base.gpu_blocks),
        cpu_blocks: Some(cell.cpu_blocks),
        ..base.clone()
    };
    let started = Instant::now();
    let outcome = kvrelay_engine::run(&config, records, &mut ());
    let wall_s = started.elapsed().as_secs_f64();
    match outcome {
        Ok(report) => Row {
            policy: cell.policy_name(),
            gpu_blocks: Some(report.gpu_blocks),
            cpu_blocks: report.cpu_blocks,
            error: None,
            figures: Some(Figures::of(&report, wall_s)),
        },
        Err(e) => Row {
            policy: cell.policy_name(),
            gpu_blocks: config.gpu_blocks,
            cpu_blocks: cell.cpu_blocks,
            error: Some(e.to_string()),
            figures: None,
        },
    }
}

/// `lru, 320 GPU, 4096 CPU blocks`.
fn label(r: &Row) -> String {
    match r.gpu_blocks {
        Some(g) => format!("{}, {g} GPU, {} CPU blocks", r.policy, r.cpu_blocks),
        None => format!("{}, {} CPU blocks", r.policy, r.cpu_blocks),
    }
}

/// The progress line's figures of a finished row.
fn summary(r: &Row) -> String {
    match (&r.error, &r.figures) {
        (Some(e), _) => format!("stopped: {e}"),
        (None, Some(f)) => format!(
            "reuse {:.1} %, {} tokens computed, {} preemptions ({:.1} s)",
            f.reuse_pct, f.tokens_computed, f.preemptions, f.wall_s
        ),
        (None, None) => String::new(),
    }
}

/// The rows as a table for people, with a line saying what the columns count.
fn table(rows: &[Row]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let header = [
        "policy",
        "GPU blocks",
        "CPU blocks",
        "reuse",
        "GPU hits",
        "CPU loads",
        "computed",
        "stored",
        "loaded",
        "preempted",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
    ];
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| (*s).to_owned()).collect()];
    for r in rows {
        let mut line = vec![
            r.policy.to_owned(),
            r.gpu_blocks
                .map_or_else(|| "-".to_owned(), |g| g.to_string()),
            r.cpu_blocks.to_string(),
        ];
        match (&r.error, &r.figures) {
            (None, Some(f)) => line.extend([
                format!("{:.1} %", f.reuse_pct),
                f.gpu_prefix_hit_tokens.to_string(),
                f.cpu_loaded_tokens.to_string(),
                f.tokens_computed.to_string(),
                bytes(f.bytes_stored),
                bytes(f.bytes_loaded),
                f.preemptions.to_string(),
                format!("{:.0} ms", f.ttft_ms_median),
                format!("{:.0} ms", f.ttft_ms_p99),
                format!("{:.1} ms", f.tpot_ms_median),
            ]),
            (e, _) => line.push(format!("stopped: {}", e.as_deref().unwrap_or("no figures"))),
        }
        lines.push(line);
    }
    let columns = header.len();
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            lines
                .iter()
                .filter(|l| l.len() == columns)
                .map(|l| l[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for l in &lines {
        let mut text = String::new();
        for (c, cell) in l.iter().enumerate() {
            if c > 0 {
                text.push_str("  ");
            }
            if c == 0 || l.len() != columns && c == l.len() - 1 {
                let _ = write!(text, "{cell:<w$}", w = widths[c]);
            } else {
                let _ = write!(text, "{cell:>w$}", w = widths[c]);
            }
        }
        let _ = writeln!(out, "{}", text.trim_end());
    }
    let _ = writeln!(
        out,
        "reuse: prompt tokens not computed, as GPU prefix hits and CPU loads (tokens); computed: \
         tokens the forward passes computed; stored/loaded: bytes to and from the CPU pool; \
         TTFT, TPOT: time to first token and per output token on the virtual clock"
    );
    out
}

/// The plot's points: one series per policy (and GPU pool, when the sweep has several).
fn points(rows: &[Row]) -> Vec<PlotPoint> {
    let mut gpus: Vec<Option<u32>> = rows.iter().map(|r| r.gpu_blocks).collect();
    gpus.sort_unstable();
    gpus.dedup();
    let several_gpus = gpus.len() > 1;
    rows.iter()
        .filter_map(|r| {
            let f = r.figures.as_ref()?;
            let series = match (several_gpus, r.gpu_blocks) {
                (true, Some(g)) => format!("{}, {g} GPU blocks", r.policy),
                _ => r.policy.to_owned(),
            };
            Some(PlotPoint {
                series,
                cpu_blocks: r.cpu_blocks,
                reuse_pct: f.reuse_pct,
                tokens_computed: f.tokens_computed,
            })
        })
        .collect()
}
