//! The request-trace format of the public Mooncake traces: one JSON object a line, `timestamp`
//! in ms, `input_length`, `output_length`, `hash_ids` (one id per prompt block of
//! `hash_block_tokens` tokens). [`read_trace`] validates every line and names the bad one;
//! [`write_trace`] writes records back in the same format.

use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// One request of a trace.
#[derive(Clone, Debug, Eq, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceRecord {
    /// Arrival, in ms from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Output tokens.
    pub output_length: u32,
    /// One id per prompt block of `hash_block_tokens` tokens (the last block may be partial).
    pub hash_ids: Vec<u64>,
}

/// A trace that cannot be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A line is not a trace record.
    #[error("{path}:{line}: {why}")]
    Record {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// Why.
        why: String,
    },
    /// The trace holds no request.
    #[error("{path}: no request")]
    Empty {
        /// The file.
        path: String,
    },
}

/// Reads a JSONL trace (gzip-compressed when its name ends in `.gz`). Blank lines are skipped; records must arrive in timestamp order, have at
/// least one prompt and one output token, and no more hash ids than prompt blocks.
pub fn read_trace(path: &Path, hash_block_tokens: u32) -> Result<Vec<TraceRecord>, TraceError> {
    let name = path.display().to_string();
    let file = std::fs::File::open(path).map_err(|source| TraceError::Io {
        path: name.clone(),
        source,
    })?;
    let reader: Box<dyn std::io::Read> = if name.ends_with(".gz") {
        Box::new(flate2::read::GzDecoder::new(file))
    } else {
        Box::new(file)
    };
    let mut out: Vec<TraceRecord> = Vec::new();
    for (i, line) in std::io::BufReader::new(reader).lines().enumerate() {
        let line = line.map_err(|source| TraceError::Io {
            path: name.clone(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| TraceError::Record {
            path: name.clone(),
            line: i + 1,
            why,
        };
        let r: TraceRecord = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
        if r.input_length == 0 || r.output_length == 0 {
            return Err(bad(
                "input_length and output_length must be at least 1".into()
            ));
        }
        let blocks = r.input_length.div_ceil(hash_block_tokens.max(1));
        if r.hash_ids.len() as u64 > u64::from(blocks) {
            return Err(bad(format!(
                "{} hash_ids for {} prompt blocks of {hash_block_tokens} tokens (a trace \
                 written with smaller hash blocks? give --hash-block-tokens)",
                r.hash_ids.len(),
                blocks
            )));
        }
        if let Some(prev) = out.last()
            && r.timestamp < prev.timestamp
        {
            return Err(bad(format!(
                "timestamp {} before the previous {}",
                r.timestamp, prev.timestamp
            )));
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(TraceError::Empty { path: name });
    }
    Ok(out)
}

/// Writes `records` as a JSONL trace.
pub fn write_trace(path: &Path, records: &[TraceRecord]) -> Result<(), TraceError> {
    let io = |source| TraceError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for r in records {
        let line = serde_json::to_string(r).expect("a trace record serializes");
        writeln!(f, "{line}").map_err(io)?;
    }
    f.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{WorkloadConfig, generate};

    // Protects trace validation: a bad line is a typed error naming the line.
    #[test]
    fn bad_trace_lines_name_the_line() {
        let dir = std::env::temp_dir().join(format!("kvrelay-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(
            &p,
            "{\"timestamp\":0,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1]}\n\n\
             {\"timestamp\":5,\"input_length\":10,\"output_length\":2,\"hash_ids\":[1,2]}\n",
        )
        .unwrap();
        let e = read_trace(&p, 16).unwrap_err().to_string();
        assert!(
            e.contains(":3: 2 hash_ids for 1 prompt blocks of 16 tokens"),
            "{e}"
        );
        assert_eq!(read_trace(&p, 5).unwrap().len(), 2);
        std::fs::write(&p, "{\"timestamp\":0}\n").unwrap();
        assert!(matches!(
            read_trace(&p, 8),
            Err(TraceError::Record { line: 1, .. })
        ));
        std::fs::write(&p, "\n").unwrap();
        assert!(matches!(read_trace(&p, 8), Err(TraceError::Empty { .. })));
        let recs = generate(&WorkloadConfig::default(), 64, 1);
        write_trace(&p, &recs).unwrap();
        assert_eq!(
            read_trace(&p, 64).unwrap(),
            recs,
            "written traces read back"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
