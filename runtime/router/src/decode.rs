//! vLLM 0.33.0's `KVEventBatch` from msgpack, validated: what a router reads off an engine's
//! PUB socket, kvrelay's or vLLM's. A frame that is not a batch of `BlockStored`,
//! `BlockRemoved` and `AllBlocksCleared` is a [`DecodeError`] naming what is wrong, never a
//! panic; fields a router does not use are checked for type only where they are read.

use kvrelay_core::Medium;
use kvrelay_engine::events::WireEvent;
use rmpv::Value;

/// A decoded batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The publisher's wall clock.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<WireEvent>,
}

/// Why a frame is not a `KVEventBatch`.
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error)]
pub enum DecodeError {
    /// Not msgpack, or trailing bytes.
    #[error("not msgpack: {0}")]
    Msgpack(String),
    /// msgpack of the wrong shape.
    #[error("not a KVEventBatch: {0}")]
    Shape(String),
}

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Decodes one payload frame.
pub fn decode_batch(mut bytes: &[u8]) -> Result<Batch, DecodeError> {
    let v =
        rmpv::decode::read_value(&mut bytes).map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !bytes.is_empty() {
        return Err(DecodeError::Msgpack(format!(
            "{} trailing bytes",
            bytes.len()
        )));
    }
    let Value::Array(items) = v else {
        return Err(shape("a batch is an array"));
    };
    if !(2..=3).contains(&items.len()) {
        return Err(shape(format!(
            "a batch has 2 or 3 fields, not {}",
            items.len()
        )));
    }
    let ts = match &items[0] {
        Value::F64(t) => *t,
        Value::F32(t) => f64::from(*t),
        other => match other.as_u64() {
            Some(t) => t as f64,
            None => return Err(shape("ts is not a number")),
        },
    };
    let Value::Array(raw) = &items[1] else {
        return Err(shape("events is not an array"));
    };
    let events = raw
        .iter()
        .enumerate()
        .map(|(i, e)| event(e).map_err(|err| shape(format!("event {i}: {err}"))))
        .collect::<Result<_, _>>()?;
    Ok(Batch { ts, events })
}

/// One tagged event (a map whose `type` names it).
fn event(v: &Value) -> Result<WireEvent, String> {
    let Value::Map(entries) = v else {
        return Err("an event is a map".into());
    };
    let field = |k: &str| {
        entries
            .iter()
            .find(|(key, _)| key.as_str() == Some(k))
            .map(|(_, v)| v)
    };
    let tag = field("type").and_then(Value::as_str).ok_or("no type tag")?;
    match tag {
        "AllBlocksCleared" => Ok(WireEvent::AllCleared),
        "BlockStored" => Ok(WireEvent::Stored {
            medium: medium(field("medium"))?,
            group: group(field("group_idx"))?,
            hashes: hashes(field("block_hashes"))?,
            parent: match field("parent_block_hash") {
                None | Some(Value::Nil) => None,
                Some(p) => Some(hash(p)?),
            },
            tokens: uints(field("token_ids"), "token_ids")?
                .into_iter()
                .map(|t| u32::try_from(t).map_err(|_| "a token id over u32".to_string()))
                .collect::<Result<_, _>>()?,
            block_size: field("block_size")
                .and_then(Value::as_u64)
                .and_then(|b| u32::try_from(b).ok())
                .ok_or("block_size is not a u32")?,
        }),
        "BlockRemoved" => Ok(WireEvent::Removed {
            medium: medium(field("medium"))?,
            group: group(field("group_idx"))?,
            hashes: hashes(field("block_hashes"))?,
        }),
        other => Err(format!("unknown event type {other:?}")),
    }
}

/// `medium`: `"GPU"`, `"CPU"`; vLLM's `None` means the GPU prefix cache.
fn medium(v: Option<&Value>) -> Result<Medium, String> {
    match v {
        None | Some(Value::Nil) => Ok(Medium::Gpu),
        Some(m) => match m.as_str() {
            Some("GPU") => Ok(Medium::Gpu),
            Some("CPU") => Ok(Medium::Cpu),
            _ => Err(format!("medium {m} is neither GPU nor CPU")),
        },
    }
}

/// `group_idx` (absent: group 0, as vLLM's older publishers).
fn group(v: Option<&Value>) -> Result<u32, String> {
    match v {
        None | Some(Value::Nil) => Ok(0),
        Some(g) => g
            .as_u64()
            .and_then(|g| u32::try_from(g).ok())
            .ok_or_else(|| format!("group_idx {g} is not a u32")),
    }
}

/// An `ExternalBlockHash`: an int (vLLM's default), or bytes (its low 8 bytes, big-endian).
fn hash(v: &Value) -> Result<u64, String> {
    if let Some(h) = v.as_u64() {
        return Ok(h);
    }
    match v {
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        _ => Err(format!("block hash {v} is neither an int nor bytes")),
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, String> {
    match v {
        Some(Value::Array(a)) => a.iter().map(hash).collect(),
        _ => Err("block_hashes is not an array".into()),
    }
}

fn uints(v: Option<&Value>, name: &str) -> Result<Vec<u64>, String> {
    match v {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().ok_or_else(|| format!("{name} holds {x}")))
            .collect(),
        _ => Err(format!("{name} is not an array")),
    }
}

#[cfg(test)]
mod tests {
    use kvrelay_engine::events::encode_batch;

    use super::*;

    /// Protects the round trip: what kvrelay's publisher encodes (held byte for byte to vLLM's
    /// encoder by `tests/kv_events`) decodes to the same events.
    #[test]
    fn decodes_what_the_publisher_encodes() {
        let events = vec![
            WireEvent::Stored {
                medium: Medium::Gpu,
                group: 0,
                hashes: vec![1, u64::MAX],
                parent: Some(7),
                tokens: vec![1, 2, 3, 4],
                block_size: 2,
            },
            WireEvent::Removed {
                medium: Medium::Cpu,
                group: 3,
                hashes: vec![5],
            },
            WireEvent::AllCleared,
        ];
        let b = decode_batch(&encode_batch(2.5, &events, 0)).unwrap();
        assert_eq!(b, Batch { ts: 2.5, events });
    }

    /// Protects the decoder's validation: truncated, foreign and mistyped frames are errors
    /// that say what is wrong, not panics and not events.
    #[test]
    fn bad_frames_are_typed_errors() {
        let good = encode_batch(1.0, &[WireEvent::AllCleared], 0);
        assert!(matches!(
            decode_batch(&good[..good.len() - 1]),
            Err(DecodeError::Msgpack(_))
        ));
        assert!(matches!(decode_batch(b"\x01"), Err(DecodeError::Shape(_))));
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(decode_batch(&trailing).is_err());
        let stored = WireEvent::Stored {
            medium: Medium::Gpu,
            group: 0,
            hashes: vec![1],
            parent: None,
            tokens: vec![1],
            block_size: 1,
        };
        let mut bytes = encode_batch(1.0, &[stored], 0);
        let at = bytes.windows(3).position(|w| w == b"GPU").unwrap();
        bytes[at..at + 3].copy_from_slice(b"TPU");
        let err = decode_batch(&bytes).unwrap_err().to_string();
        assert!(err.contains("event 0") && err.contains("medium"), "{err}");
    }
}
