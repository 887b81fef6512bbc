//! `kvrelay bench tier`: the shared tier's IO against `redis-benchmark` on the same cluster
//! (flags and printing; the measurement is `kvrelay_engine::tier::bench`).

use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use kvrelay_engine::tier::TierConfig;
use kvrelay_engine::tier::bench::{self, Bench, BenchError, Setup};

pub(crate) const HELP: &str = "\
A value is one rank's shard of a chunk with its header (magic, version, length, CRC-32, the key
echoed): --shard-bytes plus about 80 bytes. The tier side runs the engine's own tier code on
CPU pools of that shape: a store reads the pools, frames and checksums every shard and sends one
MSET per chunk (--ranks values), pipelined per hash slot; a load sends one MGET per chunk,
checks every header and CRC-32 and writes the pools; every loaded byte is compared with what
was stored. One batch runs at a time, as one engine step's tier work does. redis-benchmark runs
`--cluster -t set,get` with -d the value's size, -c one client per master (the tier's cluster
client also holds one connection per node) and -P --pipeline. Both sides count whole values.
Each round measures both sides, one after the other, alternating which goes first; the
figures are medians of --repeat rounds. redis-benchmark --cluster notices the end of a test on
its 250 ms throughput tick, so its rate is a lower bound (within 10 % once a test lasts 2.5 s:
hence --redis-mib's default); the ratios are upper bounds.

Examples:
  tests/tier/cluster.sh start --port 7400 --dir /tmp/kvrelay-bench
  kvrelay bench tier --tier redis://127.0.0.1:7400
  kvrelay bench tier --tier redis://127.0.0.1:7400 --shard-bytes 8192 --pipeline 1 --json
  tests/tier/cluster.sh stop --dir /tmp/kvrelay-bench

Exit status: 0 when every size was measured, 1 when redis-benchmark, the cluster or a tier
batch failed, 2 on bad flags.";

/// `kvrelay bench tier` flags.
#[derive(Args, Debug, Clone)]
pub(crate) struct TierBenchArgs {
    /// The Redis Cluster, as `kvrelay run --tier` takes it: redis://HOST:PORT[,HOST:PORT...]
    /// (redis-benchmark starts from the first node).
    #[arg(long, value_name = "SPEC")]
    pub tier: String,
    /// Bytes of one rank's shard of a chunk (a value's payload), comma-separated: one
    /// measurement each [default: 8192 (kvrelay run's layout: 4 layers × 2,048 bytes),
    /// 131072].
    #[arg(long, value_delimiter = ',', value_name = "BYTES")]
    pub shard_bytes: Vec<u64>,
    /// Layers a shard is split into in the CPU pools (one span each).
    #[arg(long, default_value_t = 4)]
    pub layers: u32,
    /// Ranks: values per chunk, one MSET (MGET) each.
    #[arg(long, default_value_t = 2)]
    pub ranks: u32,
    /// Values in flight per connection (redis-benchmark -P).
    #[arg(long, default_value_t = 16)]
    pub pipeline: u32,
    /// MiB the tier moves per measurement and direction.
    #[arg(long, default_value_t = 1024)]
    pub mib: u64,
    /// MiB redis-benchmark moves per test (-n: this over the value's size). It notices a
    /// test's end on a 250 ms tick, so its rate is a lower bound: give it seconds of work.
    #[arg(long, default_value_t = 8192)]
    pub redis_mib: u64,
    /// Rounds (the figures are their medians).
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Deadline of each tier command, in milliseconds.
    #[arg(long, default_value_t = 2_000)]
    pub timeout_ms: u64,
    /// Measure one side only (to profile it; its ratio prints as 0).
    #[arg(long, default_value = "both", value_parser = ["both", "tier", "redis-benchmark"])]
    pub side: String,
    /// Print the figures as JSON (bytes per second) on stdout.
    #[arg(long)]
    pub json: bool,
}

/// One value size's figures.
#[derive(Debug, serde::Serialize)]
struct Measured {
    shard_bytes: u64,
    value_bytes: u64,
    values: u64,
    chunks_per_batch: usize,
    batches: u64,
    /// Per round, bytes per second: tier store, tier load, redis SET, redis GET.
    rounds: Vec<[f64; 4]>,
    tier_store: f64,
    tier_load: f64,
    redis_set: f64,
    redis_get: f64,
    store_ratio: f64,
    load_ratio: f64,
}

/// `kvrelay bench tier`: see [`HELP`].
pub(crate) fn run(args: &TierBenchArgs) -> ExitCode {
    let endpoints = match TierConfig::parse(&args.tier) {
        Ok(c) if c.endpoints != ["memory"] => c.endpoints,
        Ok(_) => return usage("--tier: a Redis Cluster (redis://HOST:PORT), not memory"),
        Err(e) => return usage(&e),
    };
    if args.repeat == 0 || args.mib == 0 || args.redis_mib == 0 {
        return usage("--repeat, --mib and --redis-mib must be at least 1");
    }
    let version = match bench::redis_benchmark_version() {
        Ok(v) => v,
        Err(e) => return failed(&e),
    };
    let rt = match kvrelay_engine::runtime() {
        Ok(rt) => rt,
        Err(e) => return failed(&BenchError::Setup(e.to_string())),
    };
    let sizes = if args.shard_bytes.is_empty() {
        vec![8192, 131_072]
    } else {
        args.shard_bytes.clone()
    };
    let mut all = Vec::new();
    let mut masters = 0;
    for shard in sizes {
        let setup = Setup {
            endpoints: endpoints.clone(),
            payload: shard,
            layers: args.layers,
            ranks: args.ranks,
            pipeline: args.pipeline,
            values: (args.mib << 20).div_ceil(shard).max(1),
            redis_values: (args.redis_mib << 20).div_ceil(shard).max(1),
            timeout: Duration::from_millis(args.timeout_ms.max(1)),
        };
        let mut b = match rt.block_on(Bench::connect(setup)) {
            Ok(b) => b,
            Err(BenchError::Setup(e)) => return usage(&e),
            Err(e) => return failed(&e),
        };
        masters = b.masters();
        match measure(&rt, &mut b, args, shard) {
            Ok(m) => all.push(m),
            Err(e) => return failed(&e),
        }
    }
    if args.json {
        print_json(args, &version, masters, &all);
    } else {
        print_table(args, &version, masters, &all);
    }
    ExitCode::SUCCESS
}

/// `--repeat` rounds of both sides, alternating which goes first.
fn measure(
    rt: &tokio::runtime::Runtime,
    b: &mut Bench,
    args: &TierBenchArgs,
    shard: u64,
) -> Result<Measured, BenchError> {
    let mut rounds = Vec::with_capacity(args.repeat);
    for round in 0..args.repeat {
        let tier_first = round % 2 == 0;
        let tier = |b: &mut Bench| match args.side.as_str() {
            "redis-benchmark" => Ok((0.0, 0.0)),
            _ => rt.block_on(b.tier_round()),
        };
        let redis = |b: &Bench| match args.side.as_str() {
            "tier" => Ok((0.0, 0.0)),
            _ => b.redis_round(),
        };
        let ((store, load), (set, get)) = if tier_first {
            let t = tier(b)?;
            (t, redis(b)?)
        } else {
            let r = redis(b)?;
            (tier(b)?, r)
        };
        if !args.json {
            eprintln!(
                "kvrelay bench tier: {shard} B, round {}: store {} / SET {}, load {} / GET {}",
                round + 1,
                rate(store),
                rate(set),
                rate(load),
                rate(get)
            );
        }
        rounds.push([store, load, set, get]);
    }
    let med = |i: usize| median(rounds.iter().map(|r| r[i]).collect());
    let (tier_store, tier_load, redis_set, redis_get) = (med(0), med(1), med(2), med(3));
    Ok(Measured {
        shard_bytes: shard,
        value_bytes: b.value_bytes(),
        values: b.batches() * b.chunks_per_batch() as u64 * u64::from(args.ranks),
        chunks_per_batch: b.chunks_per_batch(),
        batches: b.batches(),
        rounds,
        tier_store,
        tier_load,
        redis_set,
        redis_get,
        store_ratio: ratio(tier_store, redis_set),
        load_ratio: ratio(tier_load, redis_get),
    })
}

/// `a / b`, or 0 when a side was not measured (`--side`).
fn ratio(a: f64, b: f64) -> f64 {
    if a > 0.0 && b > 0.0 { a / b } else { 0.0 }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Bytes per second, readable.
fn rate(bps: f64) -> String {
    if bps >= 1e9 {
        format!("{:.2} GB/s", bps / 1e9)
    } else {
        format!("{:.0} MB/s", bps / 1e6)
    }
}

fn print_table(args: &TierBenchArgs, version: &str, masters: u32, all: &[Measured]) {
    println!(
        "tier IO against {version} on {} ({masters} masters): {masters} connections each side, \
         {} values in flight per connection, {} ranks (one MSET/MGET of {} values a chunk), \
         medians of {} rounds",
        args.tier, args.pipeline, args.ranks, args.ranks, args.repeat
    );
    println!(
        "{:>11} {:>11} {:>11} {:>11} {:>6}   {:>11} {:>11} {:>6}",
        "shard B", "value B", "tier store", "redis SET", "ratio", "tier load", "redis GET", "ratio"
    );
    for m in all {
        println!(
            "{:>11} {:>11} {:>11} {:>11} {:>5.0}%   {:>11} {:>11} {:>5.0}%",
            m.shard_bytes,
            m.value_bytes,
            rate(m.tier_store),
            rate(m.redis_set),
            100.0 * m.store_ratio,
            rate(m.tier_load),
            rate(m.redis_get),
            100.0 * m.load_ratio
        );
    }
    if args.side != "both" {
        println!("one side measured (--side {}): no ratio", args.side);
        return;
    }
    let worst = all
        .iter()
        .map(|m| m.store_ratio.min(m.load_ratio))
        .fold(f64::INFINITY, f64::min);
    let verdict = if worst >= 0.8 { "meets" } else { "misses" };
    println!(
        "lowest ratio {:.0} %: {verdict} issue 36's requirement (at least 80 %)",
        100.0 * worst
    );
}

fn print_json(args: &TierBenchArgs, version: &str, masters: u32, all: &[Measured]) {
    let out = serde_json::json!({
        "tier": args.tier,
        "redis_benchmark": version,
        "masters": masters,
        "connections": masters,
        "pipeline": args.pipeline,
        "ranks": args.ranks,
        "layers": args.layers,
        "repeat": args.repeat,
        "sizes": all,
    });
    println!("{out}");
}

fn usage(e: &str) -> ExitCode {
    eprintln!("kvrelay bench tier: {e}");
    ExitCode::from(2)
}

fn failed(e: &BenchError) -> ExitCode {
    eprintln!("kvrelay bench tier: {e}");
    ExitCode::FAILURE
}
