//! How a chunk shard is named and framed in the shared store.
//!
//! **Keys** are content-addressed: the chunk's block hash (the core's hash chain over the
//! prefix's tokens, the same in every process and on every machine), the KV cache group, the
//! rank, and a namespace naming the model and KV layout, so that engines with the same layout
//! share chunks and engines with another never read them. The Redis Cluster hash tag (`{…}`) is
//! the namespace and the hash's low byte: every rank's shard of a chunk lands in one slot (one
//! command reads or writes a whole chunk), and a step's chunks fall into 256 slot buckets (one
//! pipeline each) spread over the cluster's nodes.
//!
//! **Values** carry a header that is checked on every read, before a byte reaches the CPU pool:
//! a magic and format version, the payload length, the key echoed (a value written under
//! another key, or a foreign value, is refused) and a CRC-32 of the payload. A value that fails
//! any check is a failed load, never served.

use kvrelay_core::OffloadKey;

/// The first bytes of every value.
pub const MAGIC: [u8; 4] = *b"KVRT";

/// The value format's version.
pub const VERSION: u16 = 1;

/// Bytes before the key echo: magic, version, flags, payload length, CRC-32, key length.
const FIXED: usize = 4 + 2 + 2 + 8 + 4 + 4;

/// The key of `rank`'s shard of the chunk `key` in `namespace`:
/// `kvrelay:{NAMESPACE:LOW-BYTE}:HASH:gGROUP:rRANK`, the hash in 16 hex digits.
pub fn shard_key(namespace: &str, key: OffloadKey, rank: u32) -> String {
    format!(
        "kvrelay:{{{namespace}:{:02x}}}:{:016x}:g{}:r{rank}",
        key.hash.0 & 0xff,
        key.hash.0,
        key.group
    )
}

/// Why a value read from the store is refused.
#[derive(Clone, Debug, Eq, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ValueError {
    /// Shorter than its header says.
    #[error("truncated: {got} bytes, the header needs {need}")]
    Truncated { got: usize, need: usize },
    /// Not a kvrelay value.
    #[error("foreign value (no kvrelay magic)")]
    Foreign,
    /// A format this build does not read.
    #[error("format version {0}, this build reads {VERSION}")]
    Version(u16),
    /// Written under another key.
    #[error("written under another key")]
    WrongKey,
    /// The payload length differs from the chunk's.
    #[error("payload of {got} bytes, the chunk has {want}")]
    WrongLength { got: u64, want: u64 },
    /// The payload's checksum does not match.
    #[error("checksum mismatch")]
    Checksum,
}

/// Frames `payload` for `key`.
pub fn encode(key: &str, payload: &[u8]) -> Vec<u8> {
    encode_parts(key, &[payload])
}

/// Frames the payload made of `parts`, in order, for `key`: a chunk's layers straight from a
/// pool, copied once.
pub fn encode_parts(key: &str, parts: &[&[u8]]) -> Vec<u8> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut crc = crc32fast::Hasher::new();
    parts.iter().for_each(|p| crc.update(p));
    let mut out = Vec::with_capacity(FIXED + key.len() + len);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&(len as u64).to_le_bytes());
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    parts.iter().for_each(|p| out.extend_from_slice(p));
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The payload of `value`, checked: framed for `key`, `want` bytes long, checksum intact.
pub fn decode<'a>(key: &str, value: &'a [u8], want: u64) -> Result<&'a [u8], ValueError> {
    let short = |need: usize| ValueError::Truncated {
        got: value.len(),
        need,
    };
    if value.len() < FIXED {
        return Err(if value.starts_with(&MAGIC) || value.len() < 4 {
            short(FIXED)
        } else {
            ValueError::Foreign
        });
    }
    if value[..4] != MAGIC {
        return Err(ValueError::Foreign);
    }
    let version = u16::from_le_bytes([value[4], value[5]]);
    if version != VERSION {
        return Err(ValueError::Version(version));
    }
    let len = u64::from_le_bytes(value[8..16].try_into().expect("8 bytes"));
    let crc = u32_at(value, 16);
    let key_len = u32_at(value, 20) as usize;
    let payload_at = FIXED + key_len;
    if value.len() < payload_at {
        return Err(short(payload_at));
    }
    if &value[FIXED..payload_at] != key.as_bytes() {
        return Err(ValueError::WrongKey);
    }
    let payload = &value[payload_at..];
    if len != want || payload.len() as u64 != want {
        return Err(if (payload.len() as u64) < len {
            short(payload_at + len as usize)
        } else {
            ValueError::WrongLength {
                got: len.min(payload.len() as u64),
                want,
            }
        });
    }
    if crc32fast::hash(payload) != crc {
        return Err(ValueError::Checksum);
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::BlockHash;

    const KEY: &str = "kvrelay:ns:{00000000000000ff}:g0:r1";

    // Protects that a value is served only when it is exactly what was stored under its key:
    // every corruption the tier can meet is refused with its own error.
    #[test]
    fn only_an_intact_value_under_its_own_key_decodes() {
        let payload: Vec<u8> = (0..64u8).collect();
        let v = encode(KEY, &payload);
        assert_eq!(decode(KEY, &v, 64), Ok(&payload[..]));
        assert_eq!(decode("other", &v, 64), Err(ValueError::WrongKey));
        assert_eq!(
            decode(KEY, &v, 32),
            Err(ValueError::WrongLength { got: 64, want: 32 })
        );
        let mut flipped = v.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(decode(KEY, &flipped, 64), Err(ValueError::Checksum));
        assert!(matches!(
            decode(KEY, &v[..v.len() - 1], 64),
            Err(ValueError::Truncated { .. })
        ));
        assert!(matches!(
            decode(KEY, &v[..10], 64),
            Err(ValueError::Truncated { .. })
        ));
        assert_eq!(
            decode(KEY, b"hello world, not ours", 64),
            Err(ValueError::Foreign)
        );
        let mut newer = v;
        newer[4] = 9;
        assert_eq!(decode(KEY, &newer, 64), Err(ValueError::Version(9)));
    }

    // Protects the key format, which engines of other builds must share: the bytes of a key.
    #[test]
    fn shard_keys_are_spelled_as_documented() {
        for (hash, group, ns, rank, want) in [
            (
                0x0123_4567_89ab_cdef,
                12,
                "l4-b2048",
                305,
                "kvrelay:{l4-b2048:ef}:0123456789abcdef:g12:r305",
            ),
            (0xa, 0, "n", 0, "kvrelay:{n:0a}:000000000000000a:g0:r0"),
        ] {
            let key = OffloadKey {
                hash: BlockHash(hash),
                group,
            };
            assert_eq!(shard_key(ns, key, rank), want);
        }
    }

    // Protects cluster routing: every rank's shard of a chunk shares one hash tag (one slot).
    #[test]
    fn a_chunks_shards_share_one_hash_tag() {
        let key = OffloadKey {
            hash: BlockHash(0xab),
            group: 2,
        };
        let tag = |s: &str| s[s.find('{').unwrap()..=s.find('}').unwrap()].to_string();
        assert_eq!(tag(&shard_key("ns", key, 0)), tag(&shard_key("ns", key, 7)));
        assert_ne!(shard_key("ns", key, 0), shard_key("ns", key, 1));
        assert_ne!(shard_key("a", key, 0), shard_key("b", key, 0));
    }
}
