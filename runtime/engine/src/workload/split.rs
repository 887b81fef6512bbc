//! One engine's share of a workload (`--trace-split K/N`): what each of N engines behind a router
//! that knows nothing of prefixes is sent.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::TraceRecord;

/// Engine K of N's share of a workload: the requests whose index in the workload (file order,
/// after `--requests` and `--until`) is K mod N — a round robin over arrivals, the rule of
/// `kvrelay route --policy round-robin`. A conversation's turns therefore land on different
/// engines, as they do behind a router that knows nothing of prefixes (the Mooncake traces
/// name no session to keep together). Written `K/N` on the command line and in TOML.
#[derive(Clone, Copy, Debug, Eq, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TraceSplit {
    part: u32,
    parts: u32,
}

impl TraceSplit {
    /// Engine `part` of `parts` (`part < parts`, `parts` from 1).
    pub fn new(part: u32, parts: u32) -> Result<Self, String> {
        if parts == 0 || part >= parts {
            return Err(format!(
                "trace split {part}/{parts}: K/N with N from 1 and K from 0 to N-1 (engine K of N)"
            ));
        }
        Ok(Self { part, parts })
    }

    /// K.
    pub fn part(self) -> u32 {
        self.part
    }

    /// N.
    pub fn parts(self) -> u32 {
        self.parts
    }

    /// The share of `records` (the whole workload, in order).
    pub fn share(self, records: Vec<TraceRecord>) -> Vec<TraceRecord> {
        let (k, n) = (self.part as usize, self.parts as usize);
        records
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % n == k)
            .map(|(_, r)| r)
            .collect()
    }

    /// The index in the whole workload of the share's `i`-th request: what its prompt's
    /// unique tokens derive from, so that every engine's requests are the whole workload's.
    pub fn index(self, i: usize) -> usize {
        i * self.parts as usize + self.part as usize
    }
}

impl FromStr for TraceSplit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("trace split {s:?}: expected K/N, engine K (from 0) of N");
        let (k, n) = s.split_once('/').ok_or_else(bad)?;
        let k = k.trim().parse().map_err(|_| bad())?;
        let n = n.trim().parse().map_err(|_| bad())?;
        Self::new(k, n)
    }
}

impl TryFrom<String> for TraceSplit {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

impl From<TraceSplit> for String {
    fn from(s: TraceSplit) -> String {
        s.to_string()
    }
}

impl fmt::Display for TraceSplit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.part, self.parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(n: u64) -> Vec<TraceRecord> {
        (0..n)
            .map(|i| TraceRecord {
                timestamp: i,
                input_length: 1,
                output_length: 1,
                hash_ids: vec![i],
            })
            .collect()
    }

    // Protects the split: the shares of N engines are disjoint, cover the workload, keep its
    // order, and `index` names each request's place in the whole.
    #[test]
    fn shares_partition_the_workload_in_order() {
        let all = records(11);
        let mut seen = Vec::new();
        for k in 0..3 {
            let s = TraceSplit::new(k, 3).unwrap();
            let share = s.share(all.clone());
            for (i, r) in share.iter().enumerate() {
                assert_eq!(all[s.index(i)], *r);
            }
            assert!(share.windows(2).all(|w| w[0].timestamp < w[1].timestamp));
            seen.extend(share.into_iter().map(|r| r.timestamp));
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..11).collect::<Vec<_>>());
        assert_eq!(TraceSplit::new(0, 1).unwrap().share(all.clone()), all);
    }

    // Protects the grammar and its errors, as a flag's value and as a config file's.
    #[test]
    fn k_of_n_parses_or_says_what_is_wrong() {
        assert_eq!("1/2".parse(), Ok(TraceSplit::new(1, 2).unwrap()));
        assert_eq!(TraceSplit::new(1, 2).unwrap().to_string(), "1/2");
        for bad in ["2/2", "0/0", "1", "a/2", "-1/2", "1/2/3", ""] {
            let e = bad.parse::<TraceSplit>().unwrap_err();
            assert!(e.starts_with("trace split"), "{bad}: {e}");
        }
        let json: TraceSplit = serde_json::from_str("\"0/3\"").unwrap();
        assert_eq!(json, TraceSplit::new(0, 3).unwrap());
        let e = serde_json::from_str::<TraceSplit>("\"3/3\"").unwrap_err();
        assert!(e.to_string().contains("engine K of N"), "{e}");
    }
}
