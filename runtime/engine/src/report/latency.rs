//! [`Latency`]: each request's times on the run's virtual clock (its arrival, its first token,
//! its finish), from which the report takes time to first token and time per output token.
//!
//! The virtual clock is the replay's: it advances `step_ms` per engine step and jumps to the
//! next arrival when the engine has nothing to do, so these figures are the same on every run
//! for a seed, whatever the machine (the wall clock's are not).

use kvrelay_core::RequestOutput;

use crate::workload::TraceRecord;

/// Per request of a run (indexed by its position in the trace, its `RequestId`): when it
/// arrived, when its first token came out and when it finished, in virtual ms, and the tokens
/// it generated.
#[derive(Clone, Debug, Default)]
pub struct Latency {
    arrival_ms: Vec<f64>,
    first_token_ms: Vec<Option<f64>>,
    finish_ms: Vec<Option<f64>>,
    tokens: Vec<u64>,
}

/// What the report shows of [`Latency`], in virtual ms.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LatencyFigures {
    pub ttft_ms_median: f64,
    pub ttft_ms_p99: f64,
    pub tpot_ms_median: f64,
}

impl Latency {
    /// A request's arrival is its trace timestamp: time to first token includes its wait for
    /// admission, as a client sees it.
    pub fn new(records: &[TraceRecord]) -> Self {
        let n = records.len();
        Self {
            arrival_ms: records.iter().map(|r| r.timestamp as f64).collect(),
            first_token_ms: vec![None; n],
            finish_ms: vec![None; n],
            tokens: vec![0; n],
        }
    }

    /// Records a step's outputs, which came out at virtual time `now_ms` (the end of the step).
    pub fn record(&mut self, now_ms: f64, outputs: &[RequestOutput]) {
        for o in outputs {
            let i = o.id.0 as usize;
            let Some(tokens) = self.tokens.get_mut(i) else {
                continue;
            };
            if !o.new_tokens.is_empty() {
                *tokens += o.new_tokens.len() as u64;
                self.first_token_ms[i].get_or_insert(now_ms);
            }
            if o.finish.is_some() {
                self.finish_ms[i].get_or_insert(now_ms);
            }
        }
    }

    /// Time to first token over the requests that produced one (median, p99), and the median
    /// over requests of the time per output token after the first (those with two or more).
    pub fn figures(&self) -> LatencyFigures {
        let mut ttft: Vec<f64> = Vec::with_capacity(self.arrival_ms.len());
        let mut tpot: Vec<f64> = Vec::with_capacity(self.arrival_ms.len());
        for (i, &arrival) in self.arrival_ms.iter().enumerate() {
            let Some(first) = self.first_token_ms[i] else {
                continue;
            };
            ttft.push(first - arrival);
            if let Some(finish) = self.finish_ms[i]
                && self.tokens[i] >= 2
            {
                tpot.push((finish - first) / (self.tokens[i] - 1) as f64);
            }
        }
        ttft.sort_by(f64::total_cmp);
        tpot.sort_by(f64::total_cmp);
        LatencyFigures {
            ttft_ms_median: super::quantile(&ttft, 0.5),
            ttft_ms_p99: super::quantile(&ttft, 0.99),
            tpot_ms_median: super::quantile(&tpot, 0.5),
        }
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_core::{FinishReason, RequestId};

    use super::*;

    fn out(id: u32, tokens: usize, finish: bool) -> RequestOutput {
        RequestOutput {
            id: RequestId(id),
            new_tokens: vec![0; tokens],
            finish: finish.then_some(FinishReason::LengthCapped),
            kv_transfer_params: None,
        }
    }

    // Protects the definitions: TTFT from the trace timestamp to the first token (prefill steps
    // without a token do not count), TPOT over the tokens after the first.
    #[test]
    fn ttft_counts_from_arrival_and_tpot_from_the_first_token() {
        let rec = |timestamp| TraceRecord {
            timestamp,
            input_length: 1,
            output_length: 3,
            hash_ids: vec![],
        };
        let mut l = Latency::new(&[rec(0), rec(100)]);
        l.record(25.0, &[out(0, 0, false)]);
        l.record(50.0, &[out(0, 1, false)]);
        l.record(150.0, &[out(0, 1, false), out(1, 1, false)]);
        l.record(250.0, &[out(0, 1, true), out(1, 2, true)]);
        l.record(300.0, &[out(7, 1, true)]);
        let f = l.figures();
        // TTFT: 50 and 50; TPOT: (250 - 50) / 2 and (250 - 150) / 2.
        assert_eq!(f.ttft_ms_median, 50.0);
        assert_eq!(f.ttft_ms_p99, 50.0);
        assert_eq!(f.tpot_ms_median, 100.0);
    }
}
