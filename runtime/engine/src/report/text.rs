//! The report as people read it: [`Report`]'s `Display`, the text `kvrelay run` prints.

use std::fmt;

use super::Report;

/// A byte count for people: `512 B`, `3.2 KB`, `44.4 MB`, `5.51 GB` (powers of 1000).
pub fn bytes(n: u64) -> String {
    let x = n as f64;
    if n < 1000 {
        format!("{n} B")
    } else if x < 1e6 {
        format!("{:.1} KB", x / 1e3)
    } else if x < 1e9 {
        format!("{:.1} MB", x / 1e6)
    } else {
        format!("{:.2} GB", x / 1e9)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = |a: u64, b: u64| {
            if b == 0 {
                0.0
            } else {
                100.0 * a as f64 / b as f64
            }
        };
        writeln!(
            f,
            "requests        {} submitted, {} finished ({} ranks, {} backend, seed {}, {:.1} s)",
            self.requests,
            self.finished,
            self.ranks,
            self.backend.name(),
            self.seed,
            self.wall_s
        )?;
        writeln!(
            f,
            "admission       max_model_len {}, {} GPU blocks and {} CPU blocks per rank, {} refused",
            self.max_model_len, self.gpu_blocks, self.cpu_blocks, self.refused
        )?;
        writeln!(
            f,
            "tokens          {} prompt, {} generated, {} computed by forward passes",
            self.prompt_tokens, self.generated_tokens, self.tokens_computed
        )?;
        writeln!(
            f,
            "prefix reuse    {} tokens ({:.1} % of prompts; at most {:.1} % from its own requests): {} GPU prefix hits, {} loaded from CPU",
            self.reused_tokens,
            pct(self.reused_tokens, self.prompt_tokens),
            self.reuse_bound_pct,
            self.gpu_prefix_hit_tokens,
            self.cpu_loaded_tokens
        )?;
        writeln!(
            f,
            "steps           {} ({} idle, {} scheduled ahead), {} preemptions, {} stores flushed before reuse",
            self.steps,
            self.idle_steps,
            self.scheduled_ahead,
            self.preemptions,
            self.flushed_stores
        )?;
        writeln!(
            f,
            "offload         {} blocks stored ({}, {:.2} GB/s), {} blocks loaded ({}, {:.2} GB/s), {} copies",
            self.blocks_offloaded,
            bytes(self.bytes_stored),
            self.store_gb_per_s,
            self.blocks_loaded,
            bytes(self.bytes_loaded),
            self.load_gb_per_s,
            self.copies
        )?;
        writeln!(
            f,
            "latency         {:.0} ms to first token median, {:.0} ms p99; {:.1} ms per output token median (virtual clock)",
            self.ttft_ms_median, self.ttft_ms_p99, self.tpot_ms_median
        )?;
        writeln!(
            f,
            "verified        {} loaded blocks at completion, {} token slots after writes, {} blocks at their first read",
            self.loaded_blocks_verified, self.written_slots_verified, self.read_blocks_checked
        )?;
        writeln!(
            f,
            "engine step     {:.1} µs median, {:.1} µs p99 (schedule + rank outputs + apply)",
            self.core_step_us_median, self.core_step_us_p99
        )?;
        writeln!(
            f,
            "rank hooks      {:.1} µs median, {:.1} µs p99 per step and rank (rank driver + worker connector)",
            self.rank_hooks_us_median, self.rank_hooks_us_p99
        )?;
        if let Some(k) = &self.kv_events {
            writeln!(
                f,
                "kv events       {} batches, {} events, {} bytes published; {} replays answered ({} refused)",
                k.batches, k.events, k.bytes, k.replays, k.bad_replays
            )?;
        }
        self.fmt_tier(f)?;
        if self.invariants_checked {
            write!(
                f,
                "invariants      held at every step ({} checks)",
                self.invariant_checks
            )
        } else {
            write!(f, "invariants      not checked (pass --check)")
        }
    }
}

impl Report {
    /// The shared tier's two lines, when there is one.
    fn fmt_tier(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(t) = &self.tier else {
            return Ok(());
        };
        writeln!(
            f,
            "tier            {} hits of {} probes; {} promotions loaded {} blocks ({} B); {} blocks ({} B) stored",
            t.tier_hits,
            t.tier_probes,
            t.tier_promotions,
            t.tier_blocks_loaded,
            t.tier_bytes_loaded,
            t.tier_blocks_stored,
            t.tier_bytes_stored
        )?;
        writeln!(
            f,
            "tier failures   {} loads, {} stores ({} missing, {} refused values, {} store errors, {} timeouts); {} reconnects; IO {:.0} µs median, {:.0} µs p99 per step",
            t.tier_load_failures,
            t.tier_store_failures,
            t.tier_values_missing,
            t.tier_values_refused,
            t.tier_io_errors,
            t.tier_timeouts,
            t.tier_reconnects,
            t.tier_batch_us_median,
            t.tier_batch_us_p99
        )?;
        if let Some(e) = &t.tier_first_error {
            writeln!(f, "tier error      {e} (the first)")?;
        }
        Ok(())
    }
}
