//! vLLM 0.33.0's KV-event wire format: a `KVEventBatch` as msgspec's msgpack encoder writes it.
//!
//! A batch is an array `[ts, events, data_parallel_rank]` (msgspec `array_like`); an event is a
//! map whose first entry is its tag, `"type": "BlockStored" | "BlockRemoved" |
//! "AllBlocksCleared"`, then its fields in declaration order, fields still at their default
//! (`None`) left out (`omit_defaults`). The ZMQ frames around it are `publisher`'s.

use kvrelay_core::{Medium, Token};
use rmp::encode as mp;

/// A KV event with vLLM's block hashes (the low 64 bits of its digests, as it publishes them).
#[derive(Clone, Debug, Eq, PartialEq)]
pub enum WireEvent {
    /// vLLM's `BlockStored`.
    Stored {
        /// Where the blocks are.
        medium: Medium,
        /// `group_idx`.
        group: u32,
        /// `block_hashes`.
        hashes: Vec<u64>,
        /// `parent_block_hash`.
        parent: Option<u64>,
        /// `token_ids`.
        tokens: Vec<Token>,
        /// `block_size`.
        block_size: u32,
    },
    /// vLLM's `BlockRemoved`.
    Removed {
        /// Where the blocks were.
        medium: Medium,
        /// `group_idx`.
        group: u32,
        /// `block_hashes`.
        hashes: Vec<u64>,
    },
    /// vLLM's `AllBlocksCleared`.
    AllCleared,
}

/// The msgpack bytes of `KVEventBatch(ts, events, data_parallel_rank)`.
pub fn encode_batch(ts: f64, events: &[WireEvent], data_parallel_rank: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    // Writing to a Vec cannot fail.
    let _ = write_batch(&mut out, ts, events, data_parallel_rank);
    // The replay buffer keeps the payload: no spare capacity kept with it.
    out.shrink_to_fit();
    out
}

fn write_batch(
    w: &mut Vec<u8>,
    ts: f64,
    events: &[WireEvent],
    dp_rank: u32,
) -> Result<(), mp::ValueWriteError> {
    mp::write_array_len(w, 3)?;
    mp::write_f64(w, ts)?;
    mp::write_array_len(w, events.len() as u32)?;
    for e in events {
        write_event(w, e)?;
    }
    mp::write_uint(w, u64::from(dp_rank))?;
    Ok(())
}

fn write_event(w: &mut Vec<u8>, e: &WireEvent) -> Result<(), mp::ValueWriteError> {
    match e {
        WireEvent::Stored {
            medium,
            group,
            hashes,
            parent,
            tokens,
            block_size,
        } => {
            // msgspec writes a map16 header for a struct of more than 15 fields (tag included)
            // whatever it leaves out: `BlockStored` has 15 and its tag.
            w.extend_from_slice(&[0xde, 0, 9]);
            entry_str(w, "type", "BlockStored")?;
            key(w, "block_hashes")?;
            uints(w, hashes.iter().copied())?;
            key(w, "parent_block_hash")?;
            match parent {
                Some(p) => mp::write_uint(w, *p).map(drop)?,
                None => nil(w)?,
            }
            key(w, "token_ids")?;
            uints(w, tokens.iter().map(|&t| u64::from(t)))?;
            key(w, "block_size")?;
            mp::write_uint(w, u64::from(*block_size))?;
            key(w, "lora_id")?;
            nil(w)?;
            entry_str(w, "medium", medium.as_str())?;
            key(w, "lora_name")?;
            nil(w)?;
            key(w, "group_idx")?;
            mp::write_uint(w, u64::from(*group))?;
        }
        WireEvent::Removed {
            medium,
            group,
            hashes,
        } => {
            mp::write_map_len(w, 4)?;
            entry_str(w, "type", "BlockRemoved")?;
            key(w, "block_hashes")?;
            uints(w, hashes.iter().copied())?;
            entry_str(w, "medium", medium.as_str())?;
            key(w, "group_idx")?;
            mp::write_uint(w, u64::from(*group))?;
        }
        WireEvent::AllCleared => {
            mp::write_map_len(w, 1)?;
            entry_str(w, "type", "AllBlocksCleared")?;
        }
    }
    Ok(())
}

fn nil(w: &mut Vec<u8>) -> Result<(), mp::ValueWriteError> {
    mp::write_nil(w).map_err(mp::ValueWriteError::InvalidMarkerWrite)
}

fn key(w: &mut Vec<u8>, k: &str) -> Result<(), mp::ValueWriteError> {
    mp::write_str(w, k)
}

fn entry_str(w: &mut Vec<u8>, k: &str, v: &str) -> Result<(), mp::ValueWriteError> {
    mp::write_str(w, k)?;
    mp::write_str(w, v)
}

fn uints(
    w: &mut Vec<u8>,
    items: impl ExactSizeIterator<Item = u64>,
) -> Result<(), mp::ValueWriteError> {
    mp::write_array_len(w, items.len() as u32)?;
    for v in items {
        mp::write_uint(w, v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Protects the batch's shape against msgspec's: these bytes are what
    /// `msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[BlockStored(block_hashes=[1, 2**64-1],
    /// parent_block_hash=None, token_ids=[7, 300], block_size=1, lora_id=None, medium="GPU",
    /// lora_name=None, group_idx=0), BlockRemoved(block_hashes=[5], medium="CPU", group_idx=0),
    /// AllBlocksCleared()], data_parallel_rank=0))` writes with vLLM 0.33.0's classes (the
    /// judge is `tests/kv_events`, which decodes every frame with them and re-encodes it).
    #[test]
    fn encodes_as_msgspec_does() {
        let events = [
            WireEvent::Stored {
                medium: Medium::Gpu,
                group: 0,
                hashes: vec![1, u64::MAX],
                parent: None,
                tokens: vec![7, 300],
                block_size: 1,
            },
            WireEvent::Removed {
                medium: Medium::Cpu,
                group: 0,
                hashes: vec![5],
            },
            WireEvent::AllCleared,
        ];
        let hex: String = encode_batch(1.5, &events, 0)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(hex, include_str!("wire_sample.hex").trim());
    }
}
